"""Penalties, logit_bias, min_tokens, min_p and top logprobs: each against a plain reference
(transformers' own processors where it has one), then end to end through ModelRunner on a tiny
checkpoint (greedy with a repetition penalty against transformers' generate, top logprobs
against the model's raw logits, and default rows unaffected by penalised neighbours). Requests
whose logits leave nothing to draw from fail alone: the sampler names them, the rest go on."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from conveyor.engine_config import build_engine_config
from conveyor.gpu.sampling import SamplingRow, apply_penalties, sample, sample_step
from conveyor.gpu.sampling.filters import filter_min_p
from conveyor.gpu.step.profile_steps import profile_run
from conveyor.gpu.step.runner import ModelRunner
from conveyor.tiny.checkpoint import make_checkpoint
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import Fork, NewSeq, ScheduledSeq, StepPlan

V = 64
EOS = (3, 5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def sample_ids(*args, **kwargs) -> torch.Tensor:
    """The sampler's ids [N], where every draw had finite logits to draw from."""
    ids, valid = sample(*args, **kwargs)
    assert valid.all()
    return ids


def history(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- each processor against a reference -----------------------------------------------------


def test_repetition_penalty_matches_transformers():
    x = logits(4)
    penalties = [1.3, 1.0, 0.7, 2.0]  # 1.0: a default row in the same batch
    tokens = [history(12, seed=i) for i in range(4)]
    num_prompt = [5, 5, 12, 0]  # the prompt counts too: HF penalises all of input_ids
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    got = apply_penalties(x, params, tokens, num_prompt, EOS)
    for i, p in enumerate(penalties):
        expected = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([tokens[i]]), x[i : i + 1].clone())
        assert torch.equal(got[i], expected[0])
    assert not torch.equal(got[0], x[0])  # it did something
    assert torch.equal(x, logits(4))  # the raw logits stay intact for logprobs


def test_presence_and_frequency_penalties_count_output_tokens_only():
    x = logits(3, seed=1)
    tokens = [history(20, seed=10 + i) for i in range(3)]
    num_prompt = [8, 15, 20]  # the last row has no output yet: unchanged
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(presence_penalty=2.0, frequency_penalty=2.0),
    ]
    got = apply_penalties(x, params, tokens, num_prompt, EOS)
    expected = x.clone()
    for i, p in enumerate(params):
        for token, count in collections.Counter(tokens[i][num_prompt[i] :]).items():
            expected[i, token] -= p.presence_penalty + p.frequency_penalty * count
    torch.testing.assert_close(got, expected)
    assert torch.equal(got[2], x[2])
    prompt_only = set(tokens[0][:8]) - set(tokens[0][8:])
    assert all(got[0, t] == x[0, t] for t in prompt_only)


def test_logit_bias_forces_a_greedy_token():
    x = logits(3, seed=2)
    target = int(x[1].argmin())
    params = [GREEDY, SamplingParams(temperature=0.0, logit_bias={target: 100.0, 0: -5.0}), GREEDY]
    edited = apply_penalties(x, params, [[1]] * 3, [1] * 3, EOS)
    assert sample_ids(edited, params, [0] * 3).tolist() == [int(x[0].argmax()), target, int(x[2].argmax())]
    assert edited[1, 0] == x[1, 0] - 5.0
    # sampled draws obey it too: +100 leaves the others no mass
    hot = SamplingParams(temperature=1.0, logit_bias={target: 100.0})
    edited = apply_penalties(x, [hot] * 3, [[1]] * 3, [1] * 3, EOS)
    assert sample_ids(edited, [hot] * 3, [0] * 3).tolist() == [target] * 3


def test_min_p_matches_transformers():
    x = logits(5, seed=3) / 2
    min_ps = [0.05, 0.0, 0.2, 0.5, 0.9]
    probs = filter_min_p(torch.softmax(x, -1), [SamplingParams(min_p=m) for m in min_ps])
    for i, m in enumerate(min_ps):
        kept = MinPLogitsWarper(m)(None, x[i : i + 1].clone())[0] > float("-inf") if m else torch.ones(V, dtype=bool)
        assert torch.equal(probs[i] > 0, kept)
    assert (probs[3] > 0).sum() < (probs[2] > 0).sum() < V
    # draws stay inside the kept set
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 200
    draws = set(sample_ids(x[3:4].expand(200, -1), params, [0] * 200).tolist())
    assert draws <= set(torch.nonzero(probs[3] > 0).flatten().tolist())


def test_min_tokens_masks_eos_and_stop_ids_until_the_index():
    row = torch.zeros(1, V)
    row[0, [3, 5, 9]] = torch.tensor([9.0, 8.0, 7.0])  # EOS 3 > EOS 5 > stop id 9 > the rest
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    prompt = [1, 2]
    for num_output in range(5):
        tokens = prompt + [1] * num_output
        edited = apply_penalties(row, [params], [tokens], [2], EOS)
        draw = sample_ids(edited, [params], [num_output]).item()
        assert draw == (3 if num_output >= 3 else 0)  # index 3 on: EOS is back
        if num_output < 3:
            assert edited[0, [3, 5, 9]].eq(float("-inf")).all()
        else:
            assert edited is row  # satisfied: no edit at all
    ignore_eos = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    edited = apply_penalties(row, [ignore_eos], [prompt], [2], EOS)
    assert edited[0, 3] == 9.0 and edited[0, 9] == float("-inf")


def test_default_rows_skip_every_edit():
    x = logits(3)
    defaults = [SamplingParams(), GREEDY, SamplingParams(temperature=0.5, top_k=5, seed=1)]
    assert apply_penalties(x, defaults, [history(30, i) for i in range(3)], [10, 10, 10], EOS) is x
    satisfied = SamplingParams(min_tokens=2, stop_token_ids=[1])
    assert apply_penalties(x, [satisfied], [[1, 2, 3, 4]], [2], EOS) is x
    samples = sample_step(x, [SamplingRow(p, [1], 1, [0]) for p in defaults], EOS)
    assert samples.top_logprobs == [] and len(samples.token_ids) == 3


def test_sample_step_top_logprobs_follow_the_draws():
    x = logits(3, seed=4)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=4, repetition_penalty=3.0), [1, 2], 1, [0, 1, 2]),
        SamplingRow(SamplingParams(logprobs=None), [1], 1, [0]),
        SamplingRow(SamplingParams(logprobs=0), [1], 1, [0, 1]),
    ]
    samples = sample_step(x, rows, EOS)
    assert len(samples.token_ids) == 6 and len(samples.top_logprobs) == 5  # 3 draws + 2 draws
    values, ids = torch.log_softmax(x[0], -1).topk(4)
    for top in samples.top_logprobs[:3]:
        assert top.token_ids == ids.tolist() and top.logprobs == pytest.approx(values.tolist())
    assert all(top.token_ids == [] and top.logprobs == [] for top in samples.top_logprobs[3:])


# --- requests that leave nothing to draw from -----------------------------------------------


def test_sampling_params_bound_temperature_and_repetition_penalty():
    for bad in (1e-50, 0.0099, 100.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^repetition_penalty must be in"):
            SamplingParams(repetition_penalty=bad)
    for bad in (-1e-46, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01
    assert SamplingParams(repetition_penalty=100).repetition_penalty == 100
    assert SamplingParams(temperature=1e-46).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_sample_step_fails_only_the_rows_with_nothing_to_draw():
    """Each trigger of issue 13 in one batch with healthy rows: the bad rows' draws are named in
    failed_draws with an in-vocabulary placeholder, the healthy ones draw as if alone."""
    x = logits(6, seed=5)
    every_id = list(range(V))
    # Built before the bound, or by a caller that skipped __post_init__: the sampler must cope.
    overflow = SamplingParams(temperature=1.0, seed=1)
    overflow.repetition_penalty = 1e-50  # 0 in float32: seen positive logits / 0 = +inf
    seen = [int(x[2].argmax())]  # a positive logit the penalty divides
    rows = [
        SamplingRow(SamplingParams(temperature=0.9, seed=4), [1, 2], 1, [0]),  # draw 0
        SamplingRow(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=every_id), [1], 1, [0]),  # 1
        SamplingRow(overflow, seen, 1, [0]),  # draw 2
        SamplingRow(GREEDY, [1, 2, 3], 2, [0, 1]),  # draws 3, 4
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=every_id), [1], 1, [0, 1]),  # 5, 6
        SamplingRow(SamplingParams(temperature=1e-46), [1], 1, [0]),  # draw 7: greedy, not NaN
    ]
    samples = sample_step(x, rows, EOS)
    assert samples.failed_draws == [1, 2, 5, 6]
    assert len(samples.token_ids) == len(samples.logprobs) == 8
    assert all(0 <= t < V for t in samples.token_ids)
    assert [samples.token_ids[i] for i in samples.failed_draws] == [0, 0, 0, 0]
    healthy = sample_step(x[[0, 3, 5]], [rows[0], rows[3], rows[5]], EOS)
    assert healthy.failed_draws == []
    assert [samples.token_ids[i] for i in (0, 3, 4, 7)] == healthy.token_ids
    assert samples.token_ids[7] == int(x[5].argmax())


# --- through the runner on a tiny checkpoint ------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sampling-ckpt")
    return make_checkpoint(
        path, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )


def new_runner(checkpoint) -> ModelRunner:
    runner = ModelRunner(build_engine_config(str(checkpoint), device="cpu", num_kv_blocks=64))
    runner.initialize_cache(runner.num_available_blocks())
    return runner


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(runner, requests: list[tuple[list[int], SamplingParams]], num_steps: int):
    """Prefill every request in one step, then decode them together: returns each one's outputs
    and each step's StepResult. Blocks are handed out in order."""
    bs, next_block = runner.block_size, 0
    tokens = [list(p) for p, _ in requests]
    computed, results = [0] * len(requests), []
    tables: list[list[int]] = [[] for _ in requests]  # each request's block ids
    new = [NewSeq(i, list(p), params, len(p)) for i, (p, params) in enumerate(requests)]
    for step in range(num_steps):
        rows = []
        for i, toks in enumerate(tokens):
            need = -(-len(toks) // bs) - len(tables[i])
            added = list(range(next_block, next_block + need))
            next_block += need
            tables[i] += added
            rows.append(ScheduledSeq(i, len(toks) - computed[i], added))
            computed[i] = len(toks)
        (result,) = runner.execute(StepPlan(step, new if step == 0 else [], rows))
        new = []
        for toks, token in zip(tokens, result.sampled_token_ids, strict=True):
            toks.append(token)
        results.append(result)
    return [t[len(p) :] for t, (p, _) in zip(tokens, requests)], results


def test_greedy_repetition_penalty_matches_transformers_generate(checkpoint):
    runner = new_runner(checkpoint)
    vocab, eos = runner.config.model.vocab_size, runner.config.model.eos_token_ids
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    num_new = 12
    # min_tokens = min_new_tokens masks EOS on both sides, so neither stops early.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=num_new, max_tokens=num_new)
    prompts = [prompt(9, seed, vocab) for seed in (1, 2)]
    ours, _ = generate(runner, [(p, params) for p in prompts], num_new)
    plain, _ = generate(new_runner(checkpoint), [(p, GREEDY) for p in prompts], num_new)
    for p, got, unpenalised in zip(prompts, ours, plain):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([p]),
                do_sample=False,
                repetition_penalty=1.8,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
            )
        assert got == out[0, len(p) :].tolist()
        assert got != unpenalised  # the penalty changed the continuation


def test_top_logprobs_are_the_raw_logits_topk(checkpoint):
    runner = new_runner(checkpoint)
    vocab = runner.config.model.vocab_size
    raw: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden, upcast=True: raw.append(compute_logits(hidden)) or raw[-1]
    asks = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0, logit_bias={7: 30.0}),
        SamplingParams(temperature=1.0, seed=3, logprobs=None),
        SamplingParams(temperature=0.7, logprobs=0, presence_penalty=1.0),
        SamplingParams(temperature=1.0, top_k=3, logprobs=20),
    ]
    requests = [(prompt(6 + i, 10 + i, vocab), p) for i, p in enumerate(asks)]
    _, results = generate(runner, requests, 4)
    for step_logits, result in zip(raw, results, strict=True):
        logprobs = torch.log_softmax(step_logits, -1)  # [S, V] before penalties and bias
        tops = result.top_logprobs  # one per draw once any asked: empty where the draw's sequence did not
        assert [len(t.token_ids) for t in tops] == [5, 0, 0, 20] and [len(t.logprobs) for t in tops] == [5, 0, 0, 20]
        for top, row in zip(tops, range(4)):
            values, ids = logprobs[row].topk(len(top.token_ids))
            assert top.token_ids == ids.tolist()
            torch.testing.assert_close(torch.tensor(top.logprobs), values)
        assert result.sampled_token_ids[0] == 7  # the bias picks the token; logprobs ignore it
        sampled = logprobs[range(4), result.sampled_token_ids]
        got = torch.tensor(result.sampled_logprobs)
        torch.testing.assert_close(got[[0, 2, 3]], sampled[[0, 2, 3]])
        assert got[1].isnan()  # nobody reads it (no logprobs, no best_of): not computed


def test_forks_get_one_top_logprobs_entry_each(checkpoint):
    runner = new_runner(checkpoint)
    params = SamplingParams(temperature=1.0, logprobs=2, n=3, frequency_penalty=1.0)
    plan = StepPlan(0, [NewSeq(0, [5, 6, 7], params, 3)], [ScheduledSeq(0, 3, [0], forks=[Fork(1, 1), Fork(2, 2)])])
    (result,) = runner.execute(plan)
    assert len(result.sampled_token_ids) == 3 and len(result.top_logprobs) == 3
    assert result.top_logprobs[0] == result.top_logprobs[1] == result.top_logprobs[2]
    assert len(result.top_logprobs[0].token_ids) == 2


def test_default_rows_ignore_penalised_neighbours(checkpoint):
    vocab = new_runner(checkpoint).config.model.vocab_size
    defaults = [
        (prompt(7, 20, vocab), GREEDY),
        (prompt(11, 21, vocab), SamplingParams(temperature=1.0, seed=9, max_tokens=None)),
        (prompt(5, 22, vocab), SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=None)),
    ]
    penalised = [
        (prompt(9, 23, vocab), SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3, max_tokens=None)),
        (prompt(8, 24, vocab), SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, min_tokens=6, seed=2)),
        (prompt(6, 25, vocab), SamplingParams(temperature=0.5, logit_bias={1: 5.0}, min_p=0.1, seed=1)),
    ]
    alone, _ = generate(new_runner(checkpoint), defaults, 10)
    mixed, _ = generate(new_runner(checkpoint), [penalised[0], defaults[0], *penalised[1:], *defaults[1:]], 10)
    assert [mixed[1], mixed[4], mixed[5]] == alone


def test_profile_run_exercises_every_feature(checkpoint):
    """The memory profile's sampling (every feature on) runs; on CPU it only needs no CUDA."""
    runner = new_runner(checkpoint)
    profile_run(runner)


def test_runner_reports_a_failed_draw_and_goes_on(checkpoint):
    runner = new_runner(checkpoint)
    vocab = runner.config.model.vocab_size
    masked = SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=list(range(vocab)), max_tokens=8)
    ok = [(prompt(5, 30, vocab), GREEDY)]
    requests = [ok[0], (prompt(6, 31, vocab), masked), (prompt(4, 32, vocab), SamplingParams(temperature=1e-46))]
    outputs, results = generate(runner, requests, 3)
    # Its first draw fails; the worker then masks it (the scheduler ends such a sequence), and
    # the other rows go on.
    assert results[0].failed_draws == [1] and results[0].masked_draws == []
    assert all(r.failed_draws == [] and r.masked_draws == [1] for r in results[1:])
    assert all(0 <= t < vocab for out in outputs for t in out)
    alone, _ = generate(new_runner(checkpoint), ok + [(requests[2][0], GREEDY)], 3)
    assert [outputs[0], outputs[2]] == alone
