"""The serving path never imports the tooling: stages/, gpu/, wire/ and config/ take nothing from
conveyor.bench (the benchmark clients), conveyor.sim (the simulator) or conveyor.tiny (the tiny
checkpoint generator), at module level or inside a function. The front door reaches the tooling
only where a command asks for it, by name below. Read from the source with `ast` (nothing is
imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("stages", "gpu", "wire", "config")
TOOLING = ("conveyor.bench", "conveyor.sim", "conveyor.tiny")
# The front door's lazy entry points into the tooling: `conveyor bench ...` and `--model tiny`.
FRONT_DOOR_ALLOWED = {
    ("conveyor/cli.py", "conveyor.bench"),
    ("conveyor/default_model.py", "conveyor.tiny.checkpoint"),
}


def tooling_imports(path: Path) -> list[str]:
    """The tooling modules `path` imports (`import x` or `from x import y`, anywhere in it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found += [n for n in names if n in TOOLING or n.startswith(tuple(t + "." for t in TOOLING))]
    return sorted(set(found))


@pytest.mark.parametrize("folder", SERVING)
def test_the_serving_path_imports_no_tooling(folder):
    offenders = {str(p.relative_to(ROOT)): got for p in (ROOT / folder).rglob("*.py") if (got := tooling_imports(p))}
    assert not offenders


def test_the_front_door_reaches_the_tooling_only_where_a_command_asks():
    for path in sorted((ROOT / "conveyor").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        for name in tooling_imports(path):
            assert any(rel == f and (name == m or name.startswith(m + ".")) for f, m in FRONT_DOOR_ALLOWED), (rel, name)


def test_the_check_sees_an_import_of_the_tooling(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from conveyor.sim.simulator import simulate\n\nimport conveyor.tiny.lora\n")
    assert tooling_imports(probe) == ["conveyor.sim.simulator", "conveyor.sim.simulator.simulate", "conveyor.tiny.lora"]
