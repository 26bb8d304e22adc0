"""`conveyor bench step --worker`: the worker's host CPU per decode step, alone.

A ModelRunner on an emulated H100 (gpu/emulated/) with a Llama-3-8B-shaped config takes what the
worker stage does per step, minus its sockets: decode a StepPlan from the wire, launch its pass
(plan checks, block tables, inputs, the CUDA-graph buffers, the draws), collect the pass before
it and encode that result. As under asynchronous scheduling, each step is launched before the
last one's ids reached the host: every row's input is the device's draw. The virtual stream's
clock is held past every pass's end, so nothing sleeps: what is measured is host work only,
process CPU time per step over `steps` decode steps of N rows in
steady state (every row decoding, a new block every 16 tokens). The cyclic collector is frozen
after warm-up, as the stage does when it is ready (stages/runtime.py `settle`).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time

import msgspec


def measure(num_rows: int, *, steps: int = 200, prompt_len: int = 100) -> dict:
    from conveyor.config import CacheConfig, EngineConfig, ParallelConfig
    from conveyor.gpu.models.registry import read_model_config
    from conveyor.gpu.step.runner import ModelRunner
    from conveyor.tiny.checkpoint import make_config
    from conveyor.tiny.generate import SHAPES
    from conveyor.wire.messages import SamplingParams, WorkerInbound
    from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan

    with tempfile.TemporaryDirectory() as path:
        model = read_model_config(make_config(path, dtype="bfloat16", **SHAPES["llama3-8b"]))
        config = EngineConfig(
            model, CacheConfig(num_kv_blocks=num_rows * 64), parallel=ParallelConfig(device="emulated", emulate="h100")
        )
        runner = ModelRunner(config)
    stream = runner.platform.stream  # type: ignore[attr-defined]
    stream.clock = lambda: stream.tail + 1.0 if stream.tail > 0 else 0.0  # always past the work queued
    runner.initialize_cache(runner.num_available_blocks())
    decoder, encoder = msgspec.msgpack.Decoder(WorkerInbound), msgspec.msgpack.Encoder()

    def step(plan: StepPlan) -> None:
        plan = decoder.decode(encoder.encode(plan))
        for _ in runner.launch(plan):
            for result in runner.collect(keep=1):  # the worker stage's loop: the pass before this one
                encoder.encode(result)

    free = iter(range(num_rows * 64))
    params = SamplingParams(max_tokens=None, temperature=0.7)
    prompts = [[(i * 7 + j) % 40000 + 20 for j in range(prompt_len)] for i in range(num_rows)]
    first = [ScheduledSeq(i, prompt_len, [next(free) for _ in range(-(-prompt_len // 16))]) for i in range(num_rows)]
    step(StepPlan(0, [NewSeq(i, p, params, prompt_len) for i, p in enumerate(prompts)], first))
    length = prompt_len + 1  # every row: its prompt and its first draw
    timings = []
    for s in range(1, steps + 21):
        new_block = length % 16 == 0
        rows = [ScheduledSeq(i, 1, [next(free)] if new_block else []) for i in range(num_rows)]
        length += 1
        if s == 21:
            gc.freeze()
        started = time.process_time()
        step(StepPlan(s, [], rows))
        if s > 20:
            timings.append(time.process_time() - started)
    return {"rows": num_rows, "median_ms": statistics.median(timings) * 1e3, "us_per_row": statistics.mean(timings) / num_rows * 1e6}


def main(sizes: list[int]) -> int:
    print("worker step alone (decode the plan, launch, collect, encode; emulated H100, Llama-3-8B shape)")
    print(f"{'rows':>8} {'median ms':>10} {'us/row':>8}")
    for n in sizes:
        r = measure(n)
        print(f"{r['rows']:>8} {r['median_ms']:>10.3f} {r['us_per_row']:>8.2f}")
    return 0
