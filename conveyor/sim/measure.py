"""Measure the real ModelRunner's step latency on the embedded tiny model, and fit a CostModel.

    python -m conveyor.sim.measure [--repeats 5] [--threads 1] [--json out.json]

Each grid point is a list of rows (tokens already cached, tokens computed now). For every repeat
the rows' sequences are registered and their cached part computed in an untimed plan, then the
timed plan computes the new tokens, then the sequences are dropped; the same block ids serve
every repeat. The minimum over repeats is kept: the host is shared, and noise only adds time.
The fitted numbers are what `presets.CPU_TINY` ships.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

from conveyor.gpu.emulated.costmodel import Measurement, StepShape, fit

BLOCK_SIZE = 16


def default_grid(max_model_len: int = 2048) -> list[list[tuple[int, int]]]:
    """Prompts alone, decodes alone, chunked prompts over a cache, and SplitFuse-style mixes."""
    grid: list[list[tuple[int, int]]] = []
    for n in (1, 8, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048):
        grid.append([(0, n)])  # one fresh prompt
    for k, n in ((2, 128), (4, 128), (8, 64), (4, 256), (8, 256), (2, 1024)):
        grid.append([(0, n)] * k)  # several prompts, same token count as a single longer one
    for s, n in ((512, 256), (1024, 256), (1024, 512), (1536, 512)):
        grid.append([(s, n)])  # a prompt chunk over a cached prefix
    for b, c in itertools.product((1, 4, 16, 64, 128), (32, 256, 1024)):
        if b * c <= 65536:  # the untimed set-up computes every cached token first
            grid.append([(c, 1)] * b)  # decodes
    for b, budget in ((8, 256), (32, 512), (64, 1024), (16, 2048), (128, 2048)):
        grid.append([(256, 1)] * b + [(0, budget - b)])  # decodes plus one prompt chunk
    return [rows for rows in grid if all(s + n <= max_model_len for s, n in rows)]


def measure(grid: list[list[tuple[int, int]]], *, repeats: int = 5, threads: int = 1, model: str = "tiny") -> list[Measurement]:
    """Time each grid point on the CPU with the real runner (loads torch and the model).

    Repeats go round the whole grid, so a burst of load from another process spoils one repeat
    of several points rather than every repeat of one. One intra-op thread by default: on a
    shared 2-core host, two threads wait on each other at every barrier whenever another process
    takes a core, which turns milliseconds into hundreds of them.
    """
    import torch

    from conveyor.engine_config import build_engine_config
    from conveyor.gpu.step.runner import ModelRunner
    from conveyor.wire.messages import SamplingParams
    from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan

    num_blocks = max(sum(-(-(s + n) // BLOCK_SIZE) for s, n in rows) for rows in grid)
    config = build_engine_config(model, device="cpu", num_kv_blocks=num_blocks, block_size=BLOCK_SIZE)
    runner = ModelRunner(config)
    runner.initialize_cache(num_blocks)
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    vocab = config.model.vocab_size - 16  # stay clear of the special tokens at the end
    step_ids, seq_ids = itertools.count(1), itertools.count(1)

    def timed(rows: list[tuple[int, int]]) -> float:
        news, tables, first = [], [], 0
        for s, n in rows:
            seq_id = next(seq_ids)
            tokens = [(seq_id * 7919 + j * 31) % vocab for j in range(s + n)]
            news.append(NewSeq(seq_id, tokens, params, s + n))
            blocks = -(-(s + n) // BLOCK_SIZE)
            tables.append(list(range(first, first + blocks)))
            first += blocks
        cached = [ScheduledSeq(new.seq_id, s, table) for new, (s, _), table in zip(news, rows, tables) if s]
        runner.execute(StepPlan(next(step_ids), news, cached))
        plan = StepPlan(
            next(step_ids), [], [ScheduledSeq(new.seq_id, n, [] if s else table) for new, (s, n), table in zip(news, rows, tables)]
        )
        started = time.perf_counter()
        runner.execute(plan)
        seconds = time.perf_counter() - started
        runner.execute(StepPlan(next(step_ids), [], [], finished_seq_ids=[new.seq_id for new in news]))
        return seconds

    torch.set_num_threads(threads)
    timed(grid[-1])  # warm up the allocator and the kernels
    best = [math.inf] * len(grid)
    for _ in range(repeats):
        for i, rows in enumerate(grid):
            best[i] = min(best[i], timed(rows))
    out = []
    for rows, seconds in zip(grid, best):
        shape = StepShape.of_rows(rows)
        out.append(Measurement(shape.num_tokens, shape.num_seqs, shape.context_tokens, seconds, shape.attention_pairs))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--model", default="tiny", help="checkpoint directory or model name (default: the generated tiny model)")
    parser.add_argument("--json", default=None, help="write the measurements and the fit here")
    args = parser.parse_args(argv)
    samples = measure(default_grid(), repeats=args.repeats, threads=args.threads, model=args.model)
    model = fit(samples, name="cpu-tiny")
    for m in samples:
        print(
            f"T={m.num_tokens:5d} S={m.num_seqs:4d} C={m.context_tokens:7d} P={m.attention_pairs:9d} "
            f"measured {m.seconds * 1e3:8.2f} ms  model {model.latency(m.shape) * 1e3:8.2f} ms"
        )
    print(model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measurements": [vars(m) for m in samples], "fit": vars(model)}, f, indent=2)


if __name__ == "__main__":
    main()
