"""A stand-in for gpu.step.runner.ModelRunner that follows the StepPlan protocol and checks it.

It keeps a simulated KV store: computing a token writes its id into the slot its block table
names, and the next token is a hash of the context *read back through the block table*. So a
block shared without copy-on-write, a wrong prefix-cache hit, a lost or repeated token, or a
bad fork all change the outputs, which tests compare with `expected_tokens`.

Its KV host tier copies as the worker does (gpu/step/features/kv_offload.py): a plan's saves,
then its loads, before its passes. A load into a block some row of the plan names is waited for
by the plan's first pass (a host hit that starts in the plan that loads it); any other load may
land while the plan's passes run, so no row, pass or block copy of that plan may touch its
blocks (`_landing`: an assertion, not a race left to chance).

With a disk tier (`disk`) it writes each named save through to a dict, reads the plan's
`kv_fetches` from it into host slots, and answers them when `take_fetched` is called (the
worker's loop looking for finished reads) for the `read_delay`-th time since they came, unless
`hold_reads`. A name `lost` selects was never written (a dropped write): its read is a miss.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.wire.messages import KvFetched
from conveyor.wire.step import NO_NAME, ScheduledSeq, StepPlan, StepResult
from conveyor.wire.stop_rules import stops_on, tokens_left

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
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int = 1 << 30,
        disk: bool = False,
        lost: Callable[[int], bool] = lambda name: False,
    ):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.spec_rows: list[tuple[int, int]] = []  # (drafts, accepted) of each verifying row
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: dict[int, list[int | None]] = {}  # the KV host tier's slots (stages/scheduler/kv_tiers.py)
        self.disk: dict[int, list[int | None]] | None = {} if disk else None  # the disk tier's files, by block name
        self.lost = lost  # names whose write is dropped
        self.reads: list[tuple[int, int]] = []  # (name, slot) read, not answered yet
        self.hold_reads = False  # answer no read (take_fetched) while set
        self.read_delay = 1  # take_fetched calls a read waits for its answer
        self._read_ages: list[int] = []  # per read: take_fetched calls since it came
        self.num_reads = 0
        self.seqs: dict[int, dict] = {}
        self._landing: set[int] = set()  # blocks this plan loads for the next: its passes never touch them

    def execute(self, plan: StepPlan) -> StepResult:
        """Run a single-pass plan."""
        assert plan.num_steps == 1, "a window answers with one result per pass: execute_passes"
        self._prepare(plan)
        sampled, logprobs, seq_ids = [], [], []
        for row in plan.scheduled:
            seq = self.seqs[row.seq_id]
            self._table(seq, row)
            if row.num_lookahead:
                run = self._verify(seq, row)
                sampled += run
                logprobs += [-(t % 7) / 7 for t in run]
                seq_ids += [row.seq_id] * len(run)
                continue
            end = self._compute(seq, row.num_tokens)
            if end < len(seq["tokens"]):
                continue
            context = self._context(seq, end)
            # A sequence's first output is salted by its choice index, whether it is drawn as a
            # fork or by a sample that starts again after preemption.
            salt = seq["index"] if len(seq["tokens"]) == seq["prompt"] else 0
            draws = [next_token(context, salt)] + [next_token(context, f.index) for f in row.forks]
            for fork, token in zip(row.forks, draws[1:]):
                self.seqs[fork.seq_id] = {
                    "tokens": seq["tokens"] + [token],
                    "computed": end,
                    "blocks": list(seq["blocks"]),
                    "index": fork.index,
                    "prompt": seq["prompt"],
                    "params": seq["params"],
                }
            seq["tokens"].append(draws[0])
            sampled += draws
            logprobs += [-(t % 7) / 7 for t in draws]
            seq_ids += [row.seq_id, *(f.seq_id for f in row.forks)]
        return StepResult(step=plan.step, sampled_token_ids=sampled, sampled_logprobs=logprobs, seq_ids=seq_ids)

    def execute_passes(self, plan: StepPlan, end_after: int | None = None) -> list[StepResult]:
        """Run a plan, one result per pass. In a window, each pass decodes one token of every
        row with passes left, its input the token the pass before drew; a row whose sequence
        stopped in the window (EOS unless ignore_eos, a stop token id, once min_tokens outputs
        exist) is masked from then on, and the window ends early once every row with passes left
        stopped. `end_after` ends it after that pass regardless, as a worker may."""
        if plan.num_steps == 1:
            return [self.execute(plan)]
        self._prepare(plan)
        for row in plan.scheduled:
            assert not row.forks, "a window never forks"
            self._table(self.seqs[row.seq_id], row)
        stopped: set[int] = set()
        results = []
        for k in range(plan.num_steps):
            sampled: list[int] = []
            logprobs: list[float] = []
            masked: list[int] = []
            seq_ids = [row.seq_id for row in plan.scheduled if row.num_tokens > k]
            for row in plan.scheduled:
                if row.num_tokens <= k:
                    continue
                if row.seq_id in stopped:
                    masked.append(len(sampled))
                    sampled.append(0)
                    logprobs.append(0.0)
                    continue
                seq = self.seqs[row.seq_id]
                end = self._compute(seq, 1)
                assert end == len(seq["tokens"]), "a window row decodes: one unknown token per pass"
                salt = seq["index"] if len(seq["tokens"]) == seq["prompt"] else 0
                token = next_token(self._context(seq, end), salt)
                seq["tokens"].append(token)
                sampled.append(token)
                logprobs.append(-(token % 7) / 7)
                if self._stops(seq, token):
                    stopped.add(row.seq_id)
            last = k == plan.num_steps - 1 or k == end_after
            last = last or all(r.seq_id in stopped for r in plan.scheduled if r.num_tokens > k + 1)
            results.append(
                StepResult(
                    plan.step, sampled, sampled_logprobs=logprobs, pass_index=k, last_pass=last, masked_draws=masked, seq_ids=seq_ids
                )
            )
            if last:
                return results
        raise AssertionError("unreachable: the final pass is last")

    def _verify(self, seq: dict, row: ScheduledSeq) -> list[int]:
        """A row granted a lookahead (speculative decoding): drafts that are the model's own
        tokens for a pseudo-random count, then a wrong one, each written into the KV slot its
        table names; the run it keeps (the accepted drafts, then the model's token where the
        first wrong draft was, or after the last), cut after a token that stops. Its computed
        count moves past the accepted drafts only: rejected slots are written again later."""
        assert row.num_tokens == 1 and not row.forks, "only a one-token decode row verifies drafts"
        bs, start, prompt = self.block_size, seq["computed"], seq["prompt"]
        assert start == len(seq["tokens"]) - 1, "a verifying row decodes its last token"
        params = seq["params"]
        left = tokens_left(params, len(seq["tokens"]), prompt, self.max_model_len) - 1  # past the row's own token
        limit = min(row.num_lookahead, left, len(seq["blocks"]) * bs - start - 1)
        truth = list(seq["tokens"])
        for _ in range(max(0, limit)):
            truth.append(next_token(truth))
        right = next_token(seq["tokens"], 1) % (max(0, limit) + 1)  # drafts that hold
        drafts = truth[len(seq["tokens"]) : len(seq["tokens"]) + right]
        if right < limit:
            drafts.append((truth[len(seq["tokens"]) + right] + 1) % VOCAB)
        written = seq["tokens"] + drafts
        for p in range(start, start + 1 + len(drafts)):
            self._touch(seq["blocks"][p // bs])[p % bs] = written[p]
        run = []
        for j in range(len(drafts) + 1):
            token = next_token(self._context(seq, start + 1 + j))  # read back through the table, drafts included
            run.append(token)
            seq["tokens"].append(token)
            if self._stops(seq, token) or j == len(drafts) or drafts[j] != token:
                break
        seq["computed"] = start + len(run)
        self.spec_rows.append((len(drafts), len(run) - 1))
        return run

    def _prepare(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = {
                "tokens": list(new.token_ids),
                "computed": new.num_computed_tokens,
                "blocks": [],
                "index": new.index,
                "prompt": new.num_prompt_tokens,
                "params": new.params,
            }
        reading = {slot for _, slot in self.reads}
        for block, slot, name in plan.kv_saves:  # saves, then loads, then reads, before the passes, as the worker does
            assert slot not in reading, "a save into a slot being read from disk"
            self.host[slot] = list(self.kv[block])
            if self.disk is not None and name != NO_NAME and not self.lost(name):
                self.disk[name] = list(self.kv[block])
        named = {b for row in plan.scheduled for b in [*row.new_block_ids, *(b for _, b in row.replaced_blocks)]}
        self._landing = set()
        for slot, block in plan.kv_loads:
            assert slot not in reading, "a load from a slot being read from disk"
            self.kv[block] = list(self.host[slot])
            if block not in named:
                self._landing.add(block)
        for name, slot in plan.kv_fetches:
            assert all(slot != s for _, s in self.reads), "a slot read into twice"
            assert all(slot != s for s, _ in plan.kv_loads), "a read into a slot a load reads"
            assert all(slot != s for _, s, _ in plan.kv_saves), "a read into a slot a save writes"
            self.host[slot] = [None] * self.block_size  # being written: nothing valid until answered
            self.reads.append((name, slot))
            self._read_ages.append(0)
        for src, dst in plan.copy_blocks:
            assert src not in self._landing and dst not in self._landing, "a block copy touches a block still being loaded"
            self.kv[dst] = list(self.kv[src])

    def take_fetched(self, rank: int = 0) -> KvFetched | None:
        """Answer the reads that have waited `read_delay` calls: each file copied into its slot,
        or missed; None when none is answered."""
        self._read_ages = [age + 1 for age in self._read_ages]
        if self.hold_reads:
            return None
        done = [read for read, age in zip(self.reads, self._read_ages) if age >= self.read_delay]
        if not done:
            return None
        assert self.disk is not None, "a read without a disk tier"
        fetched, missed = [], []
        for name, slot in done:
            block = self.disk.get(name)
            if block is None:
                missed.append((name, slot))
            else:
                self.host[slot] = list(block)
                fetched.append((name, slot))
        self.num_reads += len(done)
        self.reads, self._read_ages = self.reads[len(done) :], self._read_ages[len(done) :]
        return KvFetched(rank, fetched, missed)

    @staticmethod
    def _table(seq: dict, row: ScheduledSeq) -> None:
        for pos, block in row.replaced_blocks:
            seq["blocks"][pos] = block
        seq["blocks"] += row.new_block_ids

    def _compute(self, seq: dict, num_tokens: int) -> int:
        """Write the KV of the sequence's next `num_tokens` known tokens; the new computed count."""
        bs = self.block_size
        start, end = seq["computed"], seq["computed"] + num_tokens
        assert num_tokens >= 1 and end <= len(seq["tokens"]), "computing unknown tokens"
        assert len(seq["blocks"]) * bs >= end, "block table too short"
        for p in range(start, end):
            self._touch(seq["blocks"][p // bs])[p % bs] = seq["tokens"][p]
        seq["computed"] = end
        return end

    def _context(self, seq: dict, end: int) -> list[int]:
        """The sequence's first `end` tokens, read back from the KV through its block table."""
        bs = self.block_size
        context = []
        for p in range(end):
            token = self._touch(seq["blocks"][p // bs])[p % bs]
            assert token is not None, "reading a KV slot no pass wrote"
            context.append(token)
        return context

    def _touch(self, block: int) -> list[int | None]:
        """A block's KV, for a pass to read or write: never one a load for the next plan fills."""
        assert block not in self._landing, f"a pass touches block {block}, which a load for the next plan fills"
        return self.kv[block]

    def _stops(self, seq: dict, token: int) -> bool:
        """The worker's stop check, the rule both processes share: EOS or a stop token id, once
        min_tokens outputs exist (engine_driver.reference states it again, as the tests' oracle)."""
        return stops_on(seq["params"], token, len(seq["tokens"]) - seq["prompt"], self.eos_token_ids)
