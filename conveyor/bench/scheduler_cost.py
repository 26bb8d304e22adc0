"""`conveyor bench step`: the CPU cost of one scheduler step over N running decodes.

One step here is what the scheduler process does between two forward passes: `schedule()`,
turning the decision into a StepPlan, encoding it for the wire, and `update()` with the pass's
StepResult as it comes off the wire (decoded here; plus the TokenBatch for the detokenizer). The
worker is replaced by a stub that answers one id per draw, keyed by sequence, encoded outside the
timing, so only scheduler-side time is measured. Reported: the median over many
steps, in steady state (every sequence decoding, blocks allocated as they fill).

With `--prepare`, a second table: one input preparation alone (`first_pass_inputs`, host
lists to device tensors: token ids, positions, block tables, attention metadata) on the tiny
model for N running decodes of a 200-token context, the worker's share of the per-step CPU
cost. Host time only: on CUDA the copies it queues are waited for outside the timing.
"""

from __future__ import annotations

import statistics
import time

import msgspec

from conveyor.config import SchedulerConfig
from conveyor.sim.simulator import fake_result
from conveyor.stages.scheduler.plan import step_plan, token_batches
from conveyor.stages.scheduler.scheduler import Scheduler
from conveyor.wire.channel import encode
from conveyor.wire.messages import SamplingParams, ScheduleRequest
from conveyor.wire.step import StepResult


def measure(num_running: int, *, steps: int = 200, prompt_len: int = 200, block_size: int = 16) -> dict:
    max_tokens = 10_000_000  # never finishes during the run
    # prefill warm-up decodes too (up to ~prompt_len * num_running / budget steps), then `steps`
    num_blocks = num_running * ((2 * prompt_len + steps) // block_size + 4)
    sched = Scheduler.from_config(
        SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running),
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=1 << 20,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 31 + j) % 4000 for j in range(prompt_len)]  # distinct: no prefix sharing
        sched.add_request(ScheduleRequest(f"r{i}", 0, prompt, params, 0.0))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running) or sched.waiting:
        step = sched.schedule()  # prefill until everyone decodes
        assert step is not None  # the pool holds every sequence, so each step has rows
        sched.update(step, fake_result(step))

    timings = []
    decode = msgspec.msgpack.Decoder(StepResult).decode
    for _ in range(steps):
        start = time.perf_counter()
        step = sched.schedule()
        assert step is not None
        wire = encode(step_plan(step))
        planned = time.perf_counter()
        result = encode(fake_result(step))  # the worker's part: not timed
        received = time.perf_counter()
        updates = sched.update(step, decode(result))
        for batch in token_batches(step.step, updates, 1):
            encode(batch)
        timings.append(planned - start + time.perf_counter() - received)
        assert len(step.rows) == num_running and len(wire) > 0
    return {
        "running": num_running,
        "median_ms": statistics.median(timings) * 1e3,
        "p90_ms": statistics.quantiles(timings, n=10)[-1] * 1e3,
    }


def measure_prepare(runner, num_running: int, *, repeats: int = 200, context_len: int = 200) -> dict:
    """One pass's input preparation (gpu/step/step_inputs.py `first_pass_inputs`) for `num_running`
    decodes (each computing its last token) out of the persistent batch, timed `repeats` times on
    a built ModelRunner (see `prepare_runner`)."""
    from conveyor.gpu.step.persistent_batch import PersistentBatch
    from conveyor.gpu.step.step_inputs import RowSpec, first_pass_inputs

    block_size, vocab = runner.block_size, runner.config.model.vocab_size - 16
    blocks_per_seq = -(-context_len // block_size)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    batch = PersistentBatch(num_running, runner.max_blocks_per_seq, runner.device)
    rows = [
        RowSpec(
            batch.add(i, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), params),
            context_len - 1,
            context_len,
            [(i * 31 + j) % vocab for j in range(context_len)],
            samples=True,
        )
        for i in range(num_running)
    ]
    batch.sync()
    window = runner.config.model.sliding_window
    timings = []
    for _ in range(repeats + 5):  # the first few warm the allocator
        start = time.perf_counter()
        inputs = first_pass_inputs(rows, batch, runner.attn, block_size, window)
        timings.append(time.perf_counter() - start)
        if runner.device.type == "cuda":
            import torch

            torch.cuda.synchronize(runner.device)
        assert inputs.num_rows == num_running and len(inputs.logit_index) == num_running
    timings = timings[5:]
    return {
        "running": num_running,
        "median_ms": statistics.median(timings) * 1e3,
        "p90_ms": statistics.quantiles(timings, n=10)[-1] * 1e3,
    }


def prepare_runner(device: str = "cpu"):
    """A ModelRunner on the embedded tiny model; no KV pool is needed to prepare inputs. On the
    CPU, one intra-op thread: the tensors are small, and on a shared host a second thread only
    waits for a core at every barrier (see conveyor.sim.measure)."""
    import torch

    from conveyor.engine_config import build_engine_config
    from conveyor.gpu.step.runner import ModelRunner

    if device == "cpu":
        torch.set_num_threads(1)
    return ModelRunner(build_engine_config("tiny", device=device, num_kv_blocks=16))


def main(sizes: list[int], *, prepare: bool = False, device: str = "cpu") -> int:
    print("scheduler step (schedule, plan, encode, update)")
    print(f"{'running':>8} {'median ms':>10} {'p90 ms':>8}")
    for n in sizes:
        r = measure(n)
        print(f"{r['running']:>8} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f}")
    if prepare:
        runner = prepare_runner(device)
        print(f"\ninput preparation alone (first_pass_inputs, tiny model, {device})")
        print(f"{'running':>8} {'median ms':>10} {'p90 ms':>8}")
        for n in sizes:
            r = measure_prepare(runner, n)
            print(f"{r['running']:>8} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f}")
    return 0
