"""The product speaks of the product: no words about how it was made (a numbered session, issue or
ticket) in the README, the docs, the deploy files, the code or the tests. A figure's history lives
in git, not in the text. (This file holds the pattern's own examples and is not scanned.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAKING = re.compile(r"\b(sessions?|issues?|tickets?)\s+#?\d", re.I)
TREES = ["kernel", "bus", "policy", "delta_codec", "envs", "trainer", "scorer", "rollout_worker",
         "asyncrl", "bench", "tests", "docs", "deploy"]  # fmt: skip
FILES = ["README.md", "Makefile", "Dockerfile", "pyproject.toml", ".ci/run"]
SUFFIXES = {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".conf", ".service", ".env", ".json", ".mjs", ""}


def product_files() -> list[Path]:
    out = [ROOT / f for f in FILES if (ROOT / f).is_file()]
    for tree in TREES:
        out += [p for p in (ROOT / tree).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    return [p for p in out if "__pycache__" not in p.parts and p != Path(__file__).resolve()]


def test_no_words_about_how_the_project_was_made():
    hits = []
    for p in product_files():
        text = p.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if MAKING.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "words about the making of the project, not the product:\n" + "\n".join(hits)


def test_the_check_finds_what_it_looks_for():
    for line in ("measured in session 12", "see issue #34", "Issues 3 and 4", "Session 1:"):
        assert MAKING.search(line), line
    for line in ("start_new_session=True", "the pytest session fixture", "an issue with 3 parts"):
        assert not MAKING.search(line), line


def test_the_readme_is_one_page():
    """The README is the product's front page: what it is, the two commands, where to go next and one
    table of figures; the detail lives in docs/ (150 lines at most)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
