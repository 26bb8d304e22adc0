"""The form a QuantizedWeight takes on the triton backend (its `prepared`, set by TritonOps.prepare):
FP8 in the tensor cores where fp8_linear.py takes the weight (`Fp8Weight`), else quant_linear.py's
kernel (`KernelWeight`, float16 scales and mins for 16-bit activations), else none (the reference,
dequantize + F.linear); where gemm_picks.py's table names more kernels for the weight's format,
a `Picked` holding each one's form, chosen by the step's rows.

`form_of(weight, dtype)` makes it. `rows_of(form, rows)` cuts a stack's form (q/k/v or gate/up
stacked by gpu/backends/column_groups.py) to one layer's rows: views of the stack's tensors, so a
stack holds one set of float16 scales, not one for the stack and another for its layers.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch

from conveyor.gpu.backends.triton.fp8_linear import Fp8Weight, can_multiply_in_fp8, fp8_weight
from conveyor.gpu.backends.triton.gemm_picks import Form as KernelForm
from conveyor.gpu.backends.triton.gemm_picks import Picked, picked, picks_more
from conveyor.gpu.backends.triton.int4pack import Int4PackWeight, int4pack_rows
from conveyor.gpu.backends.triton.quant_linear import KernelWeight, kernel_takes, kernel_weight
from conveyor.gpu.backends.triton.quant_linear_words import WordWeight, words_rows
from conveyor.gpu.quant.weight import QuantizedWeight

Form = KernelForm | Picked  # one kernel's form, or several by rows


def form_type(weight: QuantizedWeight) -> type[Fp8Weight] | type[KernelWeight] | type[Picked] | None:
    """Which form `weight` takes; None: the reference. Picked: gemm_picks.py's table names more
    than one kernel for its format."""
    if picks_more(weight):
        return Picked
    if can_multiply_in_fp8(weight):
        return Fp8Weight
    if kernel_takes(weight):
        return KernelWeight
    return None


def form_of(weight: QuantizedWeight, dtype: torch.dtype) -> Form | None:
    """`weight`'s form for activations of `dtype`."""
    kind = form_type(weight)
    if kind is Picked:
        return picked(weight, dtype)
    if kind is Fp8Weight:
        return fp8_weight(weight)
    return kernel_weight(weight, dtype) if kind is KernelWeight else None


def rows_of(form: Form, rows: slice) -> Form:
    """A stack's form -> that of its output rows `rows` (views; an Fp8Weight's are its columns:
    it stores W^T; a Picked's, each of its forms'; the words and tinygemm layouts cut by their own
    modules)."""
    if isinstance(form, Picked):
        return Picked({name: cast(KernelForm, rows_of(f, rows)) for name, f in form.forms.items()}, form.by_bucket)
    if isinstance(form, WordWeight):
        return words_rows(form, rows)
    if isinstance(form, Int4PackWeight):
        return int4pack_rows(form, rows)
    if isinstance(form, Fp8Weight):
        return Fp8Weight(form.codes_t[:, rows], form.scale[:, rows])
    mins = None if form.mins is None else form.mins[rows]
    return dataclasses.replace(form, codes=form.codes[rows], scales=form.scales[rows], mins=mins)
