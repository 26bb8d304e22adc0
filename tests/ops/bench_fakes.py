"""What conveyor bench's tests run against: FakeServer, an OpenAI-compatible server with a
tokenizer, a prefix cache and /metrics of its own, and SHAREGPT, the shared sample of ShareGPT
conversations. The fixtures that start the server are in this folder's conftest.py."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from aiohttp import web

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
        prompt = _text(body["messages"][-1]["content"]) if chat else body["prompt"]
        self.look_up(" ".join(_text(m["content"]) for m in body["messages"]) if chat else prompt, len(self.bodies) % 2)
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


def _text(content: str | list[dict]) -> str:
    """A chat message's text: the string, or its text parts (image parts count no words)."""
    return content if isinstance(content, str) else " ".join(part["text"] for part in content if part["type"] == "text")


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"
