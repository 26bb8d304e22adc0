"""A stand-in for gpu.runner.ModelRunner that follows the StepPlan protocol exactly and checks it.

Its "model" picks the next token as a hash of the whole sequence, so outputs depend on every token
before them: a lost, repeated or reordered token anywhere changes everything after it.
"""

from __future__ import annotations

from conveyor.wire.messages import StepPlan, StepResult


def next_token(token_ids: list[int], vocab: int) -> int:
    h = 1469598103
    for t in token_ids:
        h = (h * 1099511 + t) % 2**61
    return h % vocab


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 1000):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab = vocab
        self.seqs: dict[int, dict] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = {"tokens": list(new.token_ids), "computed": 0, "blocks": []}
        sampled = []
        for row in plan.scheduled:
            seq = self.seqs[row.seq_id]
            seq["blocks"] += row.new_block_ids
            assert row.num_tokens >= 1
            seq["computed"] += row.num_tokens
            assert seq["computed"] <= len(seq["tokens"]), "computing tokens that are not known"
            assert len(seq["blocks"]) * self.block_size >= seq["computed"], "block table too short"
            assert all(0 <= b < self.num_blocks for b in seq["blocks"])
            if seq["computed"] == len(seq["tokens"]):
                token = next_token(seq["tokens"], self.vocab)
                seq["tokens"].append(token)
                sampled.append(token)
        held = [b for s in self.seqs.values() for b in s["blocks"]]
        assert len(held) == len(set(held)), "a KV block is held by two live sequences"
        return StepResult(step=plan.step, sampled_token_ids=sampled)
