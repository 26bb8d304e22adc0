"""conveyor bench serve's shared system prompts (--num-system-prompts K, --system-prompt-len L)
and the server's prefix cache hit rate read from its /metrics: the prompts' lengths and
determinism on the tiny tokenizer, what reaches a fake server on both endpoints, and the hit
rate against the fake's own prefix cache."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json

import pytest

from conveyor import cli
from conveyor.bench.dataset import DatasetConfig, make_dataset
from conveyor.bench.prompts import special_tokens
from conveyor.bench.server_metrics import PrefixCacheCounts, hit_rate, prefix_cache_counts
from conveyor.bench.system_prompts import pick_system_prompts
from tests.ops.bench_fakes import SHAREGPT


def test_system_prompts_open_every_request_and_follow_the_seed(tiny_counter):
    config = DatasetConfig("random", 30, input_len=40, output_len=4, seed=5, num_system_prompts=3, system_prompt_len=64)
    shared = asyncio.run(make_dataset(config, tiny_counter))
    plain = asyncio.run(make_dataset(dataclasses.replace(config, num_system_prompts=0), tiny_counter))
    assert [r.prompt for r in shared] == [r.prompt for r in plain]  # the requests' own text is unchanged
    systems = sorted({r.system_prompt for r in shared})
    assert len(systems) == 3 and len({tuple(s.split()[:3]) for s in systems}) == 3  # no common opening
    overhead = asyncio.run(special_tokens(tiny_counter))
    assert all(abs(n - overhead - 64) <= 3 for n in asyncio.run(tiny_counter.count(systems)))
    assert all(r.text == f"{r.system_prompt}\n\n{r.prompt}" for r in shared)
    assert [r.prompt_len for r in shared] == asyncio.run(tiny_counter.count([r.text for r in shared]))
    assert asyncio.run(make_dataset(config, tiny_counter)) == shared
    other = asyncio.run(make_dataset(dataclasses.replace(config, seed=6), tiny_counter))
    assert not {r.system_prompt for r in other} & set(systems)


def test_sharegpt_prompts_get_system_prompts_too(tiny_counter):
    config = DatasetConfig("sharegpt", 20, path=SHAREGPT, seed=1, num_system_prompts=2, system_prompt_len=32)
    shared = asyncio.run(make_dataset(config, tiny_counter))
    plain = asyncio.run(make_dataset(dataclasses.replace(config, num_system_prompts=0), tiny_counter))
    assert [r.prompt for r in shared] == [r.prompt for r in plain]
    assert [r.output_len for r in shared] == [r.output_len for r in plain]
    assert len({r.system_prompt for r in shared}) == 2
    assert all(s.prompt_len > p.prompt_len + 25 for s, p in zip(shared, plain))


def test_picks_are_uniform_and_seeded():
    picks = pick_system_prompts(4000, 4, seed=1)
    assert picks == pick_system_prompts(4000, 4, seed=1) != pick_system_prompts(4000, 4, seed=2)
    assert all(900 <= n <= 1100 for n in collections.Counter(picks).values()) and set(picks) == {0, 1, 2, 3}


def test_serve_sends_shared_prompts_and_reports_the_hit_rate(server, tmp_path, capsys):
    out = tmp_path / "shared.json"
    rc = cli.main(
        (
            f"bench serve --base-url {server.url} --dataset random --input-len 10 "
            "--output-len 2 --num-prompts 12 --num-system-prompts 2 "
            f"--system-prompt-len 24 --disable-tqdm --result-json {out}"
        ).split()
    )
    assert rc == 0
    prompts = [body["prompt"] for body in server.bodies[1:]]  # after the test request
    systems = collections.Counter(p.split("\n\n")[0] for p in prompts)
    assert len(prompts) == 12 and len(systems) == 2
    assert all(len(s.split()) == 24 for s in systems)  # the fake counts a word a token, plus a BOS
    # The fake caches 8-word blocks: each request's 3 system-prompt blocks hit, but for the first
    # of each system prompt; its 4th block reaches into its own words and misses.
    point = json.loads(out.read_text())["points"][0]
    assert point["prefix_cache_hit_rate"] == pytest.approx((12 * 3 - 2 * 3) / (12 * 4))
    assert point["mean_input_len"] == 24 + 9 + 1
    stdout = capsys.readouterr().out
    row = next(line for line in stdout.splitlines() if line.startswith("| prefix cache hit rate (server)"))
    assert "2 shared system prompts of ~24 tokens" in stdout and row.split("|")[2].strip() == "62.5%"


def test_metrics_urls_add_up_replicas_and_all_must_answer(server, tmp_path):
    args = (
        f"bench serve --base-url {server.url} --input-len 10 --output-len 2 "
        "--num-prompts 12 --num-system-prompts 2 --system-prompt-len 24 "
        "--disable-tqdm"
    ).split()
    for metrics_url, expected in ((f"{server.url},{server.url}/", 0.625), (f"{server.url},http://127.0.0.1:9", None)):
        server.reset()
        out = tmp_path / "point.json"
        assert cli.main([*args, "--metrics-url", metrics_url, "--result-json", str(out)]) == 0
        point = json.loads(out.read_text())["points"][0]
        assert point["prefix_cache_hit_rate"] == (expected and pytest.approx(expected))


def test_chat_sends_the_system_prompt_as_a_system_message(server):
    rc = cli.main(
        (
            f"bench serve --base-url {server.url} --endpoint /v1/chat/completions "
            "--input-len 6 --output-len 2 --num-prompts 3 --num-system-prompts 1 "
            "--system-prompt-len 16 --disable-tqdm"
        ).split()
    )
    assert rc == 0
    messages = [body["messages"] for body in server.bodies[1:]]
    assert all([m["role"] for m in ms] == ["system", "user"] for ms in messages)
    assert len({ms[0]["content"] for ms in messages}) == 1 and all("\n\n" not in ms[1]["content"] for ms in messages)


def test_flags_refuse_bad_counts(capsys):
    for flags in (["--num-system-prompts", "-1"], ["--system-prompt-len", "0"], ["--num-system-prompts", "two"]):
        with pytest.raises(SystemExit):
            cli.main(["bench", "serve", *flags])
    assert "must be at least" in capsys.readouterr().err


def test_hit_rate_sums_labels_and_knows_when_it_cannot_tell():
    text = (
        "# TYPE conveyor_prefix_cache_queries counter\n"
        'conveyor_prefix_cache_queries_total{engine="0"} 30.0\nconveyor_prefix_cache_queries_total{engine="1"} 10.0\n'
        "# TYPE conveyor_prefix_cache_hits counter\n"
        'conveyor_prefix_cache_hits_total{engine="0"} 12.0\nconveyor_prefix_cache_hits_total{engine="1"} 2.0\n'
        "# TYPE conveyor_prefix_cache_hits_created gauge\n"
        'conveyor_prefix_cache_hits_created{engine="0"} 1.7e9\n'
    )
    after = prefix_cache_counts(text)
    assert after == PrefixCacheCounts(queries=40.0, hits=14.0)
    assert hit_rate(PrefixCacheCounts(20.0, 4.0), after) == pytest.approx(0.5)
    assert hit_rate(after, after) is None  # no lookups in between
    assert hit_rate(after, PrefixCacheCounts(1.0, 0.0)) is None  # the server restarted
    assert hit_rate(None, after) is None
    vllm = (
        "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 100.0\n"
        "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 25.0\n"
    )
    assert prefix_cache_counts(vllm) == PrefixCacheCounts(100.0, 25.0)
    assert prefix_cache_counts("<html>404</html>") is None and prefix_cache_counts("# TYPE x counter\nx_total 1\n") is None
