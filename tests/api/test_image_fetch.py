"""http(s) image URLs, fetched by the real ingress from a local aiohttp server (ImageHost): the
bytes reach the tokenizer as served, a request's images are fetched at once, and each failure is
a 400 naming the part and the host: too large (by its Content-Length, or past the cap while
streaming), too slow, a 404, a closed port, a host not in --allowed-media-domains (also at the end
of a redirect). With no host list, a name that resolves to a loopback address is not fetched."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from conveyor.config import MediaConfig
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.media.fetch import ImageFetcher
from conveyor.stages.ingress.media.urls import ImageUrl
from conveyor.wire.images import ImageData
from tests.ingress_server import assert_error, free_port, post, running_server

CAT = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
MAX_BYTES = 4096
TIMEOUT_S = 0.5


class ImageHost(threading.Thread):
    """An aiohttp server on 127.0.0.1 in a thread of its own, serving the routes below."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="image-host")
        self.port = free_port()
        self.ready = threading.Event()
        self.num_barrier = 0

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self.both_arrived = asyncio.Event()
        app = web.Application()
        app.router.add_get("/cat.png", answer(CAT))
        app.router.add_get("/big.png", answer(b"x" * (MAX_BYTES + 1)))
        app.router.add_get("/stream.png", self.endless)
        app.router.add_get("/slow.png", self.slow)
        app.router.add_get("/barrier/{i}.png", self.barrier)
        app.router.add_get("/empty.png", answer(b""))
        app.router.add_get("/to-cat", redirect("/cat.png"))
        app.router.add_get("/to-localhost", redirect(self.url("/cat.png", "localhost")))
        runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.ready.set()
        await self.stopping.wait()
        await runner.cleanup()

    async def endless(self, request: web.Request) -> web.StreamResponse:
        """No Content-Length: chunks until the client stops reading."""
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(10_000):
            await response.write(b"y" * 1024)
        return response

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(4 * TIMEOUT_S)
        return web.Response(body=CAT)

    async def barrier(self, request: web.Request) -> web.Response:
        """Answers once two requests are waiting here: fetched one after the other, the first
        would wait past the fetch timeout."""
        self.num_barrier += 1
        if self.num_barrier % 2 == 0:
            self.both_arrived.set()
        await asyncio.wait_for(self.both_arrived.wait(), 4 * TIMEOUT_S)
        return web.Response(body=CAT + request.match_info["i"].encode())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.join(5)


def answer(body: bytes):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="image/png")

    return handler


def redirect(location: str):
    async def handler(request: web.Request) -> web.Response:
        raise web.HTTPFound(location)

    return handler


@pytest.fixture(scope="module")
def host():
    image_host = ImageHost()
    image_host.start()
    assert image_host.ready.wait(5)
    yield image_host
    image_host.stop()


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    media = MediaConfig(
        model_accepts_images=True,
        allowed_media_domains=("127.0.0.1",),
        max_image_bytes=MAX_BYTES,
        media_fetch_timeout_s=TIMEOUT_S,
    )
    with running_server(tmp_path_factory.mktemp("fetch"), media=media) as running:
        yield running


def ask(*urls: str) -> dict:
    content = [{"type": "text", "text": "what"}] + [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": content}]}


def test_fetched_images_reach_the_tokenizer(vision, host):
    url, engine, _ = vision
    n = len(engine.requests)
    response = post(url, "/v1/chat/completions", ask(host.url("/cat.png"), host.url("/to-cat")))
    assert response.status_code == 200, response.text
    assert len(engine.requests) == n + 1
    assert engine.requests[-1].images == [ImageData(CAT, "messages[0].content[1]"), ImageData(CAT, "messages[0].content[2]")]


def test_a_requests_images_are_fetched_at_once(vision, host):
    url, engine, _ = vision
    response = post(url, "/v1/chat/completions", ask(host.url("/barrier/a.png"), host.url("/barrier/b.png")))
    assert response.status_code == 200, response.text
    assert [image.data for image in engine.requests[-1].images] == [CAT + b"a", CAT + b"b"]


@pytest.mark.parametrize(
    "path, code, words",
    [
        ("/big.png", "image_too_large", f"larger than this server's {MAX_BYTES} bytes"),
        ("/stream.png", "image_too_large", f"larger than this server's {MAX_BYTES} bytes"),
        ("/slow.png", "image_fetch_failed", f"took over {TIMEOUT_S:g} s"),
        ("/missing.png", "image_fetch_failed", "HTTP 404"),
        ("/empty.png", "image_fetch_failed", "empty"),
        ("/to-localhost", "image_url_not_allowed", "'localhost' is not in this server's --allowed-media-domains"),
    ],
)
def test_a_failed_fetch_is_a_400_naming_the_part_and_host(vision, host, path, code, words):
    url, engine, _ = vision
    n = len(engine.requests)
    error = assert_error(
        post(url, "/v1/chat/completions", ask(host.url("/cat.png"), host.url(path))), 400, "messages[0].content[2]", code
    )
    assert error["message"].startswith("messages[0].content[2]: ") and words in error["message"]
    assert path not in error["message"]  # the host, never the URL (it may carry a token)
    assert len(engine.requests) == n
    assert post(url, "/v1/chat/completions", ask(host.url("/cat.png"))).status_code == 200


def test_a_host_not_listed_is_refused_before_any_fetch(vision, host):
    url, engine, _ = vision
    n = len(engine.requests)
    body = ask(host.url("/slow.png"), host.url("/cat.png", "localhost"))
    error = assert_error(post(url, "/v1/chat/completions", body), 400, "messages[0].content[2]", "image_url_not_allowed")
    assert "'localhost'" in error["message"]
    assert len(engine.requests) == n


def test_a_closed_port_is_a_400(vision):
    url, _, _ = vision
    error = assert_error(
        post(url, "/v1/chat/completions", ask(f"http://127.0.0.1:{free_port()}/a.png")),
        400,
        "messages[0].content[1]",
        "image_fetch_failed",
    )
    assert "cannot connect" in error["message"] and "'127.0.0.1'" in error["message"]


def fetch(media: MediaConfig, image_url: str) -> bytes:
    async def run() -> bytes:
        fetcher = ImageFetcher(media)
        try:
            return await fetcher.fetch(ImageUrl(image_url, "messages[0].content[0]"))
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_without_a_host_list_names_that_resolve_to_loopback_are_not_fetched(host):
    with pytest.raises(ApiError) as e:
        fetch(MediaConfig(), host.url("/cat.png", "localhost"))
    assert e.value.code == "image_url_not_allowed" and "not a public address" in e.value.message
    assert fetch(MediaConfig(allowed_media_domains=("localhost",)), host.url("/cat.png", "localhost")) == CAT  # listed: fetched
