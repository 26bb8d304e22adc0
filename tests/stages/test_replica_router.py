"""conveyor router (stages/replica_router) in front of fake replicas, all on one event loop: shared
prefixes stay on one replica, distinct ones spread (one at a time and at once), a dead replica
is skipped and marked, none ready is a 503 and none reachable a 502, SSE streams pass through
byte for byte as they arrive, a client that leaves aborts the replica's request, /health and
/v1/models, replicas found by DNS joining and leaving. The routing keys and the flags on their
own."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from conveyor import cli
from conveyor.stages.replica_router.config import RouterConfig, parse_backends
from conveyor.stages.replica_router.discovery import base_url, parse_dns_name, resolve
from conveyor.stages.replica_router.prompt import prompt_hashes, routing_key
from conveyor.stages.replica_router.proxy import MAX_BODY_BYTES, PROXY, REPLICA_HEADER, make_app

GAP_S = 0.05  # between a fake replica's stream events


class FakeReplica:
    """A conveyor-shaped server: /health (200 unless `healthy` is off), /v1/models, and
    completions that stream NUM_EVENTS events GAP_S apart (or answer one JSON body). While
    `hold` is set a completion waits for `release` first, so requests stay in flight."""

    NUM_EVENTS = 4

    def __init__(self, name: str):
        self.name = name
        self.healthy = True
        self.prompts: list[str] = []
        self.headers: list = []
        self.num_aborted = 0
        self.hold = False
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        self.runner = web.AppRunner(app, handler_cancellation=True)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, status=200 if self.healthy else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-{self.name}", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"] if "prompt" in body else body["messages"][-1]["content"])
        self.headers.append(request.headers.copy())  # case-insensitive
        if self.hold:
            await self.release.wait()
        if not body.get("stream"):
            return web.json_response({"replica": self.name, "choices": [{"text": "done"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Fake": self.name})
        await resp.prepare(request)
        try:
            for i in range(self.NUM_EVENTS):
                await resp.write(event(self.name, i))
                await asyncio.sleep(GAP_S)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.num_aborted += 1
            raise
        return resp


def event(name: str, i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": f"{name}-{i}"}]}).encode() + b"\n\n"


class Cluster:
    """Fake replicas and a router in front of them, started and stopped around a test body."""

    def __init__(self, num_replicas: int, *, dns: bool = False, **settings):
        self.replicas = [FakeReplica(str(i)) for i in range(num_replicas)]
        self.settings = {"health_interval": 0.2, "connect_timeout": 1.0, **settings}
        self.dns = dns
        self.found: list[str] | None = []  # what the fake DNS answers (None: the lookup fails)

    async def resolve(self, name: str) -> list[str] | None:
        assert name == "replicas.test:8000"
        return None if self.found is None else list(self.found)

    async def __aenter__(self) -> Cluster:
        urls = [await r.start() for r in self.replicas]
        if self.dns:
            config = RouterConfig(backends_dns="replicas.test:8000", **self.settings)
        else:
            config = RouterConfig(backends=tuple(urls), **self.settings)
        self.app = make_app(config, resolve=self.resolve)
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        await self.runner.cleanup()
        for r in self.replicas:
            await r.stop()

    async def complete(self, prompt: str, **extra) -> tuple[int, dict, bytes]:
        async with self.session.post(self.url + "/v1/completions", json={"prompt": prompt, **extra}) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    def counts(self) -> list[int]:
        return [len(r.prompts) for r in self.replicas]

    async def ready_urls(self, expected: list[str]) -> dict:
        """The router's /health once the replicas it calls ready are `expected` (health checks
        run every 0.2 s; a busy machine may need a few rounds)."""
        health: dict = {}
        for _ in range(100):
            async with self.session.get(self.url + "/health") as resp:
                health = await resp.json()
            if sorted(r["url"] for r in health["replicas"] if r["ready"]) == sorted(expected):
                return health
            await asyncio.sleep(0.05)
        raise AssertionError(f"ready: {health}, expected {expected}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


SYSTEMS = [f"system prompt {k}: " + " ".join(f"rule{k}-{j}" for j in range(80)) for k in range(4)]


def test_shared_prefixes_stay_together_and_distinct_ones_spread():
    async def body():
        async with Cluster(3) as c:
            for k, system in enumerate(SYSTEMS):  # each opening first arrives alone, then recurs
                for j in range(5):
                    status, headers, _ = await c.complete(f"{system}\nquestion {j} about {k}")
                    assert status == 200
            by_system = [{r.name for r in c.replicas for p in r.prompts if p.startswith(s)} for s in SYSTEMS]
            assert all(len(names) == 1 for names in by_system)  # each opening on one replica
            assert len({n for names in by_system for n in names}) == 3  # four openings over all three
            assert sorted(c.counts()) == [5, 5, 10]

            for r in c.replicas:
                r.prompts.clear()
                r.hold = True
            pending = [asyncio.create_task(c.complete(f"fresh prompt {i} " + "x" * 300)) for i in range(6)]
            while sum(c.counts()) < 6:
                await asyncio.sleep(0.01)
            assert c.counts() == [2, 2, 2]  # at once, distinct prompts go by load
            for r in c.replicas:
                r.release.set()
            assert all(status == 200 for status, _, _ in await asyncio.gather(*pending))

    run(body())


def test_a_busy_replica_loses_its_prefix_to_the_idlest():
    async def body():
        async with Cluster(2, balance_abs_threshold=2, balance_rel_threshold=1.5) as c:
            c.replicas[0].hold = c.replicas[1].hold = True
            pending = [asyncio.create_task(c.complete(f"{SYSTEMS[0]}\nq{i}")) for i in range(8)]
            while sum(c.counts()) < 8:
                await asyncio.sleep(0.01)
            counts = c.counts()
            for r in c.replicas:
                r.release.set()
            await asyncio.gather(*pending)
            # Affinity until replica 0 holds 3 more than replica 1 (and 1.5x), then the idlest;
            # from then on both hold the prefix, and the less loaded of the two wins each tie.
            assert c.replicas[0].prompts[:3] == [f"{SYSTEMS[0]}\nq{i}" for i in range(3)] and counts == [4, 4]

    run(body())


def test_streams_pass_through_unchanged_and_as_they_arrive():
    async def body():
        async with Cluster(1) as c:
            headers = {"Authorization": "Bearer secret", "X-Request-Id": "abc"}
            payload = {"prompt": "hello", "stream": True}
            async with c.session.post(c.url + "/v1/completions", json=payload, headers=headers) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
                assert resp.headers["X-Fake"] == "0" and resp.headers[REPLICA_HEADER] == "0"
                start, arrivals, data = time.perf_counter(), [], b""
                async for chunk in resp.content.iter_any():
                    arrivals.append(time.perf_counter() - start)
                    data += chunk
            assert data == b"".join(event("0", i) for i in range(FakeReplica.NUM_EVENTS)) + b"data: [DONE]\n\n"
            assert arrivals[0] < GAP_S * (FakeReplica.NUM_EVENTS - 1) <= arrivals[-1]  # not buffered
            sent = c.replicas[0].headers[0]
            assert sent["Authorization"] == "Bearer secret" and sent["X-Request-Id"] == "abc"

            async with c.session.post(c.url + "/v1/completions", data=b"x" * (MAX_BODY_BYTES + 1)) as resp:
                assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
            status, _, raw = await c.complete("not streamed")
            assert status == 200 and json.loads(raw) == {"replica": "0", "choices": [{"text": "done"}]}
            async with c.session.get(c.url + "/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "model-0"

    run(body())


def test_a_client_that_leaves_aborts_the_replicas_request():
    async def body():
        async with Cluster(1) as c:
            async with c.session.post(c.url + "/v1/completions", json={"prompt": "p", "stream": True}) as resp:
                await resp.content.readany()  # the first event, then hang up
            for _ in range(100):
                if c.replicas[0].num_aborted:
                    break
                await asyncio.sleep(0.02)
            assert c.replicas[0].num_aborted == 1
            await asyncio.sleep(0.05)
            assert c.app[PROXY].replicas[0].num_in_flight == 0

    run(body())


def test_dead_replicas_are_skipped_then_errors_are_clear():
    async def body():
        async with Cluster(3) as c:
            proxy = c.app[PROXY]
            c.replicas[1].healthy = False  # loading: /health 503
            health = await c.ready_urls([c.replicas[0].url, c.replicas[2].url])
            assert health["num_ready"] == 2 and [r["ready"] for r in health["replicas"]] == [True, False, True]
            for i in range(6):
                assert (await c.complete(f"prompt {i} " + "y" * 200))[0] == 200
            assert c.counts()[1] == 0 and c.counts()[0] > 0 and c.counts()[2] > 0

            await c.replicas[0].stop()  # dies between health checks: the next request finds out
            before = c.counts()[2]
            for i in range(3):
                assert (await c.complete(f"prompt {i} " + "y" * 200))[0] == 200
            assert c.counts()[2] == before + 3 and not proxy.replicas[0].ready and proxy.replicas[0].num_failures == 1

            await c.replicas[2].stop()  # the last ready one, marked only when a request fails on it
            status, _, raw = await c.complete("anything")
            assert status == 502 and json.loads(raw)["error"]["code"] == "no_replica_answered"
            status, headers, raw = await c.complete("anything")
            assert status == 503 and json.loads(raw)["error"]["code"] == "no_replica_ready" and "Retry-After" in headers
            async with c.session.get(c.url + "/health") as resp:
                assert resp.status == 503 and (await resp.json())["num_ready"] == 0
            async with c.session.get(c.url + "/metrics") as resp:
                text = await resp.text()
            assert f'conveyor_replica_router_ready{{replica="{c.replicas[1].url}"}} 0.0' in text
            assert "conveyor_replica_router_failures_total" in text and 'reason="affinity"' in text

    run(body())


def test_a_replica_back_from_a_restart_is_forgotten():
    async def body():
        async with Cluster(2) as c:
            replicas = c.app[PROXY].replicas
            assert (await c.complete(SYSTEMS[0] + " a"))[1][REPLICA_HEADER] == "0"
            assert (await c.complete(SYSTEMS[1] + " a"))[1][REPLICA_HEADER] == "1"
            c.replicas[0].healthy = False
            await c.ready_urls([c.replicas[1].url])
            assert (await c.complete(SYSTEMS[0] + " b"))[1][REPLICA_HEADER] == "1"  # the only ready one
            c.replicas[0].healthy = True
            await c.ready_urls([r.url for r in c.replicas])
            assert replicas[0].ready and replicas.policy.num_mapped_blocks(0) == 0
            # Replica 1 now holds both openings; the restarted one gets the next new one.
            assert (await c.complete(SYSTEMS[0] + " c"))[1][REPLICA_HEADER] == "1"
            assert (await c.complete(SYSTEMS[2] + " c"))[1][REPLICA_HEADER] == "0"

    run(body())


def test_replicas_found_by_dns_come_and_go():
    async def body():
        async with Cluster(3, dns=True, max_replicas=2) as c:
            r0, r1, r2 = (r.url for r in c.replicas)

            async with c.session.get(c.url + "/health") as resp:
                assert resp.status == 503  # DNS names none yet
            c.found = [r0]
            await c.ready_urls([r0])
            c.found = [r0, r1]
            await c.ready_urls([r0, r1])
            for i in range(4):
                assert (await c.complete(f"prompt {i} " + "z" * 200))[0] == 200
            assert c.counts()[:2] == [2, 2]

            c.found = None  # a failed lookup keeps them
            await asyncio.sleep(0.5)
            await c.ready_urls([r0, r1])
            c.found = [r1, r2]  # r0 left; r2 takes its slot (two at most)
            health = await c.ready_urls([r1, r2])
            assert len(health["replicas"]) == 2
            for i in range(4):
                assert (await c.complete(f"later {i} " + "z" * 200))[0] == 200
            assert c.counts()[0] == 2 and c.counts()[2] >= 2 and sum(c.counts()) == 8  # none to r0 since it left
            async with c.session.get(c.url + "/metrics") as resp:
                text = await resp.text()
            assert f'conveyor_replica_router_ready{{replica="{r2}"}} 1.0' in text
            assert f'conveyor_replica_router_ready{{replica="{r0}"}}' not in text

    run(body())


def test_dns_names():
    assert parse_dns_name("conveyor:8000") == "conveyor:8000"
    for bad in ("conveyor", ":8000", "conveyor:http", "conveyor:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_dns_name(bad)
    assert "http://127.0.0.1:8000" in asyncio.run(resolve("localhost:8000")) and base_url("::1", 80) == "http://[::1]:80"
    assert asyncio.run(resolve("no-such-host.invalid:80")) is None
    with pytest.raises(SystemExit):  # one way to name the replicas, not both
        cli.main(["router", "--backends", "http://a:1", "--backends-dns", "a:1"])


def test_routing_keys():
    system = {"role": "system", "content": "You are terse. " * 10}
    a = {"messages": [system, {"role": "user", "content": "first question"}]}
    b = {"messages": [system, {"role": "user", "content": [{"type": "text", "text": "second question"}]}]}
    ha, hb = (prompt_hashes("/v1/chat/completions", json.dumps(x).encode(), 16) for x in (a, b))
    shared = len("<system>" + system["content"] + "\n") // 16
    assert ha[:shared] == hb[:shared] and ha[shared:] != hb[shared:]
    assert routing_key({"prompt": ["first", "second"]}) == "first" and routing_key({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_hashes("/v1/completions", b"not json", 4) == [] and prompt_hashes("/tokenize", b'{"prompt": "abcdefgh"}', 4) == []
    assert len(prompt_hashes("/v1/completions", b'{"prompt": "abcdefghij"}', 4)) == 2  # a partial chunk is not hashed


def test_an_image_part_keys_the_chat_where_it_stands():
    """Two pictures after one long text part share the text's chunks and part ways at the image;
    the same picture again keys the same."""

    def chat(url: str) -> bytes:
        parts = [{"type": "text", "text": "Describe this. " * 8}, {"type": "image_url", "image_url": {"url": url}}]
        return json.dumps({"messages": [{"role": "user", "content": parts}]}).encode()

    cat, dog = (prompt_hashes("/v1/chat/completions", chat(f"data:image/png;base64,{x}"), 16) for x in ("Y2F0", "ZG9n"))
    shared = len("<user>" + "Describe this. " * 8) // 16
    assert cat[:shared] == dog[:shared] and cat[shared:] != dog[shared:] and len(cat) > shared
    assert prompt_hashes("/v1/chat/completions", chat("data:image/png;base64,Y2F0"), 16) == cat


def test_flags(capsys):
    assert parse_backends("http://a:8000/, https://b") == ("http://a:8000", "https://b")
    for bad in ("", "a:8000", "ftp://a", "http://a,http://a"):
        with pytest.raises(Exception, match="URL|backend"):
            parse_backends(bad)
    with pytest.raises(SystemExit):
        cli.main(["router", "--port", "1"])  # --backends is required
    assert "--backends" in capsys.readouterr().err
    assert cli.main(["router", "--backends", "http://a", "--chunk-chars", "0"]) == 2  # bounds, before serving
    assert "--chunk-chars must be at least 1" in capsys.readouterr().err


def test_policies_by_name():
    async def body():
        async with Cluster(2, routing_policy="round_robin") as c:
            for _ in range(4):
                await c.complete(SYSTEMS[0])
            assert c.counts() == [2, 2]  # the same prompt, in turn

    run(body())
    assert Counter(RouterConfig().routing_settings.__dict__) == Counter(
        {"cache_threshold": 0.5, "balance_abs_threshold": 32, "balance_rel_threshold": 1.5}
    )
