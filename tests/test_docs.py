"""The reference in docs/ builds with `mkdocs build --strict`: a broken link or anchor, or a page
left out of the navigation, fails the build. The docs cite upstream issues, never internal
review rounds (those live in CHANGELOG.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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
