"""What the pages cite exists: every test file, test function and results path that README.md and
the pages under docs/ name, and every flag they give a launcher. A renamed or removed test, or a flag a
launcher no longer has, fails here, not in a reader's hands. And every figure of README.md's results
table is one the file its row links to holds, so the copy cannot drift from its source."""

import importlib
import re
from decimal import ROUND_HALF_UP, Decimal
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


def _commands(name: str, arguments: str) -> list[tuple[str, str]]:
    """Whose flags ``arguments`` are: what follows ``consilium-admin submit --`` is a run's, consilium-server's."""
    if name == "consilium-admin" and " -- " in arguments:
        own, submitted = arguments.split(" -- ", 1)
        return [(name, own), ("consilium-server", submitted)]
    return [(name, arguments)]


def test_every_flag_a_page_gives_a_launcher_is_one_it_has():
    """The review pages are records of the code as it was, and are left out."""
    options, given, unknown = _launcher_options(), 0, []
    for page in (page for page in PAGES if "review" not in page.name):
        for block in _CODE.finditer(page.read_text()):
            for line in (block[1] or block[2]).splitlines():
                for call in _CALL.finditer(line):
                    for name, arguments in _commands(f"consilium-{call[1]}", call[2]):
                        for flag in _FLAG.findall(arguments) if name in options else ():
                            given += 1
                            if flag not in options[name]:
                                unknown.append(f"{page.relative_to(ROOT)}: {name} {flag}")
    assert given > 50  # the pattern still finds the pages' commands
    assert not unknown, "; ".join(sorted(set(unknown)))


# README's results table: each row's figures and the file its row links to, which is their source.
_ROW = re.compile(
    r"^\|(?P<what>[^|\n]*)\|(?P<measured>[^|\n]*)\|[^|\n]*\]\((?P<link>[^)\s]+)\)[^|\n]*\|\s*$", re.MULTILINE
)
_NUMBER = re.compile(
    r"(?<![\w.])(?P<number>\d{1,3}(?:,\d{3})+|\d+)(?P<decimals>\.\d+)?(?P<exponent>e[-+]?\d+)?"
    r"(?:\s?(?P<unit>%|x|ms|s|kB|MB))?(?![\w])"
)
_BYTES = {"kB": 3, "MB": 6}  # powers of ten
_SECONDS = {"ms": -3, "s": 0}


def _numbers(text: str) -> list[tuple[Decimal, str | None]]:
    """Every number in the text, thousands separators dropped, with the unit written after it."""
    return [
        (Decimal(f"{m['number'].replace(',', '')}{m['decimals'] or ''}{m['exponent'] or ''}"), m["unit"])
        for m in _NUMBER.finditer(text)
    ]


def _results_rows() -> list[tuple[str, str, str]]:
    table = ROOT.joinpath("README.md").read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    return [(row["what"].strip(), row["measured"].strip(), row["link"]) for row in _ROW.finditer(table)]


def _holds(source: list[tuple[Decimal, str | None]], figure: Decimal, unit: str | None) -> bool:
    """The source holds the figure: a number of its own that, in the figure's unit, is written to at
    least the figure's decimals and rounds to it. A number without a unit counts as a byte count (exact)
    against kB and MB, and as written against any other unit (a table's unit is in its header)."""
    step = Decimal(1).scaleb(min(figure.as_tuple().exponent, 0))
    for value, written in source:
        exact = False
        if unit in _BYTES and written is None:
            value, exact = value.scaleb(-_BYTES[unit]), True
        elif unit in _BYTES and written in _BYTES:
            value = value.scaleb(_BYTES[written] - _BYTES[unit])
        elif unit in _SECONDS and written in _SECONDS:
            value = value.scaleb(_SECONDS[written] - _SECONDS[unit])
        elif not (unit is None or written in (None, unit)):
            continue
        if (exact or value.as_tuple().exponent <= step.as_tuple().exponent) and value.quantize(
            step, rounding=ROUND_HALF_UP
        ) == figure:
            return True
    return False


def test_the_readme_results_table_is_found():
    rows = _results_rows()
    assert len(rows) >= 6 and all(_numbers(measured) for _, measured, _ in rows), rows


@pytest.mark.parametrize("what, measured, link", _results_rows(), ids=lambda value: str(value)[:40])
def test_every_figure_in_the_readme_results_table_is_in_the_file_its_row_links_to(what, measured, link):
    """A copy in the README cannot drift from its source: each number of a row's figures is one the
    linked file holds (thousands separators dropped, bytes as kB or MB, rounded to the README's decimals)."""
    source = ROOT / link
    assert source.is_file(), f"the row '{what}' links to {link}, which is not a file"
    numbers = _numbers(source.read_text())
    missing = [f"{figure}{unit or ''}" for figure, unit in _numbers(measured) if not _holds(numbers, figure, unit)]
    assert not missing, f"README's '{what}' gives {', '.join(missing)}, which {link} does not hold"
