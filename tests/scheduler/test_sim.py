"""The scheduling simulator: cost model fit and scaling, workloads, the event loop over the real
EngineCore (hand-checked timings, conservation, determinism), metrics, and the CLI. Host cost,
asynchronous scheduling and multi-step are test_sim_host.py's."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conveyor.config import CacheConfig, SchedulerConfig
from conveyor.gpu.emulated.costmodel import CostModel, Measurement, StepShape, fit
from conveyor.sim import __main__ as cli
from conveyor.sim.presets import A100_7B, CPU_TINY, PRESETS
from conveyor.sim.run_metrics import compute, meets_sla
from conveyor.sim.simulator import RequestRecord, SimConfig, build_scheduler, simulate
from conveyor.sim.workloads import SimRequest, WorkloadConfig, make_requests

SHAREGPT = "/work/shared/workloads/sharegpt_sample.json"
AFFINE = CostModel(intercept_s=1e-3, per_token_s=1e-4, name="affine")  # 1 ms + 0.1 ms per token


def request(i: int, prompt_len: int, output_len: int, arrival: float = 0.0) -> SimRequest:
    return SimRequest(f"r{i}", tuple((i * 131 + j) % 3000 for j in range(prompt_len)), output_len, arrival)


# --- cost model -------------------------------------------------------------------------


def test_step_shape_counts_tokens_rows_context_and_pairs():
    shape = StepShape.of_rows([(0, 4), (10, 1), (8, 2)])  # a fresh prompt, a decode, a chunk
    assert shape == StepShape(num_tokens=7, num_seqs=3, context_tokens=4 + 11 + 10, attention_pairs=(4 * 5 // 2) + 11 + (2 * 8 + 3))


def test_fit_recovers_known_parameters_with_floor():
    truth = CostModel(intercept_s=2e-3, per_token_s=5e-5, per_seq_s=3e-5, per_context_s=2e-7, per_pair_s=1e-9, floor_s=8e-3)
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(200):
        rows = [
            (int(rng.integers(0, 1500)), int(rng.choice([1, 1, 1, int(rng.integers(1, 700))])))
            for _ in range(int(rng.integers(1, 40)))
        ]
        shape = StepShape.of_rows(rows)
        samples.append(
            Measurement(shape.num_tokens, shape.num_seqs, shape.context_tokens, truth.latency(shape), shape.attention_pairs)
        )
    samples += [Measurement(n, 1, n, truth.latency(StepShape(n, 1, n)), 0) for n in (1, 2, 4, 8)]
    got = fit(samples)
    for field in ("intercept_s", "per_token_s", "per_seq_s", "per_context_s", "per_pair_s", "floor_s"):
        assert getattr(got, field) == pytest.approx(getattr(truth, field), rel=1e-6), field


def test_fit_plain_least_squares_from_tuples_and_noise():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 2048, 300)
    seconds = 4e-3 + 1e-4 * tokens + rng.normal(0, 1e-4, tokens.size)
    got = fit([(int(t), 1, int(t), float(s)) for t, s in zip(tokens, seconds)], terms=("tokens",), with_floor=False)
    assert got.intercept_s == pytest.approx(4e-3, rel=0.05)
    assert got.per_token_s == pytest.approx(1e-4, rel=0.01)
    assert got.per_seq_s == got.per_context_s == got.per_pair_s == got.floor_s == 0.0


def test_fit_rejects_too_few_samples_and_unknown_terms():
    with pytest.raises(ValueError):
        fit([(1, 1, 1, 0.1)])
    with pytest.raises(ValueError):
        fit([(1, 1, 1, 0.1)] * 10, terms=("tokens", "bogus"))


def test_scaled_multiplies_compute_and_keeps_launch_costs():
    base = CostModel(intercept_s=1e-3, per_token_s=1e-4, per_seq_s=2e-5, per_context_s=1e-7, per_pair_s=1e-9, floor_s=5e-3)
    big = base.scaled(8.0, gpus=4, floor_factor=2.0, comm_s=5e-4)
    assert big.per_token_s == pytest.approx(2e-4) and big.per_context_s == pytest.approx(2e-7)
    assert big.per_pair_s == pytest.approx(2e-9) and big.per_seq_s == base.per_seq_s
    assert big.intercept_s == pytest.approx(1.5e-3)
    assert big.floor_s == pytest.approx(1e-3 + 5e-4 + 4e-3 * 2.0)
    assert base.scaled(1.0).latency(StepShape(100, 2, 300)) == pytest.approx(base.latency(StepShape(100, 2, 300)))


def test_presets_are_monotone_in_tokens():
    assert set(PRESETS) >= {"cpu-tiny", "a100-7b", "a100-13b", "a100-70b-tp4"}
    for model in PRESETS.values():
        times = [model.latency(StepShape(n, 1, n, n * (n + 1) // 2)) for n in (1, 64, 512, 2048)]
        assert times[0] > 0 and times == sorted(times), model.name
    assert CPU_TINY.latency(StepShape(0, 0, 0)) == 0.0
    assert A100_7B.knee_tokens > 50  # below it a pass costs the weight read


# --- workloads --------------------------------------------------------------------------


def test_workloads_are_deterministic_and_have_their_lengths():
    cfg = WorkloadConfig(kind="fastgen-2600-60", num_requests=400, rate=2.0, seed=3)
    a, b = make_requests(cfg), make_requests(cfg)
    assert a == b and make_requests(WorkloadConfig(kind="fastgen-2600-60", num_requests=400, seed=4)) != a
    prompts = np.array([r.num_prompt_tokens for r in a])
    outputs = np.array([r.max_tokens for r in a])
    assert abs(prompts.mean() - 2600) < 100 and abs(prompts.std() / 2600 - 0.3) < 0.05
    assert abs(outputs.mean() - 60) < 4
    gaps = np.diff([0.0] + [r.arrival_time for r in a])
    assert (gaps >= 0).all() and abs(gaps.mean() - 0.5) < 0.08  # Poisson at 2 req/s
    assert len({r.prompt_token_ids[:16] for r in a}) == len(a)  # no accidental shared prefixes
    burst = make_requests(WorkloadConfig(kind="prefill-heavy", num_requests=50))
    assert all(r.arrival_time == 0.0 for r in burst)
    assert all(415 <= r.num_prompt_tokens <= 509 and 14 <= r.max_tokens <= 18 for r in burst)
    fixed = make_requests(WorkloadConfig(kind="fixed", num_requests=3, prompt_len=7, output_len=5))
    assert [(r.num_prompt_tokens, r.max_tokens) for r in fixed] == [(7, 5)] * 3
    with pytest.raises(ValueError):
        make_requests(WorkloadConfig(kind="nonsense"))


def test_sharegpt_prompts_follow_the_vllm_filter():
    reqs = make_requests(WorkloadConfig(path=SHAREGPT, num_requests=100, seed=0))
    assert len(reqs) == 100 and reqs == make_requests(WorkloadConfig(path=SHAREGPT, num_requests=100, seed=0))
    for r in reqs:
        assert 4 <= r.num_prompt_tokens <= 1024 and r.max_tokens >= 4
        assert r.num_prompt_tokens + r.max_tokens <= 2048
    # The tiny BPE splits finer than 4/3 tokens a word; with no length limits both keep the same conversations.
    unlimited = dict(path=SHAREGPT, num_requests=100, max_prompt_len=10**6, max_total_len=10**6)
    words = make_requests(WorkloadConfig(**unlimited, token_counts="whitespace"))
    tokens = make_requests(WorkloadConfig(**unlimited))
    assert np.mean([r.num_prompt_tokens for r in words]) < np.mean([r.num_prompt_tokens for r in tokens])


def test_sharegpt_tokenizer_is_the_tiny_models():
    from tokenizers import Tokenizer

    from conveyor.tiny.checkpoint import ensure_default_model

    path = str(ensure_default_model() / "tokenizer.json")
    default = make_requests(WorkloadConfig(path=SHAREGPT, num_requests=50))
    assert make_requests(WorkloadConfig(path=SHAREGPT, num_requests=50, tokenizer_path=path)) == default
    assert Tokenizer.from_file(path).get_vocab_size() > max(max(r.prompt_token_ids) for r in default)


# --- the event loop ---------------------------------------------------------------------


def test_one_request_alone_is_hand_checkable():
    # 100 prompt tokens in chunks of 32, 32, 32, 4, then 4 decodes: 5 tokens in all.
    late = 10.0
    result = simulate(
        [request(0, 100, 5), request(1, 100, 5, arrival=late)],
        SimConfig(SchedulerConfig(max_num_batched_tokens=32, enable_prefix_caching=False)),
        AFFINE,
    )
    prompt_steps = 4 * 1e-3 + 100 * 1e-4
    decode = 1e-3 + 1e-4
    for rec, start in zip(result.requests, (0.0, late)):  # the second finds an idle engine
        assert rec.ttft == pytest.approx(prompt_steps)
        assert np.diff(rec.token_times) == pytest.approx([decode] * 4)
        assert rec.finish == pytest.approx(start + prompt_steps + 4 * decode)
    m = compute(result)
    assert m.num_steps == 16 and m.duration_s == pytest.approx(late + prompt_steps + 4 * decode)
    assert m.ttft["p50"] == pytest.approx(prompt_steps) and m.token_latency["max"] == pytest.approx(decode)


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "orca"])
def test_every_request_finishes_with_all_its_tokens_even_when_preempted(policy):
    reqs = make_requests(WorkloadConfig(kind="random", num_requests=60, prompt_len=300, output_len=80, rate=50.0))
    config = SimConfig(
        SchedulerConfig(policy=policy, max_num_batched_tokens=256, enable_prefix_caching=False), CacheConfig(num_kv_blocks=120)
    )
    result = simulate(reqs, config, AFFINE)
    assert result.num_preemptions > 0  # the pool holds about 7 sequences at full length
    for req, rec in zip(reqs, result.requests):
        assert len(rec.token_times) == req.max_tokens
        assert rec.arrival <= rec.token_times[0] and rec.token_times == sorted(rec.token_times)
        assert rec.finish == rec.token_times[-1]
    steps = result.steps
    assert sum(s.shape.num_tokens for s in steps) >= sum(r.num_prompt_tokens + r.max_tokens - 1 for r in reqs)
    assert all(s.shape.num_tokens <= 256 and s.kv_filled <= s.kv_allocated for s in steps)


def test_same_seed_same_metrics():
    def run(seed):
        reqs = make_requests(WorkloadConfig(kind="normal", num_requests=80, prompt_len=400, output_len=40, rate=20.0, seed=seed))
        return compute(simulate(reqs, SimConfig(SchedulerConfig(max_num_batched_tokens=512)), A100_7B)).as_dict()

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_fast_kv_count_matches_the_schedulers():
    # Shared prefixes: requests reuse each other's cached blocks.
    stem = tuple(range(1, 65))
    reqs = [SimRequest(f"r{i}", stem + tuple(range(100 + i * 50, 100 + i * 50 + 10 + i)), 6, 0.01 * i) for i in range(12)]
    sched = build_scheduler(SimConfig(SchedulerConfig(max_num_batched_tokens=48), CacheConfig(block_size=16, num_kv_blocks=64)))
    from conveyor.sim.simulator import _schedule_request, fake_result

    for r in reqs:
        sched.add_request(_schedule_request(r))
    checked = 0
    while sched.has_work():
        step = sched.schedule()
        if step is None:
            break
        assert sched.kv_slots() == _kv_slots_block_by_block(sched)
        sched.update(step, fake_result(step))
        checked += 1
    assert checked > 10 and sched.blocks.num_cache_hits > 0


def test_fake_results_cover_forks():
    from conveyor.sim.simulator import fake_result
    from conveyor.wire.messages import SamplingParams, ScheduleRequest

    sched = build_scheduler(SimConfig(SchedulerConfig(max_num_batched_tokens=16)))
    params = SamplingParams(n=3, max_tokens=4, ignore_eos=True)
    sched.add_request(ScheduleRequest("fan", 0, list(range(1, 40)), params, 0.0))
    draws = 0
    while sched.has_work():
        step = sched.schedule()
        result = fake_result(step)
        draws += len(result.sampled_token_ids)
        sched.update(step, result)  # one id per sampling row and per fork, or it raises
    assert draws == 3 * 4


def test_closed_loop_keeps_the_client_count_in_flight():
    reqs = [request(i, 50, 10) for i in range(9)]
    result = simulate(reqs, SimConfig(SchedulerConfig(enable_prefix_caching=False), num_clients=3), AFFINE)
    arrivals = sorted(r.arrival for r in result.requests)
    assert arrivals[:3] == [0.0] * 3 and all(a > 0 for a in arrivals[3:])
    finishes = sorted(r.finish for r in result.requests)
    assert arrivals[3:] == pytest.approx(finishes[:6])  # each finish releases the next request


def test_too_long_requests_are_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([request(0, 100, 50)], SimConfig(max_model_len=120), AFFINE)


# --- metrics ----------------------------------------------------------------------------


def test_sla_checks_prompt_rate_and_the_ema_of_token_gaps():
    steady = RequestRecord("a", 0.0, 512, 5, token_times=[0.5 + 0.2 * i for i in range(5)], finish=1.3)
    assert meets_sla(steady, gen_tokens_per_s=4)  # gaps 0.2 s < 0.25 s
    assert not meets_sla(steady, gen_tokens_per_s=6)  # 0.2 s > 0.167 s
    slow_prompt = RequestRecord("b", 0.0, 256, 5, token_times=[0.6, 0.7], finish=0.7)
    assert not meets_sla(slow_prompt, gen_tokens_per_s=1)  # 256 tokens need TTFT <= 0.5 s
    # One stall of 1 s among 0.1 s gaps: EMA (span 16, adjusted) after it is
    # (1 + 0.1*a) / (1 + a) with a = 15/17, about 0.58 s: fails 2 tokens/s, passes 1.5.
    stall = RequestRecord("c", 0.0, 1024, 3, token_times=[0.1, 0.2, 1.2], finish=1.2)
    assert not meets_sla(stall, gen_tokens_per_s=2) and meets_sla(stall, gen_tokens_per_s=1.5)


def test_splitfuse_cuts_tail_token_latency_on_long_prompts():
    """FastGen's headline: with long prompts arriving under load, prefill-first stalls decodes for
    whole prompts while SplitFuse bounds every step by its budget."""
    reqs = make_requests(WorkloadConfig(kind="fastgen-2600-60", num_requests=60, rate=1.5, seed=0))
    by_policy = {
        policy: compute(simulate(reqs, SimConfig(SchedulerConfig(policy=policy, max_num_batched_tokens=budget)), A100_7B))
        for policy, budget in (("splitfuse", 512), ("prefill_first", 8192), ("orca", 8192))
    }
    split, first, orca = by_policy["splitfuse"], by_policy["prefill_first"], by_policy["orca"]
    assert split.token_latency["max"] < 0.2 * first.token_latency["max"]
    assert split.token_latency["p99"] < first.token_latency["p99"]
    assert split.token_latency["max"] < orca.token_latency["max"]
    assert split.effective_throughput[6.0] >= first.effective_throughput[6.0]
    assert split.request_throughput == pytest.approx(first.request_throughput, rel=0.05)


def test_cli_prints_one_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert cli.main((f"--workload sharegpt --path {SHAREGPT} --num-requests 40 --rate 4 --cost a100-7b --json {out}").split()) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("| metric"))
    assert all(p in header for p in ("splitfuse", "prefill_first", "orca"))
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"splitfuse", "prefill_first", "orca"}
    assert data["results"]["splitfuse"]["num_requests"] == 40 and math.isfinite(data["args"]["rate"])


def test_measure_times_the_real_runner():
    from conveyor.sim.measure import default_grid, measure

    grid = [[(0, 8)], [(0, 64)], [(32, 1)] * 3, [(16, 1)] * 2 + [(0, 30)]]
    samples = measure(grid, repeats=1, model="tiny")
    assert [(m.num_tokens, m.num_seqs, m.context_tokens) for m in samples] == [(8, 1, 8), (64, 1, 64), (3, 3, 99), (32, 3, 64)]
    assert all(0 < m.seconds < 5 for m in samples)
    assert all(s + n <= 2048 for rows in default_grid() for s, n in rows)


def test_a_request_the_pool_cannot_hold_is_reported():
    with pytest.raises(RuntimeError, match="ended before max_tokens"):
        simulate([request(0, 100, 50)], SimConfig(cache=CacheConfig(num_kv_blocks=4, block_size=16)), AFFINE)


def _kv_slots_block_by_block(sched) -> tuple[int, int]:
    """The plain count kv_slots() must agree with: every held block, shared ones once."""
    bs = sched.blocks.block_size
    filled: dict[int, int] = {}
    for seq in sched.running:
        for i, block in enumerate(seq.block_ids):
            filled[block] = max(filled.get(block, 0), min(bs, seq.num_computed_tokens - i * bs))
    return sched.blocks.num_used * bs, sum(filled.values())
