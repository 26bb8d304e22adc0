"""One process's part of `conveyor bench roofline`: a model on the cpu backend, measured in rounds.

`python -m conveyor.bench.roofline_round SETTINGS_JSON` (started by roofline.py, one process per
ISA variant, CONVEYOR_CPU_ISA set: the kernels pick their build when imported) loads the model,
writes one JSON line `{"describe", "threads"}` to its stdout, then for each line on stdin runs one
round and writes its JSON line (`Rig.round`); it ends at end of input. Anything else the process
prints goes to stderr, so stdout carries only those lines.

A round measures the bandwidth (stream.py) and the decode steps back to back, so both see the
same machine: the bandwidth of each kernel at 1 thread and at the steps' threads (the backend's,
or `threads`); then fresh
prompts of `context` tokens for `rows` rows (one prefill step each, untimed), `warmup` decode
steps, `steps` steps with no timers as the daemon runs them (from the recorded kernel programs
where the backend records them: gpu/step/cuda_graphs.py), `steps` more run eagerly, and `steps`
more eagerly with the op meter installed (op_meter.py: it times the ops' Python faces, which a
replay never calls).
Each round's rows are finished at its end, so every round decodes the same contexts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from conveyor.bench import stream
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str | None  # --model (None: the default model)
    quantization: str | None
    rows: int
    context: int  # prompt tokens of each row
    steps: int  # timed decode steps, with and without the meter, per round
    warmup: int
    array_bytes: int  # each bandwidth array's
    repeats: int  # timed passes per bandwidth kernel
    temperature: float = 0.0  # 0: greedy (the argmax head); above: logits and the sampler's draw
    threads: int | None = None  # torch's (and so the kernels') threads for the steps; None: as the backend finds them


class Rig:
    """A ModelRunner on the cpu backend and the plans that play the scheduler's part."""

    def __init__(self, settings: Settings) -> None:
        import torch

        from conveyor.engine_config import build_engine_config
        from conveyor.gpu.step.runner import ModelRunner

        self.settings = s = settings
        if s.threads is not None:
            torch.set_num_threads(s.threads)
        tokens = s.context + s.warmup + 3 * s.steps + 1
        block_size = 16
        self.blocks_per_row = -(-tokens // block_size)
        num_blocks = self.blocks_per_row * s.rows
        options = dict(device="cpu", num_kv_blocks=num_blocks, block_size=block_size, max_model_len=tokens + block_size)
        if s.quantization is not None:
            options["quantization"] = s.quantization
        self.config = build_engine_config(s.model, **options)
        self.runner = ModelRunner(self.config)
        self.runner.initialize_cache(num_blocks)
        self.step_id = 0
        self.next_seq = 0

    def _execute(self, new: list[NewSeq], scheduled: list[ScheduledSeq], finished: list[int] | None = None) -> float:
        self.step_id += 1
        start = time.perf_counter()
        self.runner.execute(StepPlan(self.step_id, new, scheduled, finished_seq_ids=finished or []))
        return time.perf_counter() - start

    def start_rows(self) -> list[int]:
        """Fresh prompts of `context` tokens, one prefill step each; their ids."""
        s = self.settings
        params = SamplingParams(temperature=s.temperature, max_tokens=None, ignore_eos=True, seed=0)
        vocab = self.config.model.vocab_size - 16
        ids = []
        for r in range(s.rows):
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            prompt = [(seq * 31 + j) % vocab for j in range(s.context)]
            blocks = list(range(r * self.blocks_per_row, (r + 1) * self.blocks_per_row))
            self._execute([NewSeq(seq, prompt, params, s.context)], [ScheduledSeq(seq, s.context, blocks)])
            ids.append(seq)
        return ids

    def decode(self, ids: list[int]) -> float:
        return self._execute([], [ScheduledSeq(i, 1) for i in ids])

    def finish(self, ids: list[int]) -> None:
        """The rows' sequences ended, their blocks free for the next start_rows."""
        self._execute([], [], finished=ids)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Steps inside run the eager path, whatever the backend records (the op meter times the
        ops' Python faces, which a replay never calls)."""
        graphs, self.runner.graphs = self.runner.graphs, None
        try:
            yield
        finally:
            self.runner.graphs = graphs

    def round(self) -> dict[str, Any]:
        """Bandwidth, then decode steps without and with the meter (module docstring)."""
        import torch

        from conveyor.bench import op_meter  # torch: imported in the child only

        s = self.settings
        threads = sorted({1, torch.get_num_threads()})
        bandwidth = [dataclasses.asdict(stream.measure(kind, s.array_bytes, t, s.repeats)) for kind in stream.ARRAYS for t in threads]
        ids = self.start_rows()
        for _ in range(s.warmup):
            self.decode(ids)
        plain = [self.decode(ids) for _ in range(s.steps)]
        with self.eager():
            eager = [self.decode(ids) for _ in range(s.steps)]
            meter = op_meter.install(self.runner)
            try:
                metered = []
                for _ in range(s.steps):
                    metered.append(self.decode(ids))
                    meter.settle()
            finally:
                meter.remove()
        self.finish(ids)
        ops = {
            label: {"seconds": meter.seconds[label], "calls": meter.calls[label], **dataclasses.asdict(meter.traffic[label])}
            for label in meter.seconds
        }
        return {"bandwidth": bandwidth, "plain_seconds": plain, "eager_seconds": eager, "metered_seconds": metered, "ops": ops}


def serve_rounds(settings: Settings) -> None:
    """The child's loop (module docstring)."""
    import torch

    from conveyor.gpu.backends.cpu.kernels import isa

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything else on stdout (C libraries included) goes to stderr
    sys.stdout = sys.stderr
    rig = Rig(settings)
    backend = rig.runner.backend.name
    out.write(json.dumps({"describe": isa.describe_in_use(), "threads": torch.get_num_threads(), "backend": backend}) + "\n")
    out.flush()
    for _ in sys.stdin:
        out.write(json.dumps(rig.round()) + "\n")
        out.flush()


if __name__ == "__main__":
    serve_rounds(Settings(**json.loads(sys.argv[1])))
