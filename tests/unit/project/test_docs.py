"""What the pages cite exists: every test file, test function and results path that README.md and
the pages under docs/ name. A renamed or removed test fails here, not in a reader's hands."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted(page for page in (ROOT / "docs").rglob("*.md") if "results" not in page.parts)]
CITATION = re.compile(r"(?P<path>tests/[\w/]+\.py|results/[\w./-]*[\w/])(?:::(?P<test>\w+))?")


def _citations(page: Path) -> list[tuple[str, str | None]]:
    return [(match["path"], match["test"]) for match in CITATION.finditer(page.read_text())]


def test_the_pages_cite_something():
    assert sum(len(_citations(page)) for page in PAGES) > 100  # the pattern still finds what the pages cite


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_test_and_results_path_a_page_cites_exists(page):
    missing = []
    for path, test in _citations(page):
        cited = ROOT / path
        if not cited.exists():
            missing.append(path)
        elif test and not re.search(rf"^\s*(?:async )?def {test}\b", cited.read_text(), re.MULTILINE):
            missing.append(f"{path}::{test}")
    assert not missing, f"{page.name} cites what does not exist: {', '.join(sorted(set(missing)))}"
