"""The front door names what safestage offers and links where it is explained: the README and
the docs' index page mention, as code, the commands and options a user looks for (`recover`,
`prune`, `kit`, `keep=`, `StagedWriter`) and link the DCP and retention pages; the reference
pages say what the code does (the Trainer callback's ``background=True`` and ``keep=``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FEATURES = ("recover", "prune", "kit", "keep=", "StagedWriter")


def code_of(markdown: str) -> str:
    """What a page shows as code: its fenced blocks and its inline code spans."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.S | re.M)
    return "\n".join([*fenced, *re.findall(r"`([^`\n]+)`", prose)])


def mentions(code: str, name: str) -> bool:
    """``name`` as a word of its own (``keep=`` followed by anything) in ``code``."""
    end = "" if name.endswith("=") else r"(?![A-Za-z0-9_])"
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}{end}", code) is not None


def links(markdown: str, target: str) -> bool:
    return re.search(rf"\]\({re.escape(target)}(#[^)]*)?\)", markdown) is not None


@pytest.mark.regression("issue 24: the README and docs/index.md never mentioned recover, prune, kit, keep= or "
                        "StagedWriter, and linked neither docs/dcp.md nor docs/retention.md")
@pytest.mark.parametrize(("page", "prefix"), [("README.md", "docs/"), ("docs/index.md", "")])
def test_the_front_pages_name_every_feature_and_link_dcp_and_retention(page: str, prefix: str) -> None:
    text = (ROOT / page).read_text()
    code = code_of(text)
    missing = [name for name in FEATURES if not mentions(code, name)]
    unlinked = [f"{prefix}{name}" for name in ("dcp.md", "retention.md") if not links(text, f"{prefix}{name}")]
    assert not missing and not unlinked, f"{page}: not mentioned as code: {missing}; not linked: {unlinked}"


@pytest.mark.regression("issue 24: docs/asynchronous.md said CommitCallback is synchronous and has no keep=")
def test_the_background_page_documents_commit_callback_background_and_keep() -> None:
    text = (ROOT / "docs" / "asynchronous.md").read_text()
    assert not re.search(r"CommitCallback`?\s+commits in place,\s+synchronously", text), "says CommitCallback is synchronous"
    assert "has no `keep=`" not in text, "says CommitCallback has no keep="
    assert re.search(r"CommitCallback\([^)]*background=True", text), "CommitCallback(background=True) is not documented"
    assert re.search(r"CommitCallback\([^)]*keep=", text), "CommitCallback(keep=...) is not documented"
