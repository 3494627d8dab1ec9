"""The site's hooks, so that no page copies what lives elsewhere: ``<!-- README -->`` becomes README.md
(the home page), its links made relative to ``docs/``; ``<!-- launchers -->`` becomes every launcher's
``--help``, from its own parser. And the API reference reads the package as it installs: the folders
pyproject.toml maps under ``consilium`` are linked under ``build/api/consilium`` for mkdocstrings."""

import importlib
import os
from importlib.metadata import entry_points
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGES = ("crypto", "training", "protocol", "tallier", "orchestration", "scripts")
API_ROOT = ROOT / "build" / "api"  # mkdocs.yml's mkdocstrings paths


@event_priority(100)  # before mkdocstrings reads its paths
def on_config(config, **_):
    package = API_ROOT / "consilium"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("__init__.py", *PACKAGES):
        link = package / name
        if not link.is_symlink():
            link.symlink_to(ROOT / "consilium" / name if name == "__init__.py" else ROOT / name)
    return config


def _launchers() -> list[tuple[str, str]]:
    found = entry_points(group="console_scripts")
    return sorted((point.name, point.module) for point in found if point.module.startswith("consilium.scripts."))


def _reference() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: one width for every build
    sections = []
    for name, module in _launchers():
        parser = importlib.import_module(module).build_parser()
        parser.prog = name
        sections.append(f"## {name}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, **_) -> str:
    if "<!-- README -->" in markdown:
        markdown = markdown.replace("<!-- README -->", README.read_text().replace("](docs/", "]("))
    if "<!-- launchers -->" in markdown:
        markdown = markdown.replace("<!-- launchers -->", _reference())
    return markdown
