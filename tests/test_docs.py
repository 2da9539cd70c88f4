"""The reference in docs/ builds with `mkdocs build --strict`: a broken link or anchor, or a page
left out of the navigation, fails the build. The docs cite upstream issues, never internal
review rounds (those live in CHANGELOG.md)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

import safestage

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict_without_a_warning(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    for page in pages:
        built = tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")
        assert built.exists(), f"docs/{page}.md was not built"


def test_docs_and_front_page_cite_no_internal_review_rounds():
    rounds = re.compile(r"\b(review \d+|\w+ (hostile )?review\b|issue \d+)", re.I)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = rounds.findall(path.read_text())
        assert not found, f"{path.name} cites internal rounds: {found}"


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): the documented chunk size was not the one the code used")
def test_the_docs_state_the_chunk_size_the_code_uses():
    from safestage._publish import CHUNK_BYTES

    docs = Path(__file__).parents[1] / "docs"
    for page in ("guarantees.md", "design.md"):
        text = (docs / page).read_text()
        assert f"{CHUNK_BYTES >> 20} MiB chunks" in text, page
        assert "8 MiB chunks" not in text or CHUNK_BYTES == 8 << 20, page


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand of the `safestage` console script, by its words (``kit up``)."""
    from safestage.cli._main import _parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found[f"{words} {name}".strip()] = sub
                    walk(sub, f"{words} {name}")

    walk(_parser(), "")
    return found


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """The options a user can pass (those whose help is not suppressed), -h aside."""
    return [
        flag
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
        for flag in action.option_strings
    ]


@pytest.mark.regression("issue 30 item 14: docs/cli.md's `run` line lacked --background and --skip-local-disk")
def test_the_command_line_page_names_every_flag_of_every_subcommand():
    """Each subcommand's row (its usage in the first cell of docs/cli.md's table) names every
    option its argparse parser takes: the page is checked against the parser, not a count."""
    usages = [
        span
        for line in (ROOT / "docs" / "cli.md").read_text().splitlines()
        if line.startswith("| `safestage ")
        for span in re.findall(r"`([^`]+)`", line.split(" | ")[0])
    ]
    missing = {}
    for words, parser in _commands().items():
        mine = " ".join(span for span in usages if re.match(rf"safestage {re.escape(words)}(?![\w-])", span))
        assert mine, f"docs/cli.md has no row for `safestage {words}`"
        lacking = [flag for flag in _flags(parser) if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", mine)]
        if lacking:
            missing[words] = lacking
    assert not missing, f"docs/cli.md's usage lines lack flags the parser takes: {missing}"


@pytest.mark.regression("issue 30 item 14: README and docs/configuration.md said 6 options and 7 variables "
                        "(7 and 8 by then)")
def test_the_configuration_page_lists_every_option_and_variable_the_code_takes():
    import inspect

    from safestage import _config

    text = (ROOT / "docs" / "configuration.md").read_text()
    table = "\n".join(line for line in text.splitlines() if line.startswith("| "))
    signature = text[text.index("def staged(") : text.index(") -> Stage: ...")]
    options = [
        name
        for name, parameter in inspect.signature(safestage.staged).parameters.items()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    for name in options:
        assert f"{name}:" in signature, f"docs/configuration.md's staged() signature lacks {name}"
        assert re.search(rf"`{name}=?`", table), f"docs/configuration.md's table lacks the option {name}"
    variables = [value for key, value in vars(_config).items() if key.startswith("ENV_")]
    assert len(variables) >= 8
    for name in variables:
        assert f"`{name}`" in table, f"docs/configuration.md's table lacks the variable {name}"
    counts = re.compile(r"\b(\d+|one|two|three|four|five|six|seven|eight|nine|ten) (options|(environment )?variables)\b", re.I)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        counted = counts.search(path.read_text())
        assert counted is None, f"{path.name} counts the options or variables ({counted[0]!r}): a count goes stale"
