"""`conveyor bench forward`: one worker step on the CPU, with and without the C++ kernels.

A step is `ModelRunner.execute` of a StepPlan on the embedded tiny model: input preparation,
the forward pass, sampling (greedy, as `bench serve` asks). Shapes:
- decode RxC: R sequences, each with C tokens of context, all decoding one token;
- prefill RxL: R fresh prompts of L tokens in one step (dropped after, so every repeat is fresh).

Invariants: each variant (VARIANTS) is its own ModelRunner on its own backend (the cpu backend's
cache has its own layout, so a cache is never shared between variants), fed by a `StepDriver`
that plays the scheduler's part; the variants are timed in interleaved rounds (`measure`), so
that a noisy machine slows all of them alike. The figures: docs/benchmarks.md, "One worker step".
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan

# torch: the torch backend, the reference paths. attention: the cpu backend's attention, the C++
# paged attention (paged_attention.cpp), with torch ops. fused: that plus the cpu ops' RMSNorm /
# rotary / SiLU * up in one pass each (fused_ops.cpp). all: that plus the narrow linears
# (small_linear.cpp, oneDNN's packed weights for many rows) instead of torch's sgemm, even where
# the cpu backend would not pick them (see `pays_on_this_cpu`). cpu: the cpu backend exactly as
# the worker selects it on this machine (`--attention-backend cpu`).
VARIANTS = ("torch", "attention", "fused", "all", "cpu")


def parse_shape(text: str) -> tuple[int, int]:
    try:
        rows, length = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxLENGTH such as 256x500, got {text!r}") from None
    if rows < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rows and length must be positive")
    return rows, length


class StepDriver:
    """One variant's runner, and plans over it that play the scheduler's part."""

    def __init__(self, variant: str, num_blocks: int, model: str = "tiny") -> None:
        from conveyor.engine_config import build_engine_config
        from conveyor.gpu.step.runner import ModelRunner

        config = build_engine_config(model, device="cpu", num_kv_blocks=num_blocks)
        self.runner = ModelRunner(config, backend=variant_backend(variant, config.model))
        self.runner.initialize_cache(num_blocks)
        self.block_size = self.runner.block_size
        self.num_blocks = num_blocks
        self.next_block = 0
        self.next_seq = 0
        self.step = 0

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        if self.next_block + n > self.num_blocks:
            raise RuntimeError(f"the KV pool of {self.num_blocks} blocks is too small for these shapes")
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return blocks

    def _execute(self, new_seqs, scheduled, finished=()) -> float:
        self.step += 1
        plan = StepPlan(self.step, new_seqs, scheduled, finished_seq_ids=list(finished))
        start = time.perf_counter()
        self.runner.execute(plan)
        return time.perf_counter() - start

    def prefill(self, rows: int, length: int, extra: int = 0) -> tuple[list[int], float]:
        """rows fresh prompts of `length` tokens, blocks for `extra` more each -> (ids, seconds)."""
        return self.prefill_prompts([length] * rows, extra)

    def prefill_prompts(self, lengths: list[int], extra: int = 0) -> tuple[list[int], float]:
        """Fresh prompts of these lengths in one step, blocks for `extra` more each -> (ids, seconds)."""
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        ids = list(range(self.next_seq, self.next_seq + len(lengths)))
        self.next_seq += len(lengths)
        vocab = self.runner.config.model.vocab_size - 16
        new = [NewSeq(i, [(i * 31 + j) % vocab for j in range(n)], params, n) for i, n in zip(ids, lengths)]
        scheduled = [ScheduledSeq(i, n, self._blocks(n + extra)) for i, n in zip(ids, lengths)]
        return ids, self._execute(new, scheduled)

    def decode(self, ids: list[int]) -> float:
        return self._execute([], [ScheduledSeq(i, 1) for i in ids])

    def prefill_and_drop(self, rows: int, length: int) -> float:
        """A timed prefill of fresh prompts, which are then dropped and their blocks reused."""
        return self.prompts_and_drop([length] * rows)

    def prompts_and_drop(self, lengths: list[int]) -> float:
        """prefill_and_drop with prompts of these lengths."""
        mark = self.next_block
        ids, seconds = self.prefill_prompts(lengths)
        self._execute([], [], finished=ids)
        self.next_block = mark
        return seconds


def variant_backend(variant: str, model):
    """The Backend a variant runs on: torch's, or the cpu backend's pieces, added one by one."""
    import torch

    from conveyor.gpu.backends import Backend, select, torch_backend
    from conveyor.gpu.backends.cpu import CpuAttention, CpuOps
    from conveyor.gpu.backends.cpu.kernels import cpu_fused_ops, cpu_small_linear, paged_attention_kernel
    from conveyor.gpu.backends.torch import TorchOps

    device = torch.device("cpu")
    if variant == "torch":
        return torch_backend(model, device)
    if variant == "cpu":
        return select("cpu", device, model)
    kernel, fused = paged_attention_kernel(), cpu_fused_ops()
    if kernel is None or fused is None:
        raise RuntimeError("the C++ CPU kernels are unavailable here (no compiler, or CONVEYOR_CPU_KERNELS=0)")
    ops = {"attention": TorchOps(), "fused": CpuOps(fused, None), "all": CpuOps(fused, cpu_small_linear())}[variant]
    return Backend(variant, CpuAttention(model, device, kernel), ops, f"bench variant {variant}")


def measure(shapes: list[tuple[str, int, int]], rounds: int, repeats: int) -> dict[tuple[str, int, int, str], float]:
    """(kind, rows, length) shapes -> {(kind, rows, length, variant): median seconds}: each
    variant's median over `rounds` of its per-round median of `repeats` steps. Every round runs
    every shape on every variant in turn, so that a noisy machine slows all of them alike."""
    import torch

    torch.manual_seed(0)
    decode_tokens = sum(r * (n + rounds * repeats + 16) for kind, r, n in shapes if kind == "decode")
    prefill_tokens = max((r * n for kind, r, n in shapes if kind == "prefill"), default=0)
    num_blocks = (decode_tokens + prefill_tokens) // 16 + sum(r for _, r, _ in shapes) + 64
    drivers = {v: StepDriver(v, num_blocks) for v in VARIANTS}
    decoding: dict[tuple[str, int, int], dict[str, list[int]]] = {}
    for (kind, rows, length), (variant, driver) in itertools.product(shapes, drivers.items()):
        if kind == "decode":  # prompts of `length` tokens, in prefill steps of at most 2048 tokens
            per_step = max(1, 2048 // length)
            ids = []
            for start in range(0, rows, per_step):
                ids += driver.prefill(min(per_step, rows - start), length, extra=rounds * repeats + 16)[0]
            decoding.setdefault((kind, rows, length), {})[variant] = ids
    per_round: dict[tuple[str, int, int, str], list[float]] = {}
    for _ in range(rounds):
        for shape, (variant, driver) in itertools.product(shapes, drivers.items()):
            kind, rows, length = shape
            times = []
            for _ in range(repeats):
                if kind == "decode":
                    times.append(driver.decode(decoding[shape][variant]))
                else:
                    times.append(driver.prefill_and_drop(rows, length))
            per_round.setdefault((*shape, variant), []).append(statistics.median(times))
    return {key: statistics.median(values) for key, values in per_round.items()}


def main(args: argparse.Namespace) -> int:
    shapes = [("decode", r, n) for r, n in args.decode] + [("prefill", r, n) for r, n in args.prefill]
    if not shapes:
        print("nothing to measure: give --decode and/or --prefill shapes")
        return 2
    try:
        results = measure(shapes, args.rounds, args.repeats)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    from conveyor.gpu.backends.cpu.kernels import isa

    print(f"one worker step on the CPU, median ms over {args.rounds} interleaved rounds of {args.repeats}")
    print(f"CPU {isa.describe_in_use()}")
    print(f"{'step':>16} {'torch':>9} {'attention':>10} {'fused':>9} {'all':>9} {'cpu':>9} {'all / torch':>12} {'cpu / torch':>12}")
    for kind, rows, length in shapes:
        ms = {v: results[(kind, rows, length, v)] * 1e3 for v in VARIANTS}
        label = f"{kind} {rows}x{length}"
        print(
            f"{label:>16} {ms['torch']:>9.2f} {ms['attention']:>10.2f} {ms['fused']:>9.2f} {ms['all']:>9.2f} {ms['cpu']:>9.2f} "
            f"{ms['all'] / ms['torch']:>12.2f} {ms['cpu'] / ms['torch']:>12.2f}"
        )
    return 0
