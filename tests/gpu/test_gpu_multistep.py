"""The runner's device-resident steps on a CPU: multi-step windows, ids fed back on the device
while the host lags, masking of sequences that stop inside a window, and the persistent batch.

`WindowDriver` plays the scheduler's part of the protocol: it prefills prompts in single steps,
then plans decode windows of K passes (each row min(K, tokens it has left), blocks for all of
them allocated up front) and reads each pass's StepResult as the scheduler would: pass k's draws
are the rows with more than k passes, masked draws carry no token. With `lag` it launches the
next plan before collecting the last one's results, as the worker does under asynchronous
scheduling, so decode inputs must come from the device.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.runner import ModelRunner
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan, StepResult
from tests.gpu_checkpoints import VOCAB, engine_config, hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
BLOCK_SIZE, NUM_BLOCKS = 4, 128
FAMILIES = ["llama", "mistral", "mistral_swa", "qwen2"]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(length),), generator=g).tolist() for length in torch.randint(3, 14, (n,), generator=g)]


class WindowDriver:
    def __init__(self, runner: ModelRunner, k: int, lag: bool = False) -> None:
        self.runner, self.k, self.lag = runner, k, lag
        self.free = list(range(runner.num_blocks))[::-1]
        self.tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}  # known tokens, by count (the ids may still be in flight)
        self.limit: dict[int, int] = {}  # tokens at which each sequence ends (its max_tokens)
        self.outputs: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.plans: dict[int, StepPlan] = {}
        self.results: list[StepResult] = []
        self.step = 0

    def run(self, requests: list[tuple[list[int], SamplingParams, int]]) -> dict[int, list[int]]:
        """Prefill every prompt in one step, then decode in windows until every sequence ended."""
        new = [NewSeq(i, p, params, len(p)) for i, (p, params, _) in enumerate(requests)]
        rows = []
        for i, (p, _, max_new) in enumerate(requests):
            self.tables[i], self.num_tokens[i], self.limit[i], self.outputs[i] = [], len(p), len(p) + max_new, []
            rows.append(ScheduledSeq(i, len(p), self._blocks(i, len(p))))
            self.num_tokens[i] += 1  # its first draw
        self._launch(StepPlan(self.step, new, rows))
        while live := [i for i in self.tables if i not in self.finished and self.num_tokens[i] < self.limit[i]]:
            rows = []
            for i in live:
                passes = min(self.k, self.limit[i] - self.num_tokens[i])
                computed = self.num_tokens[i] - 1
                rows.append(ScheduledSeq(i, passes, self._blocks(i, computed + passes)))
                self.num_tokens[i] += passes
            self._launch(StepPlan(self.step, [], rows, num_steps=max(r.num_tokens for r in rows)))
        self._apply(self.runner.collect(keep=0))
        return self.outputs

    def _launch(self, plan: StepPlan) -> None:
        self.plans[plan.step] = plan
        self.step += 1
        for _ in self.runner.launch(plan):
            if not self.lag:
                self._apply(self.runner.collect(keep=0))
        if not self.lag:
            self._apply(self.runner.collect(keep=0))

    def _apply(self, results: list[StepResult]) -> None:
        for result in results:
            self.results.append(result)
            plan = self.plans[result.step]
            # A single step draws for every row here (each reaches its end); pass k of a window
            # for the rows with more than k passes.
            draws = [row.seq_id for row in plan.scheduled if plan.num_steps == 1 or row.num_tokens > result.pass_index]
            assert len(result.sampled_token_ids) == len(draws)
            for d, (seq_id, token) in enumerate(zip(draws, result.sampled_token_ids)):
                if d in result.masked_draws:
                    assert seq_id in self.finished, "a masked draw for a sequence that did not stop"
                    continue
                if seq_id in self.finished:
                    continue  # a draw planned before its sequence stopped (lag): dropped
                self.outputs[seq_id].append(token)
                params = next(n.params for p in self.plans.values() for n in p.new_seqs if n.seq_id == seq_id)
                if token in params.stop_token_ids and len(self.outputs[seq_id]) >= params.min_tokens:
                    self.finished.add(seq_id)
                    self.limit[seq_id] = 0

    def _blocks(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.tables[seq_id]
        added = [self.free.pop() for _ in range(-(-num_tokens // BLOCK_SIZE) - len(table))]
        table += added
        return added


def new_runner(family: str) -> ModelRunner:
    runner = ModelRunner(engine_config(family, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    runner.initialize_cache(runner.num_available_blocks())
    return runner


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_the_same_for_1_4_and_8_steps(family):
    requests = [(p, GREEDY, n) for p, n in zip(prompts(5, seed=3), (9, 13, 1, 16, 7))]
    outputs = {k: WindowDriver(new_runner(family), k).run(requests) for k in (1, 4, 8)}
    assert outputs[1] == outputs[4] == outputs[8]
    assert [len(outputs[1][i]) for i in range(5)] == [9, 13, 1, 16, 7]
    if family == "llama":  # and they are transformers' tokens
        hf = hf_model(family)
        for i, (p, _, n) in enumerate(requests):
            with torch.no_grad():
                expected = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n)[0, len(p) :].tolist()
            assert outputs[8][i] == expected, i


def test_results_stream_per_pass_and_windows_advance_on_the_device():
    driver = WindowDriver(new_runner("llama"), 4)
    driver.run([(p, GREEDY, 10) for p in prompts(3, seed=5)])
    windows = [r for r in driver.results if r.step > 0]
    # 10 tokens: the prefill's, then windows of 4 and 4, then a single step: one result per pass.
    assert [(r.pass_index, r.last_pass) for r in windows] == [(0, False), (1, False), (2, False), (3, True)] * 2 + [(0, True)]
    assert all(len(r.sampled_token_ids) == 3 and r.busy_time > 0 for r in windows)


@pytest.mark.parametrize("lag", [False, True])
def test_a_sequence_stopping_inside_a_window_is_masked_and_the_others_go_on(lag):
    family = "qwen2"
    reference = WindowDriver(new_runner(family), 1).run([(p, GREEDY, 12) for p in prompts(3, seed=7)])
    # Sequence 1 ends on the first of its tokens (past the prefill's) not seen before in it: pass
    # j - 1 of the first window draws output j.
    j = next(j for j in range(2, 8) if reference[1][j] not in reference[1][:j])
    stop = reference[1][j]
    stopping = SamplingParams(temperature=0.0, max_tokens=None, stop_token_ids=[stop])
    requests = [(p, stopping if i == 1 else GREEDY, 12) for i, p in enumerate(prompts(3, seed=7))]
    driver = WindowDriver(new_runner(family), 8, lag=lag)
    outputs = driver.run(requests)
    assert outputs[1] == reference[1][: j + 1]
    assert outputs[0] == reference[0] and outputs[2] == reference[2]
    first_window = [r for r in driver.results if r.step == 1]
    masked = [r.pass_index for r in first_window if 1 in r.masked_draws]
    # Masked from the next pass on. A host that sees its ids late still computes those passes,
    # and masks them when they land.
    assert masked == list(range(j, 8))


def test_a_window_ends_early_when_every_row_stopped():
    reference = WindowDriver(new_runner("llama"), 1).run([(p, GREEDY, 8) for p in prompts(2, seed=11)])
    requests = [
        (p, SamplingParams(temperature=0.0, max_tokens=None, stop_token_ids=[reference[i][1]]), 8)
        for i, p in enumerate(prompts(2, seed=11))
    ]
    driver = WindowDriver(new_runner("llama"), 8)
    outputs = driver.run(requests)
    assert all(outputs[i] == reference[i][: reference[i].index(reference[i][1]) + 1] for i in range(2))
    window = [r for r in driver.results if r.step == 1]
    assert window[-1].last_pass and len(window) < 7  # both stopped at pass 0: nothing after pass 1


def test_lagging_host_feeds_decode_inputs_from_the_device():
    requests = [(p, GREEDY, 9) for p in prompts(4, seed=13)]
    eager = WindowDriver(new_runner("mistral"), 1).run(requests)
    driver = WindowDriver(new_runner("mistral"), 1, lag=True)
    runner = driver.runner
    assert driver.run(requests) == eager
    assert all(seq.num_tokens == len(seq.token_ids) for seq in runner.seqs.values())  # the host caught up at the end


def test_sampling_features_are_the_same_in_windows():
    """Seeds, penalties (which make a pass wait for the ids in flight) and logprobs."""
    asks = [
        SamplingParams(temperature=0.8, seed=5, max_tokens=None, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=None, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=1.0, seed=9, top_k=5, min_tokens=3, max_tokens=None),
    ]
    requests = [(p, params, 11) for p, params in zip(prompts(3, seed=17), asks)]
    drivers = {k: WindowDriver(new_runner("llama"), k, lag=k == 8) for k in (1, 8)}
    outputs = {k: d.run(requests) for k, d in drivers.items()}
    assert outputs[1] == outputs[8]
    tops = {
        k: [r.top_logprobs[0].token_ids for r in d.results if r.top_logprobs and r.top_logprobs[0].token_ids]
        for k, d in drivers.items()
    }
    assert tops[1] == tops[8] and len(tops[1]) == 11


def test_persistent_batch_rows_are_recycled_and_grow():
    batch = PersistentBatch(2, 4, torch.device("cpu"))
    a, b = batch.add(10, [1, 2]), batch.add(11, [3])
    assert {a, b} == {0, 1}
    c = batch.add(12, [4, 5, 6])  # a third row: the tensors double, the old rows stay
    assert batch.num_rows == 4 and batch.block_tables[a, :2].tolist() == [1, 2] and batch.block_tables[c, :3].tolist() == [4, 5, 6]
    batch.remove(11)
    assert batch.add(13, [7]) == b and batch.block_tables[b].tolist() == [7, 0, 0, 0]  # recycled, cleared
    child = batch.fork(12, 14)
    batch.set_blocks(14, 2, [9])  # copy-on-write of the child's last block leaves the parent's
    assert batch.block_tables[child, :3].tolist() == [4, 5, 9] and batch.block_tables[c, :3].tolist() == [4, 5, 6]
    batch.feed_back(torch.tensor([c, child]), torch.tensor([42, 43]))
    assert batch.last_token[[c, child]].tolist() == [42, 43]
    tables = batch.tables_for(torch.tensor([child, a]), 2)
    assert tables.tolist() == [[4, 5], [1, 2]] and tables.is_contiguous()
    with pytest.raises(ValueError, match="exceed"):
        batch.set_blocks(10, 3, [1, 2])


def test_a_bad_window_is_refused_before_anything_changes():
    runner = new_runner("llama")
    driver = WindowDriver(runner, 1)
    driver.run([(prompts(1)[0], GREEDY, 1)])
    seq = runner.seqs[0]
    before = (list(seq.token_ids), seq.num_computed, list(seq.block_table))
    too_long = StepPlan(9, [], [ScheduledSeq(0, 5, [])], num_steps=4)  # more passes than the plan has
    no_room = StepPlan(9, [], [ScheduledSeq(0, 4, [])], num_steps=4)  # blocks for 4 more tokens missing
    for plan in (too_long, no_room):
        with pytest.raises(ValueError):
            list(runner.launch(plan))
    assert (list(seq.token_ids), seq.num_computed, list(seq.block_table)) == before


def test_decode_passes_replay_through_the_graph_buffers():
    """The runner's CUDA-graph path on a CPU: DecodeGraphs without capture runs the model over the
    same static buffers and padding a replay would (the triton backend, under the interpreter).
    Decode passes of 3 rows go through bucket 4 and must give the eager path's tokens."""
    from conveyor.gpu.backends import select
    from conveyor.gpu.step.cuda_graphs import DecodeGraphs

    def runner(graphs: bool) -> ModelRunner:
        config = engine_config("llama", block_size=BLOCK_SIZE, num_blocks=16)
        r = ModelRunner(config, backend=select("triton", torch.device("cpu"), config.model))
        r.initialize_cache(16)
        if graphs:
            r.graphs = DecodeGraphs(
                r.model,
                r.attn,
                r.kv_caches,
                buckets=[1, 2, 4],
                max_blocks_per_seq=r.max_blocks_per_seq,
                block_size=BLOCK_SIZE,
                sliding_window=None,
                scratch_block=16,
                device=r.device,
                capture=False,
            )
        return r

    logprobs_too = SamplingParams(temperature=0.0, max_tokens=None, logprobs=0)  # the logprobs compare the logits
    requests = [(p, logprobs_too, 5) for p in prompts(3, seed=19)]
    graphed = runner(graphs=True)
    replays = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda *args: replays.append(len(args[0])) or run(*args)
    drivers = [WindowDriver(graphed, 4), WindowDriver(runner(graphs=False), 4)]
    assert drivers[0].run(requests) == drivers[1].run(requests)
    assert replays == [3] * 4  # every decode pass (4 of them after the prefill), none of the prefill
    logprobs = [torch.tensor([r.sampled_logprobs for r in d.results]) for d in drivers]
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-5, rtol=1e-5)


def test_the_python_api_gives_the_same_outputs_for_any_number_of_steps(default_model):
    """Through LLM.generate (scheduler, runner and detokenizer in one process): stop strings,
    several samples, seeds and logprobs, with windows of 1, 4 and 8 passes."""
    from conveyor.llm import LLM

    prompts_ = ["The sea", "Once upon a time, a fox", "Numbers: one two three"]
    asks = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[" the"], ignore_eos=True),
    ]
    outputs = {}
    for k in (1, 4, 8):
        llm = LLM(str(default_model), device="cpu", num_kv_blocks=128, num_scheduler_steps=k)
        outputs[k] = [
            [(c.token_ids, c.text, c.finish_reason, [lp.logprob for lp in c.logprobs]) for c in out.outputs]
            for out in llm.generate(prompts_, asks)
        ]
    assert outputs[1] == outputs[4] == outputs[8]
    assert [len(c[0]) for c in outputs[1][0]] == [13] and [len(c[0]) for c in outputs[1][1]] == [9, 9]


def test_draws_read_their_parameters_from_the_batch():
    """The sampler reading temperature, top_k, top_p and min_p from the persistent batch's table
    draws what it draws from the host's SamplingParams (same uniforms: every draw seeded)."""
    from conveyor.gpu.sampling import sample

    asks = [
        SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=0.0, seed=2),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=3),
        SamplingParams(temperature=1.0, top_k=10_000, seed=4),  # past the vocabulary: no limit
        SamplingParams(temperature=0.5, top_k=3, top_p=0.5, seed=5),
    ]
    batch = PersistentBatch(2, 4, torch.device("cpu"))  # grows past its 2 rows
    slots = [batch.add(i, [], p) for i, p in enumerate(asks)]
    forked = batch.fork(4, 9)  # a fork draws with its parent's parameters
    assert batch.params.top_k[forked] == 3 and batch.params.temperature[forked] == 0.5
    logits = torch.randn(len(asks), 64, generator=torch.Generator().manual_seed(0)) * 3
    table = batch.params.gather(torch.tensor(slots))
    for step in range(3):
        expected, valid = sample(logits, asks, [step] * 5)
        got, got_valid = sample(logits, asks, [step] * 5, draw_params=table)
        assert torch.equal(got, expected) and torch.equal(got_valid, valid)
    wrong = batch.params.gather(torch.tensor(slots[::-1]))  # the parameters do matter
    assert not all(
        torch.equal(sample(logits, asks, [s] * 5, draw_params=wrong)[0], sample(logits, asks, [s] * 5)[0]) for s in range(3)
    )
