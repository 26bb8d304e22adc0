"""Recorded kernel programs (gpu/backends/cpu/kernels/program.py): a replay makes the recorded
calls again on what their tensors hold now, and a recording refuses work it could not replay.

The decode graphs built on them (a runner's greedy output equal with and without) are tested in
tests/gpu/test_cpu_decode_programs.py.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.gpu.backends.cpu import CpuOps
from conveyor.gpu.backends.cpu.kernels import cpu_fused_ops, program
from conveyor.gpu.backends.ops import NotRecordable

fused = cpu_fused_ops()
pytestmark = pytest.mark.skipif(fused is None or not program.available(), reason="no C++ compiler for the CPU kernels")


def step(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A few kernels chained through tensors they allocate: norm, SiLU * up, a column split."""
    assert fused is not None
    h = fused.rms_norm(x, w, 1e-5, residual)  # residual += x in place
    gated = fused.silu_mul(fused.columns(h, 0, 8), up)
    return fused.columns(gated.reshape(-1, 8), 2, 6)


def inputs(seed: int, tokens: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for shape in ((tokens, 16), (tokens, 16), (16,), (tokens, 8)))


def test_a_replay_computes_what_the_calls_would_on_the_new_inputs():
    x, residual, w, up = inputs(0)
    with program.record(program.Arena()) as found:
        out = step(x, residual, w, up)
    (recorded,) = found
    assert recorded.num_calls == 4  # rms_norm, columns, silu_mul, columns
    for seed in (1, 2):
        new = inputs(seed)
        want_residual = new[1].clone()
        want = step(new[0], want_residual, *new[2:])  # eager, on fresh tensors
        for mine, value in zip((x, residual, w, up), new):
            mine.copy_(value)
        recorded.replay()
        assert torch.equal(out, want)
        assert torch.equal(residual, want_residual)  # the in-place add replayed too


def test_the_arena_reuses_what_died_and_keeps_what_lives():
    arena = program.Arena()
    x, residual, w, up = inputs(3)
    with program.record(arena) as found:
        out = step(x, residual, w, up)
    first = found[0].keeping(out)
    chunk = arena.chunks[0]
    base, end = chunk.data_ptr(), chunk.data_ptr() + chunk.numel()
    assert base <= out.data_ptr() < end  # allocated in the arena
    # The intermediates died with the forward: their regions are free again, the output's is not.
    free = sum(e - s for s, e in arena.free[0])
    assert free == chunk.numel() - program.Arena.ALIGN * 1  # the output alone (3 x 4 floats, one aligned region)
    with program.record(arena) as found:
        second_out = step(x, residual, w, up)
    assert second_out.data_ptr() != out.data_ptr()  # the first output stays its own
    assert len(arena.chunks) == 1  # the second recording reused the first's dead regions
    del found, second_out
    x2 = inputs(5)
    want_residual = x2[1].clone()
    want = step(x2[0], want_residual, *x2[2:])
    for mine, value in zip((x, residual, w, up), x2):
        mine.copy_(value)
    first.replay()
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    "work, reason",
    [
        (lambda x: x + 1, "computes in torch"),
        (lambda x: x.t().reshape(-1), "copied its input|computes in torch"),  # reshape, or its clone
        (lambda x: torch.tensor([1.0]), "computes in torch"),
    ],
    ids=["an add", "a copying reshape", "host data"],
)
def test_torch_work_in_a_recording_is_refused(work, reason):
    x = torch.randn(4, 16)
    with pytest.raises(NotRecordable, match=reason), program.record(program.Arena()):
        work(x)


def test_views_and_allocations_record():
    x = torch.randn(4, 16)
    with program.record(program.Arena()) as found:
        x.view(2, 32)[:, 3:9].unsqueeze(0)
        torch.empty(3, 3)
    assert found[0].num_calls == 0


def test_recordings_do_not_nest_and_end_cleanly():
    with pytest.raises(RuntimeError, match="nest"), program.record(program.Arena()), program.record(program.Arena()):
        pass
    with program.record(program.Arena()) as found:  # the failed one left no recording open
        pass
    assert found[0].num_calls == 0


def test_a_kernel_whose_result_steers_the_host_is_refused():
    from conveyor.gpu.backends.cpu.kernels import cpu_quant_argmax

    argmax = cpu_quant_argmax()
    if argmax is None:
        pytest.skip("no quantized argmax kernel")
    with pytest.raises(NotRecordable, match="steers the host"), program.record(program.Arena()):
        argmax._candidates(*([0] * 12))  # refused before the call: no pointer is read


def test_the_cpu_ops_record_and_other_ops_refuse():
    ops = CpuOps(fused, None)
    x, residual, w, _ = inputs(4)
    out, replay = ops.record(lambda: fused.rms_norm(x, w, 1e-5))
    x.mul_(2)
    replay.replay()
    assert torch.allclose(out, fused.rms_norm(x, w, 1e-5))  # the norm is scale-free but for eps
    from conveyor.gpu.backends.torch import TorchOps

    with pytest.raises(NotRecordable):
        TorchOps().record(lambda: x)
