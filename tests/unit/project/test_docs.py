"""What the pages cite exists: every test file, test function and results path that README.md and
the pages under docs/ name, and every flag they give a launcher. A renamed or removed test, or a flag a
launcher no longer has, fails here, not in a reader's hands."""

import importlib
import re
from importlib.metadata import entry_points
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


# A launcher's command in a code span or block, up to the next command or shell operator.
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
_CALL = re.compile(r"consilium-([a-z-]+)(.*?)(?=consilium-[a-z]|$|&&|\||;)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _launcher_options() -> dict[str, set[str]]:
    options = {}
    for point in entry_points(group="console_scripts"):
        if point.module.startswith("consilium.scripts."):
            parser = importlib.import_module(point.module).build_parser()
            options[point.name] = {flag for action in parser._actions for flag in action.option_strings}
    return options


def test_every_flag_a_page_gives_a_launcher_is_one_it_has():
    """The review pages are records of the code as it was, and are left out."""
    options, given, unknown = _launcher_options(), 0, []
    for page in (page for page in PAGES if "review" not in page.name):
        for block in _CODE.finditer(page.read_text()):
            for line in (block[1] or block[2]).splitlines():
                for call in _CALL.finditer(line):
                    name = f"consilium-{call[1]}"
                    for flag in _FLAG.findall(call[2]) if name in options else ():
                        given += 1
                        if flag not in options[name]:
                            unknown.append(f"{page.relative_to(ROOT)}: {name} {flag}")
    assert given > 50  # the pattern still finds the pages' commands
    assert not unknown, "; ".join(sorted(set(unknown)))
