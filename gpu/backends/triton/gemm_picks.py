"""Which kernel multiplies a quantized weight on the triton backend, by its format and the step's
rows: the table (`PICKS`) that the GPU tournament, ops/gpu/kernel_bench.py, measures and prints.

Formats and their kernels (each exact against QuantizedWeight.dequantize, tests/kernels/):
- "W4A16" (u4 weights): "tiles", quant_linear.py (the codes as stored, no copy); "words",
  quant_linear_words.py (codes reshuffled into 32-bit words at load); "tinygemm", int4pack.py
  (PyTorch's _weight_int4pack_mm, bf16 models only).
- "FP8" (e4m3 with a scale per output channel, on FP8 tensor cores): "scaled_mm", fp8_linear.py
  (activations quantized per token by fp8_quant_rows.py); "tiles", quant_linear.py weight-only.
A step of M rows takes the first bucket of ROW_BUCKETS that holds M (the Ms the tournament
times), else the last. Until a GPU run says otherwise every bucket names today's kernel, and
then a weight's form is that kernel's alone (quant_forms.py), as before this table existed.

Where the table names other kernels, the weight's form is a `Picked`: one form per kernel named
(a kernel that cannot take the weight falls back to the format's first), chosen by rows at each
call. A CUDA graph is captured per batch size, so each graph holds one kernel. A layout other
than "tiles"' is a second copy of the codes (the QuantizedWeight keeps its own): the price of
"words" or "tinygemm", about 4.1 bits a weight at G = 128, said in the tournament's output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from conveyor.gpu.backends.triton.fp8_linear import Fp8Weight, can_multiply_in_fp8, fp8_weight
from conveyor.gpu.backends.triton.int4pack import Int4PackWeight, int4pack_takes, int4pack_weight
from conveyor.gpu.backends.triton.quant_linear import KernelWeight, kernel_weight
from conveyor.gpu.backends.triton.quant_linear_words import WordWeight, word_weight, words_take
from conveyor.gpu.quant.weight import QuantizedWeight

ROW_BUCKETS = (1, 16, 64, 256)
# format -> the kernel for each bucket of ROW_BUCKETS. Filled from a GPU run (kernel_bench.py
# prints the table it measured); until then today's kernels.
PICKS: dict[str, tuple[str, ...]] = {
    "W4A16": ("tiles", "tiles", "tiles", "tiles"),
    "FP8": ("scaled_mm", "scaled_mm", "scaled_mm", "scaled_mm"),
}
DEFAULT = {"W4A16": "tiles", "FP8": "scaled_mm"}  # the format's kernel before the table (and the fallback)

Form = Fp8Weight | KernelWeight | WordWeight | Int4PackWeight


@dataclasses.dataclass(frozen=True)
class Picked:
    """A weight's forms by kernel, and the kernel for each bucket of ROW_BUCKETS."""

    forms: Mapping[str, Form]
    by_bucket: tuple[str, ...]

    def form_for(self, m: int) -> Form:
        bucket = next((i for i, top in enumerate(ROW_BUCKETS) if m <= top), len(ROW_BUCKETS) - 1)
        return self.forms[self.by_bucket[bucket]]


def format_of(weight: QuantizedWeight) -> str | None:
    """The table's format of `weight`; None: one the table does not cover (today's form alone)."""
    if weight.kind == "u4":
        return "W4A16"
    return "FP8" if can_multiply_in_fp8(weight) else None


def makers(weight: QuantizedWeight, dtype: torch.dtype) -> dict[str, Callable[[], Form]]:
    """Kernel name -> a maker of `weight`'s form for it, for the kernels that take the weight."""
    found: dict[str, Callable[[], Form]] = {}
    if weight.kind == "u4":
        found["tiles"] = lambda: kernel_weight(weight, dtype)
        if words_take(weight):
            found["words"] = lambda: word_weight(weight, dtype)
        if int4pack_takes(weight, dtype):
            found["tinygemm"] = lambda: int4pack_weight(weight, dtype)
    elif can_multiply_in_fp8(weight):
        found["scaled_mm"] = lambda: fp8_weight(weight)
        found["tiles"] = lambda: kernel_weight(weight, dtype)
    return found


def picks_more(weight: QuantizedWeight, picks: Mapping[str, tuple[str, ...]] | None = None) -> bool:
    """Whether the table names a kernel other than its format's default for `weight`."""
    fmt = format_of(weight)
    return fmt is not None and set((picks or PICKS)[fmt]) != {DEFAULT[fmt]}


def picked(weight: QuantizedWeight, dtype: torch.dtype, picks: Mapping[str, tuple[str, ...]] | None = None) -> Picked:
    """`weight`'s forms for the kernels the table names for its format (picks_more)."""
    fmt = format_of(weight)
    assert fmt is not None
    can = makers(weight, dtype)
    by_bucket = tuple(name if name in can else DEFAULT[fmt] for name in (picks or PICKS)[fmt])
    return Picked({name: can[name]() for name in dict.fromkeys(by_bucket)}, by_bucket)
