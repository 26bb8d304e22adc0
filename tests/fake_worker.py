"""A stand-in for gpu.runner.ModelRunner that follows the StepPlan protocol and checks it.

It keeps a simulated KV store: computing a token writes its id into the slot its block table
names, and the next token is a hash of the context *read back through the block table*. So a
block shared without copy-on-write, a wrong prefix-cache hit, a lost or repeated token, or a
bad fork all change the outputs, which tests compare with `expected_tokens`.
"""

from __future__ import annotations

from conveyor.wire.messages import StepPlan, StepResult

VOCAB = 1000


def next_token(context: list[int], index: int = 0) -> int:
    """The fake model: a hash of the whole context, salted by the sample index."""
    h = 1469598103 + 7919 * index
    for t in context:
        h = (h * 1099511 + t) % 2**61
    return h % VOCAB


def expected_tokens(prompt: list[int], num: int, index: int = 0, stop: int | None = None) -> list[int]:
    """What sample `index` of `prompt` must generate: the first from the salted hash, the rest
    from the unsalted one (a fork is drawn with its own index once, then decodes normally)."""
    tokens = list(prompt)
    for i in range(num):
        token = next_token(tokens, index if i == 0 else 0)
        tokens.append(token)
        if token == stop:
            break
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, dict] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = {"tokens": list(new.token_ids), "computed": new.num_computed_tokens, "blocks": [],
                                     "index": new.index, "prompt": new.num_prompt_tokens}  # fmt: skip
        for src, dst in plan.copy_blocks:
            self.kv[dst] = list(self.kv[src])
        sampled, logprobs = [], []
        for row in plan.scheduled:
            seq = self.seqs[row.seq_id]
            for pos, block in row.replaced_blocks:
                seq["blocks"][pos] = block
            seq["blocks"] += row.new_block_ids
            start, end = seq["computed"], seq["computed"] + row.num_tokens
            assert row.num_tokens >= 1 and end <= len(seq["tokens"]), "computing unknown tokens"
            assert len(seq["blocks"]) * bs >= end, "block table too short"
            for p in range(start, end):
                self.kv[seq["blocks"][p // bs]][p % bs] = seq["tokens"][p]
            seq["computed"] = end
            if end < len(seq["tokens"]):
                continue
            context = [self.kv[seq["blocks"][p // bs]][p % bs] for p in range(end)]
            # A sequence's first output is salted by its choice index, whether it is drawn as a
            # fork or by a sample that starts again after preemption.
            salt = seq["index"] if len(seq["tokens"]) == seq["prompt"] else 0
            draws = [next_token(context, salt)] + [next_token(context, f.index) for f in row.forks]
            for fork, token in zip(row.forks, draws[1:]):
                self.seqs[fork.seq_id] = {
                    "tokens": seq["tokens"] + [token], "computed": end, "blocks": list(seq["blocks"]),
                    "index": fork.index, "prompt": seq["prompt"],
                }  # fmt: skip
            seq["tokens"].append(draws[0])
            sampled += draws
            logprobs += [-(t % 7) / 7 for t in draws]
        return StepResult(step=plan.step, sampled_token_ids=sampled, sampled_logprobs=logprobs)
