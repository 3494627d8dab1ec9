"""Installed, Consilium is one name in site-packages: the wheel holds ``consilium`` and its metadata only,
every module of the repository's packages is in it, and every launcher points into it."""

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("crypto", "training", "protocol", "tallier", "orchestration", "scripts")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy, so that no earlier build/ folder lends the wheel a module
    source.mkdir()
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / file, source / file)
    for package in ("consilium", *PACKAGES):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        check=True,
        timeout=120,
    )
    (built,) = out.glob("consilium-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_top_level_name(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    assert {name for name in top if not name.endswith(".dist-info")} == {"consilium"}


def test_every_module_of_the_repository_is_in_the_wheel(wheel):
    wanted = {f"consilium/{path.relative_to(REPO)}" for package in PACKAGES for path in (REPO / package).rglob("*.py")}
    assert wanted - set(wheel.namelist()) == set()


def test_every_launcher_points_into_the_one_name(wheel):
    (entry_points,) = [name for name in wheel.namelist() if name.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    targets = dict(parser["console_scripts"])
    assert targets and all(target.startswith("consilium.scripts.") for target in targets.values())
    modules = {target.split(":")[0].replace(".", "/") + ".py" for target in targets.values()}
    assert modules <= set(wheel.namelist())
