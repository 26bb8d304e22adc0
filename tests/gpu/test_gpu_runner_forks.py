"""ModelRunner's block-sharing protocol: KV block copies, forks, seeded choices, logprobs, and
prefix-cache hits (NewSeq.num_computed_tokens).

`ForkDriver` plays the scheduler: one free list, reference-counted blocks shared by a sequence
and its forks, and copy-on-write (copy_blocks + replaced_blocks) before a sequence writes into
a block it shares.
"""

from __future__ import annotations

import collections

import pytest
import torch

from conveyor.gpu.step.runner import ModelRunner
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import Fork, NewSeq, ScheduledSeq, StepPlan
from tests.gpu_checkpoints import VOCAB, engine_config, hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
NUM_BLOCKS, BLOCK_SIZE = 64, 4


def new_runner() -> ModelRunner:
    runner = ModelRunner(engine_config("llama", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    runner.initialize_cache(runner.num_available_blocks())
    return runner


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ForkDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(NUM_BLOCKS))[::-1]
        self.refs: collections.Counter[int] = collections.Counter()
        self.tokens: dict[int, list[int]] = {}
        self.num_prompt: dict[int, int] = {}
        self.num_computed: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = collections.defaultdict(list)
        self.step = 0

    def add(self, seq_id: int, prompt: list[int], params: SamplingParams, forks: dict[int, int], chunk: int) -> None:
        """Prefill `prompt` in two steps (`chunk` tokens, then the rest), the last forking into
        forks {seq_id: choice index}; the other live sequences decode alongside."""
        self.tokens[seq_id], self.num_prompt[seq_id] = list(prompt), len(prompt)
        self.num_computed[seq_id], self.tables[seq_id] = 0, []
        self._run([NewSeq(seq_id, list(prompt), params, len(prompt))], {seq_id: chunk})
        self._run([], {seq_id: len(prompt) - chunk}, {seq_id: [Fork(f, i) for f, i in forks.items()]})

    def decode(self) -> None:
        self._run([], {})

    def _run(self, new: list[NewSeq], num_tokens: dict[int, int], forks: dict | None = None) -> None:
        rows, copies = [], []
        for sid, tokens in self.tokens.items():
            start = self.num_computed[sid]
            n = num_tokens.get(sid, len(tokens) - start)
            table, replaced, added = self.tables[sid], [], []
            for pos in range(start // BLOCK_SIZE, -(-(start + n) // BLOCK_SIZE)):
                if pos == len(table):
                    added.append(self._allocate())
                    table.append(added[-1])
                elif self.refs[table[pos]] > 1:  # shared: write into a copy
                    block = self._allocate()
                    copies.append((table[pos], block))
                    replaced.append((pos, block))
                    self.refs[table[pos]] -= 1
                    table[pos] = block
            rows.append(ScheduledSeq(sid, n, added, replaced, (forks or {}).get(sid, [])))
            self.num_computed[sid] += n
        (result,) = self.runner.execute(StepPlan(self.step, new, rows, copy_blocks=copies))
        self.step += 1
        assert len(result.sampled_logprobs) == len(result.sampled_token_ids)
        draws = iter(zip(result.sampled_token_ids, result.sampled_logprobs))
        for row in rows:
            if self.num_computed[row.seq_id] < len(self.tokens[row.seq_id]):
                continue
            parent = row.seq_id
            for fork in row.forks:  # a copy of the parent before its new token
                self.tokens[fork.seq_id] = list(self.tokens[parent])
                self.num_prompt[fork.seq_id] = self.num_prompt[parent]
                self.num_computed[fork.seq_id] = self.num_computed[parent]
                self.tables[fork.seq_id] = list(self.tables[parent])
                self.refs.update(self.tables[parent])
            for sid in (parent, *(f.seq_id for f in row.forks)):
                token, logprob = next(draws)
                self.tokens[sid].append(token)
                self.logprobs[sid].append(logprob)
        assert next(draws, None) is None

    def _allocate(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def outputs(self, sid: int) -> list[int]:
        return self.tokens[sid][self.num_prompt[sid] :]

    def check_runner_state(self) -> None:
        for sid, tokens in self.tokens.items():
            seq = self.runner.seqs[sid]
            assert seq.token_ids == tokens and seq.block_table == self.tables[sid]
            assert seq.num_computed == self.num_computed[sid] == len(tokens) - 1


def hf_greedy(model, tokens: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=max_new)
    return out[0, len(tokens) :].tolist()


def test_copy_blocks_copies_every_layer():
    runner = new_runner()
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [cache.clone() for cache in runner.kv_caches]
    pairs = [(1, 5), (7, 2), (5, 9), (63, 0)]  # 5 is read before it is overwritten
    runner.execute(StepPlan(0, [], [], copy_blocks=pairs))
    assert len(runner.kv_caches) == 2
    for cache, old in zip(runner.kv_caches, before):
        expected = old.clone()
        for src, dst in pairs:
            expected[:, dst] = old[:, src]
        assert torch.equal(cache, expected)
        assert not torch.equal(cache, old)


def test_greedy_forks_read_the_shared_prompt():
    runner, hf = new_runner(), hf_model("llama")
    driver = ForkDriver(runner)
    other = prompt(9, seed=2)  # an unforked sequence in the same batches
    driver.add(10, other, GREEDY, forks={}, chunk=5)
    shared = prompt(10, seed=1)  # 10 % 4 != 0: the last prompt block is shared half-full
    driver.add(0, shared, GREEDY, forks={1: 1, 2: 2}, chunk=6)
    assert {runner.seqs[i].index for i in (0, 1, 2)} == {0, 1, 2}
    first = [driver.outputs(i) for i in (0, 1, 2)]
    assert first[0] == first[1] == first[2] and len(first[0]) == 1
    for _ in range(7):
        driver.decode()
        driver.check_runner_state()
    expected = hf_greedy(hf, shared, 8)
    for sid in (0, 1, 2):
        assert driver.outputs(sid) == expected, sid
    assert driver.outputs(10) == hf_greedy(hf, other, 10)  # 1 + 2 beside seq 0's prefill + 7


def run_seeded(seed: int, temperature: float = 1.0, top_k: int = 0) -> ForkDriver:
    driver = ForkDriver(new_runner())
    # logprobs=0: the sampled logprob alone, which the tests read (without it, it is not computed)
    driver.add(10, prompt(5, seed=3), SamplingParams(temperature=0.0, max_tokens=None, logprobs=0), forks={}, chunk=2)
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, n=3, max_tokens=None, logprobs=0)
    driver.add(0, prompt(10, seed=1), params, forks={1: 1, 2: 2}, chunk=3)
    for _ in range(5):
        driver.decode()
    driver.check_runner_state()
    return driver


def test_seeded_forks_differ_and_reproduce():
    differ = 0
    for seed in range(3):
        driver = run_seeded(seed)
        outputs = [driver.outputs(sid) for sid in (0, 1, 2)]
        differ += len({tuple(o) for o in outputs}) == 3
        again = run_seeded(seed)
        assert [again.outputs(sid) for sid in (0, 1, 2, 10)] == [*outputs, driver.outputs(10)]
        assert again.logprobs == driver.logprobs
    assert differ >= 2


def test_sampled_logprobs_are_the_models():
    driver, hf = run_seeded(seed=7, temperature=1.5, top_k=20), hf_model("llama")  # raw, not these
    for sid, tokens in driver.tokens.items():
        num_prompt = driver.num_prompt[sid]
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0].float()  # [L, V]
        expected = torch.log_softmax(logits[num_prompt - 1 : -1], dim=-1)  # predicts each output
        expected = expected.gather(1, torch.tensor(driver.outputs(sid))[:, None])[:, 0]
        got = torch.tensor(driver.logprobs[sid])
        assert len(got) == len(expected) and (got <= 0).all()
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), sid


def test_prefix_cache_hit_starts_after_the_cached_tokens():
    runner, hf = new_runner(), hf_model("llama")
    first = prompt(11, seed=4)
    runner.execute(StepPlan(0, [NewSeq(0, first, GREEDY, 11)], [ScheduledSeq(0, 11, [3, 9, 4])]))
    # seq 1 shares the first two full blocks (8 tokens) and computes only its own tail
    second = first[:8] + prompt(3, seed=5)
    new = NewSeq(1, second, GREEDY, 11, num_computed_tokens=8)
    (result,) = runner.execute(StepPlan(1, [new], [ScheduledSeq(1, 3, [3, 9, 7])], finished_seq_ids=[0]))
    assert result.sampled_token_ids == hf_greedy(hf, second, 1)
    assert runner.seqs[1].num_computed == 11


def test_a_plan_naming_a_block_outside_the_pool_is_refused_and_the_runner_goes_on():
    runner = new_runner()
    tokens = prompt(6)
    bad = StepPlan(1, [NewSeq(1, tokens, GREEDY, len(tokens))], [ScheduledSeq(1, 6, [0, NUM_BLOCKS])])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.execute(bad)
    good = StepPlan(2, [NewSeq(1, tokens, GREEDY, len(tokens))], [ScheduledSeq(1, 6, [0, 1])])
    (result,) = runner.execute(good)
    assert len(result.sampled_token_ids) == 1
