"""Every backend's batched LoRA (`Ops.lora_shrink`, `Ops.lora_expand`: the torch default, the cpu
ops' C++ kernels of gpu/backends/cpu/kernels/lora.cpp, the Triton kernels of
gpu/backends/triton/lora.py) against a per-token loop in float32.

A step mixes tokens of three adapter slots of different ranks (zero-padded to R) and base-model
tokens (slot -1), whose xa rows must be exactly zero and whose y rows exactly unchanged. Without
CUDA the Triton kernels run under its interpreter (TRITON_INTERPRET=1, set by tests/conftest.py),
on tiny shapes; they are compiled for sm_90 here too (no spills), and captured in a CUDA graph on
a GPU (marked cuda). Tolerances are a fraction of the result's largest magnitude: 1e-5 in float32;
2e-3 in float16, where the torch default rounds xa and the update to fp16 before adding (two
roundings where the kernels make one); 8e-3 in bfloat16 (on a GPU only).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from conveyor.gpu.backends.cpu.kernels import CpuLora, cpu_lora, isa
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.ops import CpuOps
from conveyor.gpu.backends.ops import Ops
from conveyor.gpu.backends.torch import TorchOps
from tests.triton_compile import compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
BACKENDS = ["torch", "cpu", "cpu-avx2", "triton"]  # cpu-avx2: lora.cpp built for x86-64-v3, as an AVX2 machine runs it
SLOTS = [0, -1, 2, 1, 0, -1, 2, 2, 1]  # T = 9: every slot, and base-model tokens between them
RANKS = (16, 8, 4)  # each slot's adapter rank; R = 16
NARROW_RANKS = (8, 5, 3)  # R = 8: under the kernels' least tile of 16, so their masks matter
SCALES = (0.5, 2.0, 0.25)


def make_ops(name: str) -> Ops:
    if name == "torch":
        return TorchOps()
    if name == "cpu":
        lora = cpu_lora()
        assert lora is not None, "lora.cpp did not build"
        return CpuOps(None, None, None, lora)
    if name == "cpu-avx2":
        if isa.missing_features(isa.VARIANTS["x86-64-v3"]) != []:
            pytest.skip("this CPU cannot run x86-64-v3 (AVX2) code")
        lib = load_library("lora", "x86-64-v3")
        assert lib is not None, "lora.cpp did not build for AVX2"
        return CpuOps(None, None, None, CpuLora(lib))
    pytest.importorskip("triton")
    from conveyor.gpu.backends.triton.backend import TritonOps

    return TritonOps()


def shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    xa = torch.zeros(x.shape[0], a.shape[1])
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            xa[t] = a[slot].cpu().float() @ x[t].cpu().float()
    return xa


def expand_reference(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = y.cpu().float()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += scales[slot].item() * (b[slot].cpu().float() @ xa[t].cpu().float())
    return out


def adapters(
    fan_in: int, fan_out: int, dtype: torch.dtype, seed: int = 0, b_layout: str = "slot", ranks: tuple[int, ...] = RANKS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [S, R, in], b [S, out, R] with slot s's rows (of a) and columns (of b) past ranks[s] zero,
    as the slot stacks hold them; scales [S] float32. b_layout: its storage, "slot" [S, out, R],
    "output" [out, S, R] (TritonOps.lora_b's) or "rank" [S, R, out] (the default Ops.lora_b's:
    each slot's B^T), b a view."""
    gen = torch.Generator().manual_seed(seed)
    max_rank = max(ranks)
    a = torch.zeros(len(ranks), max_rank, fan_in)
    b = torch.zeros(len(ranks), fan_out, max_rank)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        b[s, :, :rank] = torch.randn(fan_out, rank, generator=gen)
    if b_layout == "output":
        b = b.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    elif b_layout == "rank":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), torch.tensor(SCALES, device=DEVICE)


def summed(xa: torch.Tensor) -> torch.Tensor:
    """xa [T, R], or [P, T, R] partial sums (the Triton kernels' form: Ops.lora_shrink) -> [T, R]."""
    return xa.sum(0) if xa.dim() == 3 else xa


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    bound = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=0, atol=bound)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("fan_in", "ranks"), [(48, RANKS), (64, NARROW_RANKS), (600, RANKS), (4396, NARROW_RANKS)])
def test_shrink_matches_a_per_token_loop(backend, dtype, fan_in, ranks):
    """600 inputs: the Triton shrink's three tiles in three programs a token; 4396: 18 tiles, two a
    program (its parts at most 16), the last one ragged."""
    ops = make_ops(backend)
    a, _, _ = adapters(fan_in, 32, dtype, ranks=ranks)
    x = torch.randn(len(SLOTS), fan_in, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    xa = summed(ops.lora_shrink(x, a, slots))
    assert xa.dtype == torch.float32 and xa.shape == (len(SLOTS), max(ranks))
    assert_close(xa, shrink_reference(x, a, slots), dtype)
    assert (xa[slots < 0] == 0).all()
    for s, rank in enumerate(ranks):  # zero padding past a slot's rank gives zeros there
        assert (xa[slots == s, rank:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("fan_out", "b_layout", "ranks"), [(40, "slot", RANKS), (64, "output", NARROW_RANKS), (300, "rank", RANKS)])
def test_expand_matches_a_per_token_loop_and_leaves_base_rows_alone(backend, dtype, fan_out, b_layout, ranks):
    """Base-model rows stay as they were whatever xa holds there (here: not zero)."""
    ops = make_ops(backend)
    _, b, scales = adapters(32, fan_out, dtype, b_layout=b_layout, ranks=ranks)
    assert b.is_contiguous() == (b_layout == "slot")
    gen = torch.Generator().manual_seed(2)
    slots = torch.tensor(SLOTS, device=DEVICE)
    xa = torch.randn(len(SLOTS), max(ranks), generator=gen).to(DEVICE)
    for s, rank in enumerate(ranks):
        xa[slots == s, rank:] = 0.0  # as shrink leaves them
    y = torch.randn(len(SLOTS), fan_out, generator=gen).to(DEVICE, dtype)
    before = y.clone()
    out = ops.lora_expand(y, xa, b, scales, slots)
    assert out is y and y.dtype == dtype
    assert_close(y, expand_reference(before, xa, b, scales, slots), dtype)  # the reference skips base rows
    assert torch.equal(y[slots < 0], before[slots < 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fan_in", [64, 600])
def test_shrink_then_expand_adds_each_tokens_own_adapter(backend, dtype, fan_in):
    """y[t] += scale_s * B_s A_s x[t] with each slot's unpadded A_s [r_s, in] and B_s [out, r_s],
    into a strided y (columns of a fused projection's output); at 600 inputs the Triton expand adds
    three partial sums."""
    ops = make_ops(backend)
    fan_out = 48
    a, b, scales = adapters(fan_in, fan_out, dtype, seed=3, b_layout="rank")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(SLOTS), fan_in, generator=gen).to(DEVICE, dtype)
    fused = torch.randn(len(SLOTS), fan_out + 32, generator=gen).to(DEVICE, dtype)
    before = fused.clone()
    y = fused[:, 16 : 16 + fan_out]
    slots = torch.tensor(SLOTS, device=DEVICE)
    ops.lora_expand(y, ops.lora_shrink(x, a, slots), b, scales, slots)
    expected = before[:, 16 : 16 + fan_out].cpu().float()
    for t, s in enumerate(SLOTS):
        if s >= 0:
            rank = RANKS[s]
            a_s, b_s = a[s, :rank].cpu().float(), b[s, :, :rank].cpu().float()
            expected[t] += SCALES[s] * (b_s @ (a_s @ x[t].cpu().float()))
    assert_close(y, expected, dtype)
    assert torch.equal(fused[:, :16], before[:, :16]) and torch.equal(fused[:, 16 + fan_out :], before[:, 16 + fan_out :])
    assert torch.equal(fused[slots < 0], before[slots < 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_without_adapters_changes_nothing(backend):
    ops = make_ops(backend)
    a, b, scales = adapters(32, 32, torch.float32)
    x = torch.randn(5, 32, device=DEVICE)
    y = torch.randn(5, 32, device=DEVICE)
    before = y.clone()
    slots = torch.full((5,), -1, device=DEVICE)
    xa = ops.lora_shrink(x, a, slots)
    assert torch.equal(summed(xa), torch.zeros(5, 16, device=DEVICE))
    assert torch.equal(ops.lora_expand(y, xa, b, scales, slots), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_step(backend):
    ops = make_ops(backend)
    a, b, scales = adapters(32, 24, torch.float32)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    xa = ops.lora_shrink(torch.zeros(0, 32, device=DEVICE), a, empty)
    assert summed(xa).shape == (0, 16)
    assert ops.lora_expand(torch.zeros(0, 24, device=DEVICE), xa, b, scales, empty).shape == (0, 24)


def test_triton_wrappers_refuse_mismatched_shapes():
    pytest.importorskip("triton")
    from conveyor.gpu.backends.triton.lora import lora_expand, lora_shrink

    a, b, scales = adapters(32, 48, torch.float32)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(torch.zeros(3, 40, device=DEVICE), a, slots)
    with pytest.raises(ValueError, match="lora_expand"):
        lora_expand(torch.zeros(3, 40, device=DEVICE), torch.zeros(3, 16, device=DEVICE), b, scales, slots)
    with pytest.raises(ValueError, match="scales"):
        lora_expand(torch.zeros(3, 48, device=DEVICE), torch.zeros(3, 16, device=DEVICE), b, scales[:2], slots)


@pytest.mark.cuda
def test_triton_lora_captures_in_a_cuda_graph_with_slots_as_an_input():
    """A decode step's shrink + expand replayed with other slots (and base-model rows) gives the
    eager result: the kernels read each token's slot on the device."""
    from conveyor.gpu.backends.triton.backend import TritonOps

    ops, dtype = TritonOps(), torch.bfloat16
    a, b, scales = adapters(4096, 1024, dtype, b_layout="output")  # as TritonOps.lora_b stores B
    x = torch.randn(len(SLOTS), 4096, device=DEVICE, dtype=dtype)
    y = torch.randn(len(SLOTS), 1024, device=DEVICE, dtype=dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    base = y.clone()

    def step():
        y.copy_(base)
        return ops.lora_expand(y, ops.lora_shrink(x, a, slots), b, scales, slots)

    step()  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new in ([2, 2, -1, 0, 1, -1, -1, 0, 1], [-1] * len(SLOTS)):
        slots.copy_(torch.tensor(new, device=DEVICE))
        graph.replay()
        replayed = y.clone()
        torch.testing.assert_close(replayed, step(), rtol=0, atol=0)
        expected = expand_reference(base, shrink_reference(x, a, slots), b, scales, slots)
        assert_close(replayed, expected, dtype)
        assert torch.equal(replayed[slots < 0], base[slots < 0])


COMPILE_FOR_SM90 = textwrap.dedent("""
    import os, re, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from conveyor.gpu.backends.triton import lora

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

    def compile_(fn, types, constexprs):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True)
        spills = re.search(r"(\\d+) bytes spill stores", info.stderr)
        assert spills and spills.group(1) == "0", (fn.__name__, constexprs, info.stderr[-2000:])

    for dtype in ("bf16", "fp16", "fp32"):
        for rank, width in ((8, 4096), (16, 4096), (64, 14336)):
            block_r = max(16, triton.next_power_of_2(rank))
            types = dict(x_ptr="*" + dtype, a_ptr="*" + dtype, slots_ptr="*i64", xa_ptr="*fp32")
            compile_(lora._lora_shrink_kernel, types, dict(BLOCK_R=block_r, BLOCK_K=lora._block(width, block_r), PART_TILES=4))
            types = dict(y_ptr="*" + dtype, xa_ptr="*fp32", b_ptr="*" + dtype, scales_ptr="*fp32", slots_ptr="*i64")
            compile_(lora._lora_expand_kernel, types, dict(BLOCK_N=lora._block(width, block_r), BLOCK_R=block_r))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the GPU test compiles and runs the kernels")
def test_kernels_compile_for_sm90_without_spills():
    compile_for_sm90(COMPILE_FOR_SM90, timeout_s=240)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_stores_b_as_its_expand_reads_it(backend):
    """Ops.lora_b (gpu/lora/slots.py allocates B through it): zeros [S, out, R] in the dtype and
    on the device asked; the Triton expand's R innermost (a [S, R, out] B cost its layer 1.9x the
    base at 64 rows on an H200 against 1.5x), the others' outputs innermost, which the cpu kernel
    needs (else lora_add falls back to torch's ops)."""
    ops = make_ops(backend)
    b = ops.lora_b(3, 40, 16, torch.float32, torch.device(DEVICE))
    assert b.shape == (3, 40, 16) and b.dtype == torch.float32 and b.device.type == DEVICE
    assert not b.any()
    innermost = 2 if backend == "triton" else 1
    assert b.stride(innermost) == 1
    if backend.startswith("cpu"):
        x, slots = torch.zeros(2, 8), torch.tensor([0, -1])
        assert ops.lora.supports(slots, x, torch.zeros(3, 16, 8), torch.zeros(2, 40), torch.ones(3), b=b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fan_in", [64, 600])
def test_lora_add_is_shrink_then_expand(backend, fan_in):
    """Ops.lora_add (the cpu kernels: both in one call) adds what shrink then expand add, into a
    strided y, base rows untouched."""
    ops = make_ops(backend)
    a, b, scales = adapters(fan_in, 300, torch.float32, seed=5, b_layout="rank")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(len(SLOTS), fan_in, generator=gen).to(DEVICE)
    fused = torch.randn(len(SLOTS), 340, generator=gen).to(DEVICE)
    before = fused.clone()
    slots = torch.tensor(SLOTS, device=DEVICE)
    y = fused[:, 20:320]
    assert ops.lora_add(x, y, a, b, scales, slots) is y
    expected = expand_reference(before[:, 20:320], shrink_reference(x, a, slots), b, scales, slots)
    assert_close(y, expected, torch.float32)
    assert torch.equal(fused[slots < 0], before[slots < 0]) and torch.equal(fused[:, :20], before[:, :20])
