"""The worker's host CPU per decode step, on the emulated device (no weights, no device work).

    python ops/bench/worker_host_cpu.py MODEL_DIR [ROWS] [STEPS] [--profile]

MODEL_DIR: a config-only checkpoint (`python -m conveyor.tiny.generate --shape llama3-8b
--no-weights ...`, docs/benchmarks.md's issue 27 section). Prefills ROWS (default 256) 100-token
prompts one a plan, then times STEPS (default 100) decode steps of every row through
`ModelRunner.execute`: the process's CPU time per step (the host's work: plan checks, inputs,
sampling's host side, results), beside the wall time, which includes the emulated device's. With
--profile, cProfile's top functions by their own time instead. Run it at two commits from their
checkouts (PYTHONPATH=CHECKOUT) to compare the worker's per-row costs.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from conveyor.engine_config import build_engine_config
from conveyor.gpu.step.runner import ModelRunner
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan

BLOCK_SIZE, PROMPT_TOKENS, WARM_UP_STEPS = 16, 100, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("rows", nargs="?", type=int, default=256)
    parser.add_argument("steps", nargs="?", type=int, default=100)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    rows, steps = args.rows, args.steps
    blocks_per_row = (PROMPT_TOKENS + WARM_UP_STEPS + steps) // BLOCK_SIZE + 2
    config = build_engine_config(args.model, device="emulated", num_kv_blocks=blocks_per_row * rows, max_num_seqs=rows)
    runner = ModelRunner(config)
    runner.initialize_cache(blocks_per_row * rows)
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    for r in range(rows):
        blocks = list(range(blocks_per_row * r, blocks_per_row * (r + 1)))
        runner.execute(StepPlan(r, [NewSeq(r, prompt, greedy, PROMPT_TOKENS)], [ScheduledSeq(r, PROMPT_TOKENS, blocks)]))
    plan_ids = iter(range(rows, 1 << 30))

    def step() -> None:
        runner.execute(StepPlan(next(plan_ids), [], [ScheduledSeq(r, 1, []) for r in range(rows)]))

    for _ in range(WARM_UP_STEPS):
        step()
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            step()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    cpu, wall = (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps
    print(f"{rows} rows: host CPU {cpu * 1e3:.3f} ms/step, wall {wall * 1e3:.3f} ms/step (emulated device included)")


if __name__ == "__main__":
    main()
