"""The SGMV path of the Triton backend's LoRA (gpu/backends/triton/lora_groups.py, lora_sgmv_shrink.py,
lora_sgmv_expand.py): tokens grouped by slot on the device, then shrink and expand over tiles of
one slot's tokens with tl.dot, against torch references and the per-token loop of
test_lora_ops.py.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py) on tiny shapes, in
float32 and float16 (the interpreter's bf16 arithmetic is wrong); they are compiled for sm_90 here
too (no spills, register counts printed), and captured in a CUDA graph on a GPU (marked cuda).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.kernels.test_lora_ops import DEVICE, adapters, assert_close, expand_reference, shrink_reference
from tests.triton_compile import compile_for_sm90

triton = pytest.importorskip("triton")

from conveyor.gpu.backends.triton import lora_groups as groups_module  # noqa: E402
from conveyor.gpu.backends.triton import lora_sgmv_expand as expand_module  # noqa: E402
from conveyor.gpu.backends.triton.backend import TritonOps  # noqa: E402
from conveyor.gpu.backends.triton.lora_groups import kernel_for, lora_groups, lora_groups_reference  # noqa: E402
from conveyor.gpu.backends.triton.lora_sgmv_expand import sgmv_expand, sgmv_expand_reference  # noqa: E402
from conveyor.gpu.backends.triton.lora_sgmv_shrink import sgmv_shrink, sgmv_shrink_reference  # noqa: E402

SGMV = ((1, "sgmv"),)
CASES = {  # name -> each token's slot (3 slots)
    "mixed, base rows": [0, -1, 2, 1, 0, -1, 2, 2, 1],
    "a slot with no rows": [0, 2, 0, -1, 2, 2],
    "every row one slot": [1] * 20,
    "one row": [2],
    "ragged segments": [0] * 17 + [1] + [2] * 22,  # BLOCK_M 16: tiles of 16 + 1, 1, 16 + 6
    "64-row tiles": [0] * 130 + [-1] * 3 + [2] * 67,  # BLOCK_M 64: tiles of 64, 64, 2 and 64, 3
    "base rows only": [-1] * 5,
}


def split(groups: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [S + 1 + T] -> (starts [S + 1], order [starts[S]]), int64 on the CPU."""
    starts = groups[: num_slots + 1].cpu().long()
    return starts, groups[num_slots + 1 : num_slots + 1 + int(starts[-1])].cpu().long()


MORE_SLOTS = {"5 slots": [3, 0, 4, 4, -1, 1] * 7, "1800 rows": list(range(-1, 5)) * 300}


@pytest.mark.parametrize("slots", [*CASES.values(), *MORE_SLOTS.values()], ids=[*CASES, *MORE_SLOTS])
def test_groups_are_a_stable_sort_by_slot_without_base_rows(slots):
    """1800 rows: two of the kernel's 1024-token chunks at 5 slots (BLOCK_S 8)."""
    num_slots = max(3, max(slots) + 1)
    t = torch.tensor(slots, device=DEVICE)
    groups = lora_groups(t, num_slots)
    assert groups.dtype == torch.int32 and groups.shape == (num_slots + 1 + len(slots),)
    starts, order = split(groups, num_slots)
    expected_starts, expected_order = lora_groups_reference(t, num_slots)
    assert torch.equal(starts, expected_starts) and torch.equal(order, expected_order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("fan_in", "ranks"), [(48, (16, 8, 4)), (600, (8, 5, 3))])
def test_shrink_matches_its_reference_and_the_per_token_loop(dtype, case, fan_in, ranks):
    """600 inputs: five BLOCK_K tiles over parts (the last ragged); ranks (8, 5, 3): R = 8, under
    tl.dot's least tile of 16, zero-padded per slot."""
    slots = torch.tensor(CASES[case], device=DEVICE)
    a, _, _ = adapters(fan_in, 32, dtype, ranks=ranks)
    x = torch.randn(len(slots), fan_in, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    groups = lora_groups(slots, len(ranks))
    starts, order = split(groups, len(ranks))
    xa = sgmv_shrink(x, a, groups)
    assert xa.dtype == torch.float32 and xa.shape[1:] == (len(slots), max(ranks))
    grouped = xa.sum(0)[: int(starts[-1])].cpu()
    if int(starts[-1]) == 0:  # base rows only: nothing grouped, nothing to compare
        return
    assert_close(grouped, sgmv_shrink_reference(x, a, starts, order), dtype)
    assert_close(grouped, shrink_reference(x, a, slots)[order], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["mixed, base rows", "a slot with no rows", "one row", "ragged segments"])
@pytest.mark.parametrize(("fan_out", "b_layout", "programs"), [(40, "slot", 256), (300, "output", 6), (300, "rank", 4)])
def test_expand_matches_its_reference_and_leaves_base_rows_alone(monkeypatch, dtype, case, fan_out, b_layout, programs):
    """B in each storage; programs: the expand's target, which, fewer, gives a program several of
    the three output tiles (at 6 and 4 tiles along the order: two, the second ragged and a third
    past the end; at 4: all three)."""
    monkeypatch.setattr(expand_module, "TARGET_PROGRAMS", programs)
    slots = torch.tensor(CASES[case], device=DEVICE)
    _, b, scales = adapters(32, fan_out, dtype, b_layout=b_layout)
    groups = lora_groups(slots, 3)
    starts, order = split(groups, 3)
    gen = torch.Generator().manual_seed(2)
    xa = torch.randn(2, len(slots), 16, generator=gen).to(DEVICE)  # two parts; rows past starts[S] unread
    y = torch.randn(len(slots), fan_out, generator=gen).to(DEVICE, dtype)
    before = y.clone()
    assert sgmv_expand(y, xa, b, scales, groups) is y
    assert_close(y, sgmv_expand_reference(before, xa.sum(0)[: int(starts[-1])], b, scales, starts, order), dtype)
    assert torch.equal(y[slots < 0], before[slots < 0])


def lora_step(ops: TritonOps, x, y, a, b, scales, slots) -> torch.Tensor:
    """One projection's update as gpu/lora/slots.py drives it: groups once, then lora_add."""
    return ops.lora_add(x, y, a, b, scales, slots, ops.lora_groups(slots, a.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_lora_add_over_groups_adds_each_tokens_own_adapter(dtype, case):
    """TritonOps with the table at SGMV: the per-token loop's result, into a strided y (columns of a
    fused projection's output), base rows and the other columns untouched."""
    ops = TritonOps(lora_kernels=SGMV)
    slots = torch.tensor(CASES[case], device=DEVICE)
    a, b, scales = adapters(600, 48, dtype, seed=3, b_layout="output")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(slots), 600, generator=gen).to(DEVICE, dtype)
    fused = torch.randn(len(slots), 80, generator=gen).to(DEVICE, dtype)
    before = fused.clone()
    y = fused[:, 16:64]
    assert lora_step(ops, x, y, a, b, scales, slots) is y
    assert_close(y, expand_reference(before[:, 16:64], shrink_reference(x, a, slots), b, scales, slots), dtype)
    assert torch.equal(fused[:, :16], before[:, :16]) and torch.equal(fused[:, 64:], before[:, 64:])
    assert torch.equal(fused[slots < 0], before[slots < 0])


def test_new_slots_in_the_same_buffers_give_the_new_result():
    """As a CUDA graph replays it: the same slots, x and y tensors, the slots' values changed in
    place between two steps (every launch's grid and constants come from shapes alone)."""
    ops = TritonOps(lora_kernels=SGMV)
    a, b, scales = adapters(64, 40, torch.float32, b_layout="output")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen).to(DEVICE)
    base = torch.randn(9, 40, generator=gen).to(DEVICE)
    y = base.clone()
    slots = torch.tensor(CASES["mixed, base rows"], device=DEVICE)
    for new in ([2, 2, -1, 0, 1, -1, -1, 0, 1], [1] * 9, [-1] * 9, [0, -1, -1, -1, -1, -1, -1, -1, 2]):
        slots.copy_(torch.tensor(new))
        y.copy_(base)
        lora_step(ops, x, y, a, b, scales, slots)
        assert_close(y, expand_reference(base, shrink_reference(x, a, slots), b, scales, slots), torch.float32)
        assert torch.equal(y[slots < 0], base[slots < 0])


def test_the_table_picks_the_kernels_by_rows(monkeypatch):
    assert kernel_for(1, ((1, "bgmv"), (64, "sgmv"))) == "bgmv" and kernel_for(63, ((1, "bgmv"), (64, "sgmv"))) == "bgmv"
    assert kernel_for(64, ((1, "bgmv"), (64, "sgmv"))) == "sgmv" and kernel_for(4096, ((1, "bgmv"), (64, "sgmv"))) == "sgmv"
    assert kernel_for(8, ((16, "sgmv"),)) == "bgmv"  # below the first entry: today's kernels
    slots = torch.zeros(70, dtype=torch.int64, device=DEVICE)
    monkeypatch.setattr(groups_module, "KERNEL_BY_ROWS", ((1, "bgmv"), (64, "sgmv")))
    assert TritonOps().lora_groups(slots[:63], 4) is None
    assert TritonOps().lora_groups(slots, 4) is not None and TritonOps(lora_kernels=((1, "bgmv"),)).lora_groups(slots, 4) is None


def test_sgmv_wrappers_refuse_mismatched_shapes():
    a, b, scales = adapters(32, 48, torch.float32)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    groups = lora_groups(slots, 3)
    with pytest.raises(ValueError, match="sgmv_shrink"):
        sgmv_shrink(torch.zeros(3, 40, device=DEVICE), a, groups)
    with pytest.raises(ValueError, match="sgmv_shrink"):
        sgmv_shrink(torch.zeros(4, 32, device=DEVICE), a, groups)  # groups of another T
    with pytest.raises(ValueError, match="sgmv_expand"):
        sgmv_expand(torch.zeros(3, 40, device=DEVICE), torch.zeros(1, 3, 16, device=DEVICE), b, scales, groups)
    with pytest.raises(ValueError, match="scales"):
        sgmv_expand(torch.zeros(3, 48, device=DEVICE), torch.zeros(1, 3, 16, device=DEVICE), b, scales[:2], groups)


@pytest.mark.cuda
def test_sgmv_captures_in_a_cuda_graph_with_slots_as_an_input():
    """The grouping, shrink and expand of a step replayed with other slots (base rows, an empty
    slot, one slot for all) give the eager result, and the per-token loop's within bf16 rounding."""
    ops, dtype = TritonOps(lora_kernels=SGMV), torch.bfloat16
    a, b, scales = adapters(4096, 1024, dtype, b_layout="output")
    rows = 40
    x = torch.randn(rows, 4096, device=DEVICE, dtype=dtype)
    y = torch.randn(rows, 1024, device=DEVICE, dtype=dtype)
    slots = torch.tensor(CASES["ragged segments"], device=DEVICE)
    base = y.clone()

    def step():
        y.copy_(base)
        return lora_step(ops, x, y, a, b, scales, slots)

    step()  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new in ([0, -1, 2] * 13 + [1], [2] * rows, [-1] * rows, [0] * 20 + [2] * 20):
        slots.copy_(torch.tensor(new, device=DEVICE))
        graph.replay()
        replayed = y.clone()
        torch.testing.assert_close(replayed, step(), rtol=0, atol=0)
        assert_close(replayed, expand_reference(base, shrink_reference(x, a, slots), b, scales, slots), dtype)
        assert torch.equal(replayed[slots < 0], base[slots < 0])


COMPILE_FOR_SM90 = textwrap.dedent("""
    import os, re, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton import lora_groups, lora_sgmv_expand, lora_sgmv_shrink

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def compile_(fn, types, constexprs, num_warps=4):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        source = ASTSource(fn, signature, constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True)
        spills = re.search(r"(\\d+) bytes spill stores", info.stderr)
        registers = re.search(r"Used (\\d+) registers", info.stderr)
        assert spills and spills.group(1) == "0", (fn.__name__, constexprs, info.stderr[-2000:])
        blocks = {k: v for k, v in constexprs.items() if k.startswith("BLOCK")}
        print(fn.__name__, blocks, num_warps, "warps:", registers.group(1), "registers")

    for block_s in (1, 4, 64):
        block_t = max(16, min(1024, lora_groups.HIT_TILE // block_s))
        compile_(lora_groups._lora_groups_kernel, dict(slots_ptr="*i64", groups_ptr="*i32"), dict(BLOCK_T=block_t, BLOCK_S=block_s))
    for dtype in ("bf16", "fp16", "fp32"):
        precision, size = ("ieee", 4) if dtype == "fp32" else (None, 2)
        for block_m, block_r, block_s in ((16, 16, 4), (32, 16, 4), (64, 16, 4), (16, 64, 64), (32, 64, 4), (64, 64, 64)):
            common = dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_S=block_s, UPCAST=False, PRECISION=precision)
            types = dict(x_ptr="*" + dtype, a_ptr="*" + dtype, groups_ptr="*i32", xa_ptr="*fp32")
            shrink = dict(common, BLOCK_K=lora_sgmv_shrink.block_k(14336, block_m, block_r, size), PART_TILES=4)
            compile_(lora_sgmv_shrink._sgmv_shrink_kernel, types, shrink, lora_sgmv_shrink.num_warps(block_m, block_r))
            types = dict(y_ptr="*" + dtype, xa_ptr="*fp32", b_ptr="*" + dtype, scales_ptr="*fp32", groups_ptr="*i32")
            expand = dict(common, BLOCK_N=lora_sgmv_expand.block_n(4096, size), N_TILES=4)
            compile_(lora_sgmv_expand._sgmv_expand_kernel, types, expand, lora_sgmv_shrink.num_warps(block_m, block_r))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU test compiles and runs the kernels")
def test_kernels_compile_for_sm90_without_spills():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=400)
