"""Decode steps on SmolLM2, in process: the step time, and with --ops where it goes.

`python ops/bench/decode_profile.py packed|float32 [STEPS] [--rows N] [--ops]` loads the default
model's GGUF (kept packed, or its dequantized float32 conversion) on the cpu backend, prefills N
(default 1) 128-token prompts, then times STEPS decode steps of N rows, one token of each prompt
(`ModelRunner.execute`; median, p10, p90). One row is one stream; a race's steps run 100-200.
--ops wraps the backend's ops, attention and the runner's stages in timers and prints each one's
ms per step and calls per step: the C++ kernels run through ctypes, which torch.profiler
does not see. The wrappers cost a few percent; compare runs of one kind only.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

from conveyor.config import CacheConfig, EngineConfig, ParallelConfig
from conveyor.default_model import default_gguf
from conveyor.gpu.loading.gguf import ensure_checkpoint
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.step.runner import ModelRunner
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan

BLOCK_SIZE, BLOCKS_PER_ROW = 16, 40  # 640 tokens of KV a row
PROMPT_TOKENS, WARM_UP_STEPS = 128, 10
MAX_STEPS = BLOCK_SIZE * BLOCKS_PER_ROW - PROMPT_TOKENS - WARM_UP_STEPS  # 502: what the rest of a row's KV holds
times: dict[str, float] = collections.defaultdict(float)
counts: collections.Counter[str] = collections.Counter()


def timed(obj: object, name: str, label: str) -> None:
    f = getattr(obj, name)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            times[label] += time.perf_counter() - start
            counts[label] += 1

    setattr(obj, name, wrapper)


def main(form: str, steps: int, ops: bool, rows: int) -> None:
    path = ensure_checkpoint(default_gguf(), "float32", packed=form == "packed")
    cache = CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=BLOCKS_PER_ROW * rows)
    config = EngineConfig(model=read_model_config(path), cache=cache, parallel=ParallelConfig(device="cpu"))
    runner = ModelRunner(config)
    runner.initialize_cache(BLOCKS_PER_ROW * rows)
    prompt, greedy = list(range(100, 100 + PROMPT_TOKENS)), SamplingParams(temperature=0.0, max_tokens=None)
    for r in range(rows):  # one prompt a step: a prefill's rows are not what is timed
        blocks = list(range(BLOCKS_PER_ROW * r, BLOCKS_PER_ROW * (r + 1)))
        runner.execute(StepPlan(r, [NewSeq(r, prompt, greedy, len(prompt))], [ScheduledSeq(r, len(prompt), blocks)]))
    decode = iter(range(rows, 1 << 30))

    def step() -> None:
        runner.execute(StepPlan(next(decode), [], [ScheduledSeq(r, 1, []) for r in range(rows)]))

    for _ in range(WARM_UP_STEPS):
        step()
    if ops:
        backend = runner.backend
        for name in ("quant_linear", "linears", "linear", "rms_norm", "add_rms_norm", "rotary", "silu_mul"):
            timed(backend.ops, name, name)
        for name in ("write_kv", "attend"):
            timed(backend.attn, name, f"attention.{name}")
        timed(runner, "_forward", "forward (all layers)")
        timed(runner.model, "compute_logits", "LM head")
        timed(runner.platform, "draw", "draw")
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        durations.append(time.perf_counter() - start)
    durations.sort()
    ms = [durations[int(q * (steps - 1))] * 1e3 for q in (0.5, 0.1, 0.9)]
    print(f"{form}: {rows}-row decode step p50 {ms[0]:.2f} ms, p10 {ms[1]:.2f}, p90 {ms[2]:.2f} ({steps} steps)")
    for label, total in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {label:22s} {total / steps * 1e3:7.3f} ms/step  {counts[label] / steps:6.1f} calls/step")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("form", choices=("packed", "float32"))
    parser.add_argument("steps", nargs="?", type=int, default=100)
    parser.add_argument("--rows", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--ops", action="store_true", help="time each op")
    args = parser.parse_args()
    if not 1 <= args.steps <= MAX_STEPS or args.rows < 1:
        parser.error(f"STEPS must be 1 to {MAX_STEPS} (each row's KV holds {BLOCK_SIZE * BLOCKS_PER_ROW} tokens), --rows at least 1")
    main(args.form, args.steps, args.ops, args.rows)
