"""QuantArgmax (gpu/backends/cpu/kernels/quant_argmax.py, .cpp): a quantized LM head's argmax from
one plane of x, a bound and the candidates recomputed in three, against the full three-plane
product's argmax, the id for id result it must give. The two facts it rests on are checked on
their own: the bound holds on every output, and a product over some of W's rows gives those
outputs of the full product bit for bit (in each build of the kernel this machine can run). A
bound shrunk to nothing picks other ids on near ties: the comparison can fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from conveyor.gpu.backends.cpu.kernels import quant_argmax as qam
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.quant_argmax import ROW_CANDIDATES, ArgmaxTable, QuantArgmax, cpu_quant_argmax
from conveyor.gpu.backends.cpu.ops import ARGMAX_MIN_ROWS, CpuOps
from conveyor.gpu.models.layers import ParallelLMHead
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups
from tests.kernels.test_cpu_quant_linear import BUILDS, build

NATIVE = cpu_quant_argmax()
pytestmark = pytest.mark.skipif(
    NATIVE is None or not NATIVE.kernel.has_int8, reason="no C++ compiler for the CPU kernels, or no int8 path (AVX2)"
)

VOCAB, HIDDEN = 3000, 192
HEADS = [("u8", 16, True), ("u8", 64, False), ("u4", 32, True), ("u4", 64, False)]  # kind, group (16: K-quants), mins


def head(kind: str, group: int, mins: bool, seed: int, near_ties: bool = True) -> QuantizedWeight:
    """A quantized [VOCAB, HIDDEN] head, prepared for the kernel; near_ties: rows 2i + 1 copy rows
    2i but for a code a step away in about half the bytes, so pairs of logits differ by about as
    much as one plane's errors of them do."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_groups(torch.randn(VOCAB, HIDDEN, generator=g) * 0.05, kind, group)
    w.mins = w.mins if mins else None
    if near_ties:
        codes = w.qweight.clone()
        codes[1::2] = codes[0::2] ^ torch.randint(0, 2, codes[0::2].shape, generator=g, dtype=torch.uint8)
        w.scales[1::2], w.qweight = w.scales[0::2], codes
        if w.mins is not None:
            w.mins[1::2] = w.mins[0::2]
    assert NATIVE is not None
    w.prepared = NATIVE.kernel.prepare(w)
    return w


def rows(w: QuantizedWeight, m: int, seed: int) -> torch.Tensor:
    """x [m, HIDDEN] as decode rows are: near one token's row of W (a peaked distribution), plus
    noise, every block's scale different."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, VOCAB, (m,), generator=g)
    x = w.dequantize(rows=targets) * 40 + torch.randn(m, HIDDEN, generator=g)
    return (x * torch.rand(m, HIDDEN // 32, 1, generator=g).expand(m, HIDDEN // 32, 32).reshape(m, HIDDEN) * 3).contiguous()


NEAR_TIE_CALLS = 2000  # of 16 rows at most: one plane's argmax is wrong on 1 row in 300 to 2300 of them
NEAR_TIE_MISSES = 3  # rows one plane gets wrong, enough to stop at


@pytest.mark.parametrize("kind,group,mins", HEADS)
def test_the_bound_holds_on_every_output(kind, group, mins):
    """|full product - one plane| <= amax @ table^T, output by output, on peaked, random and wide rows,
    the full product in three planes or decoded to floats (past the int8 path's rows)."""
    assert NATIVE is not None
    w = head(kind, group, mins, seed=1)
    table = QuantArgmax.table(w)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(8, HIDDEN, generator=g) * torch.logspace(-3, 3, HIDDEN)  # inputs of every magnitude
    for x in (rows(w, 16, 3), torch.randn(16, HIDDEN, generator=g), wide.contiguous()):
        one = NATIVE.kernel(x, w, path="int8")
        amax = x.view(len(x), -1, 32).abs().amax(-1)
        bound = amax @ table.table.T
        for full in (NATIVE.kernel(x, w, path="int8x3"), NATIVE.kernel(x, w, path="direct")):
            assert ((full - one).abs() <= bound).all()
            assert ((full - one).abs() > bound / 100).any()  # not a vacuous bound: within 100x of the error


@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize("kind,group,mins", HEADS)
def test_a_product_over_some_rows_is_the_full_products_columns(kind, group, mins, build_name):
    """What the recompute relies on: the same row count, the same sums, whichever outputs."""
    kernel = build(build_name)
    w = head(kind, group, mins, seed=4)
    g = torch.Generator().manual_seed(5)
    for m in range(1, qam.MAX_ROWS + 1):
        x = rows(w, m, seed=m)
        full = kernel(x, w)
        some = torch.randperm(VOCAB, generator=g)[: 1 + m * 3].sort().values
        mins = None if w.mins is None else w.mins[some]
        sub = dataclasses.replace(w, qweight=w.qweight[some], scales=w.scales[some], mins=mins, prepared=None)
        assert torch.equal(kernel(x, sub), full[:, some])


@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize("kind,group,mins", HEADS)
def test_the_rows_read_in_place_are_the_full_products_columns(kind, group, mins, build_name):
    """CpuQuantLinear.subset, the recompute on the int8 path's rows: those outputs of the full
    product bit for bit, read from W in place, for rows in any order, repeated, at every place in a
    block of four; past the int8 path's rows it declines (the copy above serves those)."""
    kernel = build(build_name)
    w = head(kind, group, mins, seed=6)
    w.prepared = kernel.prepare(w)
    g = torch.Generator().manual_seed(7)
    for m in range(1, qam.MAX_ROWS + 1):
        x = rows(w, m, seed=20 + m)
        some = torch.cat([torch.randint(0, VOCAB, (1 + m * 3,), generator=g), torch.tensor([0, 1, 2, 3, VOCAB - 1, 5, 5])])
        got = kernel.subset(x, w, some.to(torch.int32))
        if m > kernel.int8_max_rows:
            assert got is None
            continue
        assert got is not None and torch.equal(got, kernel(x, w)[:, some])


@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize("kind,group,mins", HEADS)
def test_the_argmax_is_the_full_products(kind, group, mins, build_name):
    """Random rows (flat: many candidates, or past ROW_CANDIDATES and the full product) at every
    row count it takes, then peaked rows with near ties (rows of W a step apart), among
    which one plane alone picks wrong ids: the recompute must set them right."""
    assert NATIVE is not None
    argmax = QuantArgmax(build(build_name), load_library("quant_argmax"))
    w = head(kind, group, mins, seed=6)
    table = QuantArgmax.table(w)
    g = torch.Generator().manual_seed(7)
    for m in range(1, qam.MAX_ROWS + 1):
        x = torch.randn(m, HIDDEN, generator=g)
        ids, valid = argmax(x, w, table) or (None, None)
        assert valid is not None and valid.all() and torch.equal(ids, argmax.kernel(x, w).argmax(-1))
    one_plane_wrong = 0
    for seed in range(NEAR_TIE_CALLS):
        x = rows(w, 16, seed=seed)
        want = argmax.kernel(x, w).argmax(-1)
        ids, valid = argmax(x, w, table) or (None, None)
        assert valid is not None and valid.all() and torch.equal(ids, want)
        one_plane_wrong += int((argmax.kernel(x, w, path="int8").argmax(-1) != want).sum())
        if one_plane_wrong >= NEAR_TIE_MISSES:
            break
    assert one_plane_wrong > 0


def test_a_shrunken_bound_picks_other_ids_on_near_ties():
    """The planted bug: a bound of nothing keeps one plane's argmax alone, which near ties turn,
    so the comparison above fails."""
    assert NATIVE is not None
    w = head("u8", 32, True, seed=6)
    table = QuantArgmax.table(w)
    none = ArgmaxTable(table.table * 0, table.widest * 0)
    wrong = 0
    for seed in range(NEAR_TIE_CALLS):
        x = rows(w, 16, seed)
        wrong += int((NATIVE(x, w, none)[0] != NATIVE.kernel(x, w).argmax(-1)).sum())
        if wrong:
            break
    assert wrong > 0


def test_rows_that_are_not_finite_are_invalid_and_the_others_stand():
    assert NATIVE is not None
    w = head("u4", 32, True, seed=9)
    table = QuantArgmax.table(w)
    x = rows(w, 4, seed=11)
    x[1, 5], x[3, 70] = float("nan"), float("inf")
    ids, valid = NATIVE(x, w, table)
    assert valid.tolist() == [True, False, True, False] and ids[1] == ids[3] == 0
    want = NATIVE.kernel(x, w).argmax(-1)
    assert ids[0] == want[0] and ids[2] == want[2]
    x[:] = float("nan")
    ids, valid = NATIVE(x, w, table)
    assert not valid.any() and not ids.any()


def test_flat_rows_past_the_cap_take_the_full_product(monkeypatch):
    assert NATIVE is not None
    w = head("u8", 32, False, seed=12, near_ties=False)
    table = QuantArgmax.table(w)
    x = torch.randn(3, HIDDEN) * 1e-3
    monkeypatch.setattr(qam, "ROW_CANDIDATES", 1)
    calls = []
    kernel = NATIVE.kernel
    monkeypatch.setattr(NATIVE, "kernel", lambda *a, **k: calls.append(k.get("path")) or kernel(*a, **k))
    ids, valid = NATIVE(x, w, table)
    assert calls == ["int8", None]  # one plane, then the whole product (no recompute of candidates)
    assert valid.all() and torch.equal(ids, kernel(x, w).argmax(-1))
    assert ROW_CANDIDATES > 1


def test_past_its_rows_it_declines():
    assert NATIVE is not None
    w = head("u8", 32, True, seed=13)
    assert NATIVE(torch.randn(qam.MAX_ROWS + 1, HIDDEN), w, QuantArgmax.table(w)) is None


class TinyLM(nn.Module):
    def __init__(self, ops: CpuOps, w: QuantizedWeight) -> None:
        super().__init__()
        self.lm_head = ParallelLMHead(HIDDEN, VOCAB, ops)
        self.lm_head.register_parameter("weight", None)  # as gpu/quant/load.py leaves it
        self.lm_head.quantized = w


def test_the_cpu_ops_take_a_quantized_head_from_two_rows():
    assert NATIVE is not None
    ops = CpuOps(None, None, NATIVE.kernel, None, NATIVE)
    model = TinyLM(ops, head("u4", 32, True, seed=14))
    ops.prepare(model)
    assert isinstance(model.lm_head.prepared, ArgmaxTable)
    x = rows(model.lm_head.quantized, 3, seed=15)
    assert ops.argmax_product(x[:1], model.lm_head) is None and ARGMAX_MIN_ROWS > 1  # one row: the product is cheaper
    assert torch.equal(model.lm_head.argmax(x[:1])[0], model.lm_head(x[:1]).argmax(-1))  # the head takes the product's
    ids, valid = model.lm_head.argmax(x)
    assert valid.all() and torch.equal(ids, model.lm_head(x).argmax(-1))
    fp8 = TinyLM(ops, quantize_groups(torch.randn(VOCAB, HIDDEN), "e4m3", 32))
    ops.prepare(fp8)
    assert fp8.lm_head.prepared is None and ops.argmax_product(x, fp8.lm_head) is None  # no int8 path for e4m3
    assert torch.equal(fp8.lm_head.argmax(x)[0], fp8.lm_head(x).argmax(-1))
    plain = CpuOps(None, None, NATIVE.kernel)
    other = TinyLM(plain, head("u4", 32, True, seed=14))
    plain.prepare(other)
    assert plain.argmax_product(x, other.lm_head) is None
    assert torch.equal(other.lm_head.argmax(x)[0], other.lm_head(x).argmax(-1))
