"""conveyor bench: the HTTP client against a fake OpenAI server, the metrics on a hand-made
schedule, the datasets' lengths, a two-point sweep's JSON and figures, and bench offline."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from conveyor import cli
from conveyor.bench import client, load
from conveyor.bench.client import RequestResult
from conveyor.bench.dataset import BenchRequest, DatasetConfig, make_dataset
from conveyor.bench.prompts import FileCounter, ServerCounter, WordCounter, choose_counter
from conveyor.bench.results import compute

SHAREGPT = "/work/shared/workloads/sharegpt_sample.json"


class FakeServer:
    """An OpenAI-compatible server on its own thread and event loop. Its tokenizer counts words
    plus a BOS; a completion waits TTFT_S, then streams one token per chunk GAP_S apart (with
    token_ids), then a usage chunk and [DONE]. A prompt containing FAIL gets a 500. Its prefix
    cache holds blocks of BLOCK_WORDS words of a completion's prompt (all of a chat's messages),
    each keyed by the words up to its end, and /metrics counts lookups and hits as conveyor's
    counters, split over two engine labels by arrival."""

    TTFT_S = 0.05
    GAP_S = 0.01
    BLOCK_WORDS = 8

    def __init__(self):
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.cached: set[tuple[str, ...]] = set()
        self.cache_counts = {"queries": [0, 0], "hits": [0, 0]}  # per engine label
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app)
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.SockSite(self.runner, self.sock).start())
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def reset(self) -> None:
        self.bodies.clear()
        self.max_in_flight = 0
        self.cached.clear()

    @staticmethod
    def count(text: str) -> int:
        return len(text.split()) + 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        n = self.count((await request.json())["prompt"])
        return web.json_response({"tokens": list(range(n)), "count": n, "max_model_len": 4096})

    def look_up(self, text: str, engine: int) -> None:
        words = tuple(text.split())
        for end in range(self.BLOCK_WORDS, len(words) + 1, self.BLOCK_WORDS):
            self.cache_counts["queries"][engine] += 1
            self.cache_counts["hits"][engine] += words[:end] in self.cached
            self.cached.add(words[:end])

    async def metrics(self, request: web.Request) -> web.Response:
        lines = []
        for name, counts in self.cache_counts.items():
            lines.append(f"# TYPE conveyor_prefix_cache_{name} counter")
            lines += [f'conveyor_prefix_cache_{name}_total{{engine="{e}"}} {n}.0' for e, n in enumerate(counts)]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self.look_up(" ".join(m["content"] for m in body["messages"]) if chat else prompt, len(self.bodies) % 2)
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(self.TTFT_S)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(self.GAP_S)
                choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
                await resp.write(_sse({"choices": [{**choice, "token_ids": [i]}]}))
            usage = {"prompt_tokens": self.count(prompt), "completion_tokens": body["max_tokens"]}
            await resp.write(_sse({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def server(fake):
    fake.reset()
    return fake


@pytest.fixture(scope="module")
def tiny_counter():
    from conveyor.tiny.checkpoint import ensure_default_model

    return FileCounter(ensure_default_model() / "tokenizer.json")


# --- the client on the fake server -----------------------------------------------------------


def test_client_times_a_stream_and_counts_by_usage(server):
    requests = [BenchRequest("one two three", 4, 5), BenchRequest("a b c d e FAIL", 7, 5)]

    async def run():
        async with aiohttp.ClientSession() as session:
            out = []
            for r in requests:
                body = client.payload(r, "fake-model", chat=False, ignore_eos=True, return_token_ids=True)
                out.append(await client.send(session, server.url + "/v1/completions", r, body))
            return out

    ok, failed = asyncio.run(run())
    sent = server.bodies[0]
    assert sent["max_tokens"] == 5 and sent["ignore_eos"] is True and sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True} and sent["temperature"] == 0.0
    assert ok.success and ok.prompt_len == 4 and ok.output_len == 5
    assert ok.chunk_tokens == [1] * 5 and len(ok.token_times()) == 5
    assert ok.ttft >= FakeServer.TTFT_S  # the server waits that long before the first chunk
    assert FakeServer.TTFT_S + 4 * FakeServer.GAP_S <= ok.e2e < 5.0
    assert len(ok.itl) == 4 and ok.tpot == pytest.approx((ok.chunk_times[-1] - ok.chunk_times[0]) / 4)
    assert not failed.success and failed.error.startswith("HTTP 500")

    metrics = compute([ok, failed], 1.0, label="x")
    assert metrics.num_completed == 1 and metrics.num_failed == 1
    assert metrics.output_throughput == 5.0 and metrics.input_throughput == 4.0
    assert list(metrics.errors.values()) == [1]


def test_chat_endpoint_reads_deltas(server):
    r = BenchRequest("hello there", 3, 3)

    async def run():
        async with aiohttp.ClientSession() as session:
            body = client.payload(r, "fake-model", chat=True, ignore_eos=False, return_token_ids=False)
            return await client.send(session, server.url + "/v1/chat/completions", r, body)

    result = asyncio.run(run())
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]
    assert "ignore_eos" not in server.bodies[0]
    assert result.success and result.output_len == 3 and len(result.chunk_times) == 3


def test_token_times_spread_usage_over_chunks_without_token_ids():
    r = RequestResult(prompt_len=4, output_len=7, start=0.0, end=1.0, chunk_times=[0.1, 0.2, 0.3],
                      chunk_tokens=[1, 1, 1])  # fmt: skip
    assert r.token_times() == [0.1, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3]


# --- metrics on a known schedule -------------------------------------------------------------


def _result(ttft: float, gaps: list[float], prompt_len: int = 100, start: float = 0.0) -> RequestResult:
    times = list(start + ttft + np.concatenate([[0.0], np.cumsum(gaps)]))
    return RequestResult(prompt_len, len(times), start, end=times[-1] + 0.001, chunk_times=times,
                         chunk_tokens=[1] * len(times))  # fmt: skip


def test_metrics_on_a_hand_made_schedule():
    results = [
        _result(0.1, [0.01, 0.01, 0.01]),
        _result(0.2, [0.02, 0.02, 0.02]),
        _result(0.3, [0.03, 0.03, 0.03]),
        _result(0.4, [0.6, 0.6, 0.6], prompt_len=512),  # generation at 1.7 tokens/s misses every SLA
        RequestResult(50, 0, 0.0, end=0.5, error="HTTP 500: boom"),
    ]
    m = compute(results, 10.0, label="known", num_clients=4)
    assert m.num_completed == 4 and m.num_failed == 1 and m.errors == {"HTTP 500: boom": 1}
    assert m.request_throughput == pytest.approx(0.4)
    assert m.input_throughput == pytest.approx((3 * 100 + 512) / 10)
    assert m.output_throughput == pytest.approx(16 / 10)
    assert m.ttft["mean"] == pytest.approx(0.25) and m.ttft["p50"] == pytest.approx(0.25)
    assert m.ttft["p90"] == pytest.approx(0.37)  # linear interpolation between 0.3 and 0.4
    gaps = [0.01] * 3 + [0.02] * 3 + [0.03] * 3 + [0.6] * 3
    assert m.itl["mean"] == pytest.approx(np.mean(gaps)) and m.itl["p50"] == pytest.approx(0.025)
    assert m.itl["p99"] == pytest.approx(0.6)
    assert m.tpot["p50"] == pytest.approx(0.025)
    assert m.e2e["mean"] == pytest.approx(np.mean([0.131, 0.261, 0.391, 2.201]))
    # TTFT within prompt / 512 tokens/s: 100 tokens allow 0.195 s, so the first request alone
    # meets it among the 100-token ones; the 512-token one fails on its generation rate.
    assert m.effective_throughput == {2.0: pytest.approx(0.1), 4.0: pytest.approx(0.1), 6.0: pytest.approx(0.1)}
    as_json = json.loads(json.dumps(m.as_dict()))
    assert as_json["effective_throughput"]["4"] == pytest.approx(0.1)


# --- datasets --------------------------------------------------------------------------------


def test_synthetic_prompts_hit_their_lengths(tiny_counter):
    random = asyncio.run(make_dataset(DatasetConfig("random", 20, input_len=300, output_len=40), tiny_counter))
    assert len(random) == 20 and all(r.output_len == 40 for r in random)
    assert all(abs(r.prompt_len - 300) <= 3 for r in random)
    counted = asyncio.run(tiny_counter.count([r.prompt for r in random]))
    assert counted == [r.prompt_len for r in random]  # the stated length is the counted one
    assert len({tuple(r.prompt.split()[:3]) for r in random}) == 20  # no two share an opening

    heavy = asyncio.run(make_dataset(DatasetConfig("decode-heavy", 30), tiny_counter))
    assert all(0.9 * 462 - 3 <= r.prompt_len <= 1.1 * 462 + 3 and 230 <= r.output_len <= 282 for r in heavy)

    fastgen = asyncio.run(make_dataset(DatasetConfig("fastgen-1200-60", 200), tiny_counter))
    prompts = np.array([r.prompt_len for r in fastgen])
    outputs = np.array([r.output_len for r in fastgen])
    assert abs(prompts.mean() - 1200) < 60 and 0.2 < prompts.std() / prompts.mean() < 0.4
    assert abs(outputs.mean() - 60) < 5


def test_prompts_follow_the_servers_tokenizer(server):
    async def run():
        async with aiohttp.ClientSession() as session:
            counter = await choose_counter(session, server.url, "fake-model")
            assert isinstance(counter, ServerCounter)
            return await make_dataset(DatasetConfig("random", 5, input_len=50, output_len=8), counter)

    requests = asyncio.run(run())
    assert [r.prompt_len for r in requests] == [50] * 5
    assert all(FakeServer.count(r.prompt) == 50 for r in requests)


def test_counter_falls_back_without_tokenize():
    async def run(tokenizer):
        async with aiohttp.ClientSession() as session:
            return await choose_counter(session, "http://127.0.0.1:9", "m", tokenizer)  # nothing listens

    from conveyor.tiny.checkpoint import ensure_default_model

    assert isinstance(asyncio.run(run(None)), WordCounter)
    assert isinstance(asyncio.run(run(str(ensure_default_model() / "tokenizer.json"))), FileCounter)


def test_sharegpt_follows_the_vllm_filter(tiny_counter):
    requests = asyncio.run(make_dataset(DatasetConfig("sharegpt", 50, path=SHAREGPT, seed=1), tiny_counter))
    assert len(requests) == 50 and len({r.prompt for r in requests}) == 50
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048
               for r in requests)  # fmt: skip
    with pytest.raises(ValueError, match="dataset-path"):
        asyncio.run(make_dataset(DatasetConfig("sharegpt", 5), tiny_counter))


# --- load ------------------------------------------------------------------------------------


def _send_to(server: FakeServer, session: aiohttp.ClientSession):
    async def send(r: BenchRequest) -> RequestResult:
        body = client.payload(r, "fake-model", chat=False, ignore_eos=True, return_token_ids=True)
        return await client.send(session, server.url + "/v1/completions", r, body)

    return send


def test_open_loop_respects_max_concurrency_and_closed_loop_keeps_n_in_flight(server):
    requests = [BenchRequest(f"p{i} x", 3, 3) for i in range(8)]

    async def run(**kw):
        async with aiohttp.ClientSession() as session:
            if "num_clients" in kw:
                return await load.closed_loop(requests, _send_to(server, session), **kw)
            return await load.open_loop(requests, _send_to(server, session), **kw)

    results, duration = asyncio.run(run(rate=math.inf, max_concurrency=2))
    assert len(results) == 8 and all(r.success for r in results) and server.max_in_flight == 2
    server.reset()
    results, _ = asyncio.run(run(num_clients=3))
    assert len(results) == 8 and server.max_in_flight == 3
    server.reset()
    results, duration = asyncio.run(run(rate=40.0, seed=3))
    offsets = np.cumsum(np.random.default_rng(3).exponential(1 / 40.0, 8))
    assert duration >= offsets[-1]  # the last request was not sent before its arrival time


# --- the CLI ---------------------------------------------------------------------------------


def test_sweep_writes_json_and_figures(server, tmp_path, capsys):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    rc = cli.main([
        "bench", "serve", "--base-url", server.url, "--dataset", "random", "--input-len", "20",
        "--output-len", "3", "--num-prompts", "4", "--sweep-clients", "1,2", "--disable-tqdm",
        "--result-json", str(out), "--plot-dir", str(plots),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["model"] == "fake-model" and report["counter"] == "server /tokenize"
    assert [p["num_clients"] for p in report["points"]] == [1, 2]
    assert all(p["num_completed"] == 4 and p["num_failed"] == 0 for p in report["points"])
    assert all(p["mean_input_len"] == 20 and p["mean_output_len"] == 3 for p in report["points"])
    assert set(report["points"][0]["effective_throughput"]) == {"2", "4", "6"}
    for name in ("throughput_latency.png", "effective_throughput.png", "token_latency.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(server.bodies) == 1 + 8  # the test request, then 4 per point
    table = capsys.readouterr().out
    assert "| 1 client" in table and "2 clients |" in table and "effective req/s (gen 4 tok/s)" in table


def test_extra_body_reaches_every_request(server, capsys):
    extra = {"response_format": {"type": "json_object"}, "temperature": 0.5}
    rc = cli.main([
        "bench", "serve", "--base-url", server.url, "--dataset", "random", "--input-len", "8",
        "--output-len", "2", "--num-prompts", "3", "--disable-tqdm", "--extra-body", json.dumps(extra),
    ])  # fmt: skip
    assert rc == 0 and len(server.bodies) == 1 + 3
    assert all(body["response_format"] == {"type": "json_object"} and body["temperature"] == 0.5 for body in server.bodies)
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--extra-body", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_serve_reports_an_unreachable_server(capsys):
    rc = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 1 and "error" in capsys.readouterr().err


def test_offline_reports_both_engines(tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = cli.main([
        "bench", "offline", "--dataset", "random", "--input-len", "16", "--output-len", "4", "--num-prompts", "4",
        "--device", "cpu", "--hf-batch-size", "2", "--num-kv-blocks", "64", "--result-json", str(out),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    ours, hf = report["results"]
    assert ours["engine"] == "conveyor" and hf["engine"].startswith("transformers")
    assert ours["num_output_tokens"] == hf["num_output_tokens"] == 16
    assert ours["output_throughput"] > 0 and hf["output_throughput"] > 0
    assert report["ratio"] == pytest.approx(ours["output_throughput"] / hf["output_throughput"])
    assert "conveyor / transformers:" in capsys.readouterr().out


def test_step_times_input_preparation():
    from conveyor.bench import scheduler_cost

    r = scheduler_cost.measure_prepare(scheduler_cost.prepare_runner("cpu"), 8, repeats=10)
    assert r["running"] == 8 and 0 < r["median_ms"] <= r["p90_ms"]


def test_forward_times_each_variant_on_each_shape(capsys):
    from conveyor.bench import forward

    if not forward_kernels_available():
        pytest.skip("no C++ compiler for the CPU kernels")
    shapes = [("decode", 3, 20), ("prefill", 2, 9)]
    results = forward.measure(shapes, rounds=2, repeats=2)
    assert set(results) == {(*s, v) for s in shapes for v in forward.VARIANTS}
    assert all(seconds > 0 for seconds in results.values())
    rc = cli.main(["bench", "forward", "--decode", "2x8", "--prefill", "1x5", "--rounds", "1", "--repeats", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode 2x8" in out and "prefill 1x5" in out


def test_forward_rejects_a_bad_shape(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "forward", "--decode", "256by500"])
    assert "ROWSxLENGTH" in capsys.readouterr().err


def forward_kernels_available() -> bool:
    from conveyor.gpu.backends.cpu.kernels import cpu_fused_ops, paged_attention_kernel

    return paged_attention_kernel() is not None and cpu_fused_ops() is not None
