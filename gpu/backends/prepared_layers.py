"""Which of a model's modules an ops' `prepare` re-lays out, told by what they carry, not by class.

An ops' `prepare(model)` walks model.modules() once after loading and gives some layers their own
form of the weight (`prepared`: the cpu ops' transposed storage, a quantized head's argmax table).
It finds them here by attribute, as column_groups.py finds sibling projections by their
`sibling_projections()`, so that the backends import no model module: gpu/models imports
gpu/backends (each layer holds its ops), never the other way round (tests/gpu/test_import_graph.py).

Invariants: a guard holds for gpu/models/layers.py's `Linear` and its subclasses only (the only
modules with a `prepared` slot); `is_lm_head` for its `ParallelLMHead` only (the only one of them
with an `argmax` method, the caller of Ops.argmax_product).
"""

from __future__ import annotations

from typing import Protocol, TypeGuard

from torch import nn

from conveyor.gpu.backends.ops import LinearLayer


class PreparedLayer(LinearLayer, Protocol):
    """A LinearLayer as `prepare` sees it: it sets `prepared` (and may re-lay `weight`'s storage)."""

    prepared: object | None


def is_ops_linear(module: nn.Module) -> TypeGuard[PreparedLayer]:
    """An nn.Linear whose product is the ops' (`ops.linear` or `ops.quant_linear`), told from a
    plain nn.Linear by its `prepared` slot."""
    return isinstance(module, nn.Linear) and hasattr(module, "prepared")


def is_lm_head(module: nn.Module) -> TypeGuard[PreparedLayer]:
    """Such a layer that asks the ops for its rows' argmax (Ops.argmax_product), told by its
    `argmax` method."""
    return is_ops_linear(module) and callable(getattr(module, "argmax", None))
