"""The layering of gpu/, read from the source (tests/gpu/import_graph.py): no import cycle inside
gpu/, not even through `if TYPE_CHECKING:` annotations, and no backend imports a model module
(they see the model's layers through the seam: gpu/backends/ops.py's Protocols and
prepared_layers.py's guards; the models import the backends).
`python -m tests.gpu.import_graph` prints what these find, with each edge's file and line."""

import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor.gpu.backends.prepared_layers import is_lm_head, is_ops_linear
from conveyor.gpu.models import build_model, read_model_config
from conveyor.gpu.models.layers import Linear, ParallelLMHead
from tests import gpu_checkpoints, moe_checkpoints
from tests.gpu import import_graph
from tests.gpu.import_graph import Edge, backend_model_imports, cycles, edges_of, graph

ALL_KINDS = frozenset({"module", "lazy", "typing"})


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return graph()


def test_no_import_cycle_inside_gpu(edges):
    assert cycles(edges, ALL_KINDS) == []


def test_no_backend_imports_a_model_module(edges):
    assert backend_model_imports(edges) == []


@pytest.mark.parametrize("name", [*gpu_checkpoints.ARCHS, *moe_checkpoints.MOE_ARCHS])
def test_the_backends_guards_pick_the_classes_they_replace(name):
    # The cpu ops' prepare tested isinstance(layer, Linear / ParallelLMHead); the guards of
    # gpu/backends/prepared_layers.py must pick the same modules in every family (MoE routers too).
    source = moe_checkpoints if name in moe_checkpoints.MOE_ARCHS else gpu_checkpoints
    config = read_model_config(source.checkpoint(name))
    with torch.device("meta"):  # no weights: the modules are what matters
        modules = list(build_model(config, "cpu").modules())
    assert [is_ops_linear(m) for m in modules] == [isinstance(m, Linear) for m in modules]
    assert [is_lm_head(m) for m in modules] == [isinstance(m, ParallelLMHead) for m in modules]
    assert sum(map(is_lm_head, modules)) == 1 and sum(map(is_ops_linear, modules)) > 2
    assert not is_ops_linear(nn.Linear(2, 2, device="meta"))  # torch's own: no `prepared` slot


def test_the_graph_sees_the_imports_it_must(edges):
    # The reader is what the two tests above trust: known edges of each kind are in it.
    found = {(e.source, e.target, e.kind) for e in edges}
    assert ("gpu/step/runner.py", "gpu/step/profile_steps.py", "module") in found
    assert ("gpu/lora/slots.py", "gpu/models/layers.py", "module") in found
    assert ("gpu/models/base.py", "gpu/backends/__init__.py", "lazy") in found  # torch_backend, inside __init__
    assert ("gpu/step/profile_steps.py", "gpu/models/base.py", "typing") in found
    assert ("gpu/backends/cpu/__init__.py", "gpu/backends/cpu/ops.py", "module") in found
    # and every file with an import line naming gpu/ (relative or absolute) has its edges
    line = re.compile(r"^\s*(from conveyor\.gpu[\s.]|import conveyor\.gpu|from \.)", re.M)
    importing = {p.relative_to(import_graph.ROOT).as_posix() for p in import_graph.GPU.rglob("*.py") if line.search(p.read_text())}
    assert len(importing) > 80 and importing == {e.source for e in edges}


def test_cycles_and_backend_imports_are_found(tmp_path: Path, monkeypatch):
    # A made-up gpu/ with a backend -> model import closing a loop through a lazy and a typing import.
    gpu = tmp_path / "gpu"
    files = {
        "__init__.py": "",
        "backends/__init__.py": "",
        "backends/ops.py": "from conveyor.gpu.models.layers import Linear\n",
        "models/__init__.py": "",
        "models/layers.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from ..lora import slots
            def build():
                from conveyor.gpu.backends import ops
        """,
        "lora/__init__.py": "",
        "lora/slots.py": "from conveyor.gpu.models import layers\n",
    }
    for name, text in files.items():
        (gpu / name).parent.mkdir(parents=True, exist_ok=True)
        (gpu / name).write_text(textwrap.dedent(text))
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    monkeypatch.setattr(import_graph, "GPU", gpu)
    edges = graph()
    assert {(e.source, e.target, e.kind) for e in edges_of(gpu / "models/layers.py")} == {
        ("gpu/models/layers.py", "gpu/lora/slots.py", "typing"),
        ("gpu/models/layers.py", "gpu/backends/ops.py", "lazy"),
    }
    assert cycles(edges) == [["gpu/backends/ops.py", "gpu/models/layers.py"]]  # runtime edges only
    # with the typing edge: one strongly connected component, both loops through models/layers.py
    assert cycles(edges, ALL_KINDS) == [["gpu/backends/ops.py", "gpu/lora/slots.py", "gpu/models/layers.py"]]
    assert [(e.source, e.target) for e in backend_model_imports(edges)] == [("gpu/backends/ops.py", "gpu/models/layers.py")]
    (gpu / "lora/slots.py").write_text("from conveyor.gpu.models.gone import layers\n")
    with pytest.raises(ValueError, match="no file of gpu/"):
        graph()  # an import the reader cannot place fails loudly, never a missing edge
