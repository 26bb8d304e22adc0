"""The layout: conveyor/{stages,wire,gpu,config} link to the top-level folders, setuptools finds
every package through them (a package it missed would import fine in an editable install and
vanish from a wheel), and an editable install is not shadowed by a `conveyor/` folder in the
working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("stages", "wire", "gpu", "config")


def test_the_layers_are_links_to_the_top_level_folders():
    for layer in LAYERS:
        link = ROOT / "conveyor" / layer
        assert link.is_symlink() and link.readlink() == Path("..", layer), link
        assert (ROOT / layer / "__init__.py").is_file()


def test_every_package_is_found():
    found = set(find_packages(str(ROOT), include=["conveyor*"]))
    expected = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "conveyor").rglob("__init__.py")
    }  # not through links
    for layer in LAYERS:
        for init in (ROOT / layer).rglob("__init__.py"):
            expected.add(".".join(["conveyor", *init.parent.relative_to(ROOT).parts]))
    assert found == expected, sorted(found ^ expected)


def test_a_conveyor_folder_in_the_working_directory_does_not_shadow_the_install(tmp_path):
    """Issue 28: run from the folder holding the clone, `from conveyor import LLM` found the
    clone's root as a namespace package ("unknown location")."""
    (tmp_path / "conveyor").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", "from conveyor import LLM; import conveyor.stages.scheduler.main as m; print(m.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == (ROOT / "stages" / "scheduler" / "main.py").resolve()
