"""The GPU races' workloads, by name: what the client sends, and the tokenizer the served checkpoint
is generated with (the client counts and picks with that same tokenizer, the checkpoint's).

  sharegpt-500         the default: what vLLM's own client sends (seed 0, conveyor/sim/sharegpt.py),
                       500 prompts of the ShareGPT sample over SmolLM2's 49,152-id tokenizer
                       (pack.sh packs it into .gpu-pack/smollm2), all at once, ignore_eos: mean
                       117.95 prompt / 309.82 output tokens
  runbook-bpe4096-500  the first three H200 runs' workload (ops/gpu/runs/): the same file, count and
                       seed over the tiny model's generated 4,096-id BPE; kept so that a run can be
                       set beside those. Its picks now follow vLLM's rule, so 425 of its 500 prompts
                       are theirs: mean 122.0 prompt / 450.8 output tokens, where theirs had 115.8 / 444.8
The emulated rehearsal (--emulated) always serves the tiny shape with the generated tokenizer:
it rehearses the procedure at a tiny scale, whatever the workload's name.
Stdlib only, as the runbook.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

DEFAULT = "sharegpt-500"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    tokenizer: str | None  # the folder, relative to .gpu-pack, of the tokenizer the checkpoint takes; None: the generated BPE
    checkpoint: str  # the generated checkpoint's folder name, one per tokenizer

    def tokenizer_dir(self, pack: Path) -> Path | None:
        return None if self.tokenizer is None else pack / self.tokenizer


WORKLOADS = {
    w.name: w
    for w in (
        Workload("sharegpt-500", 500, "smollm2", "llama3-8b-bf16-smollm2"),
        Workload("runbook-bpe4096-500", 500, None, "llama3-8b-bf16"),
    )
}
