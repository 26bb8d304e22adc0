"""The price of LoRA rows in a decode step, in process, on SmolLM2 (Q4_1 kept packed): a B-row
decode step with every row on the base weights, against the same step with the rows spread over
4 random rank-R adapters on all seven projections (conveyor/tiny/lora.py), and against the base
rows of a server started with --enable-lora (no adapter row: what the slots cost when idle).
Configurations interleaved step by step, so the machine's drift falls on all alike.

    python ops/bench/lora_step.py [ROWS] [STEPS] [--rank 16] [--model DIR --device cuda --dtype bfloat16]

--model serves another checkpoint (on a GPU: one of Llama-3-8B's shape, ops/gpu/README.md), on
--device in --dtype. Prints each configuration's median step time (the wall clock: on a GPU the
host's preparation of a step included, which a server overlaps with the step before) and its ratio
to the base.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from conveyor.default_model import default_gguf
from conveyor.engine_config import build_engine_config
from conveyor.gpu.loading.gguf import ensure_checkpoint
from conveyor.gpu.step.runner import ModelRunner
from conveyor.tiny.lora import make_random_adapter
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import LoraLoad, NewSeq, ScheduledSeq, StepPlan

BLOCK_SIZE, PROMPT_TOKENS = 16, 32


def runner_for(path: str, rows: int, steps: int, adapters: list[Path] | None, **load) -> tuple[ModelRunner, list]:
    blocks_per_row = -(-(PROMPT_TOKENS + steps + 8) // BLOCK_SIZE)
    options = dict(**load, num_kv_blocks=blocks_per_row * rows, block_size=BLOCK_SIZE, max_num_seqs=max(rows, 8))
    if adapters is not None:
        options.update(enable_lora=True, max_loras=4, max_lora_rank=16)
    runner = ModelRunner(build_engine_config(path, **options))
    runner.initialize_cache(blocks_per_row * rows)
    loads = [LoraLoad(i, f"a{i}", str(a)) for i, a in enumerate(adapters or [])]
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    for r in range(rows):  # one prompt a plan: the prefills are not what is timed
        slot = r % len(loads) if loads else -1
        blocks = list(range(blocks_per_row * r, blocks_per_row * (r + 1)))
        new = NewSeq(r, prompt, greedy, PROMPT_TOKENS, lora_slot=slot)
        plan = StepPlan(r, [new], [ScheduledSeq(r, PROMPT_TOKENS, blocks)], lora_loads=loads if r == 0 else [])
        runner.execute(plan)
    return runner, list(range(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rows", nargs="?", type=int, default=64)
    parser.add_argument("steps", nargs="?", type=int, default=60)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", help="a checkpoint directory (default: SmolLM2's Q4_1 GGUF, kept packed)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    path = args.model or str(ensure_checkpoint(default_gguf(), "float32", packed=True))
    load = dict(device=args.device, dtype=args.dtype)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [make_random_adapter(Path(path), root / f"a{i}", rank=args.rank, seed=i) for i in range(4)]
    configs = {
        "base": runner_for(path, args.rows, args.steps, None, **load),
        "lora enabled, base rows": runner_for(path, args.rows, args.steps, [], **load),
        "4 adapters": runner_for(path, args.rows, args.steps, adapters, **load),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    step = 10_000
    for _ in range(args.steps):
        for name, (runner, rows) in configs.items():
            step += 1
            plan = StepPlan(step, [], [ScheduledSeq(r, 1, []) for r in rows])
            start = time.perf_counter()
            runner.execute(plan)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["base"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name}: {args.rows}-row decode step {median * 1e3:.2f} ms median ({median / base:.2f}x base), {args.steps} steps")


if __name__ == "__main__":
    main()
