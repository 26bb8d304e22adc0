"""pyproject.toml lists every package under the design card's top-level folders (a package missing
from the list imports fine in an editable install and vanishes from a wheel)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setup["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert set(setup["packages"]) == found, sorted(found ^ set(setup["packages"]))
