"""Every function reads on one screen (at most 60 lines), and every module in one sitting (at most 400)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("crypto", "training", "protocol", "tallier", "orchestration", "scripts")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _modules() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def test_no_function_is_over_60_lines():
    long = sorted(
        f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, source in _modules().items()
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    )
    assert not long, "; ".join(long)


def test_no_module_is_over_400_lines():
    long = sorted(
        f"{name} ({len(source.splitlines())} lines)"
        for name, source in _modules().items()
        if len(source.splitlines()) > MAX_MODULE_LINES
    )
    assert not long, "; ".join(long)
