"""ImageFetcher: an image URL's bytes, fetched by the ingress over aiohttp, within bounds.

One client session per ingress process, opened on the first fetch, closed with the app. A fetch
reads at most --max-image-bytes (a larger Content-Length is refused before the body; a body that
runs past it is cut there) and takes at most --media-fetch-timeout, redirects included.
Redirects are followed by hand, up to MAX_REDIRECTS, each target checked as the first
(urls.fetch_target), so a redirect cannot lead past --allowed-media-domains. Names are resolved by
GuardedResolver, which drops the addresses that are not public unless the name is listed: a URL
cannot reach the server's own ports or a metadata service by a name that points there.

Every failure is a 400 naming the part and the URL's host (never the whole URL: it may carry a
token); the fetch is no part of the engine, so a failed one leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import yarl

from conveyor.config.media import MediaConfig
from conveyor.stages.ingress.media.urls import (
    ImageUrl,
    fetch_target,
    host_listed,
    is_public,
    private_host_message,
    refuse,
)

MAX_REDIRECTS = 5
CHUNK_BYTES = 64 * 1024
REDIRECTS = (301, 302, 303, 307, 308)


class NotPublic(OSError):
    """A name that resolves to no public address and is not listed."""


class GuardedResolver(aiohttp.ThreadedResolver):
    """The system resolver (getaddrinfo in a thread), keeping only public addresses for names
    that --allowed-media-domains does not list."""

    def __init__(self, allowed_domains: tuple[str, ...]) -> None:
        super().__init__()
        self.allowed_domains = allowed_domains

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        addresses = await super().resolve(host, port, family)
        if host_listed(host, self.allowed_domains):
            return addresses
        public = [a for a in addresses if is_public(a["host"])]
        if not public:
            raise NotPublic(private_host_message(host))
        return public


class ImageFetcher:
    def __init__(self, media: MediaConfig) -> None:
        self.media = media
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, image: ImageUrl) -> bytes:
        url = fetch_target(image, self.media.allowed_media_domains)
        timeout = self.media.media_fetch_timeout_s
        try:
            return await asyncio.wait_for(self._follow(image, url), timeout)
        except asyncio.TimeoutError:
            raise refuse(image.part, f"fetching the image from {url.host!r} took over {timeout:g} s", "image_fetch_failed") from None

    async def close(self, app: object = None) -> None:
        """Close the session (an aiohttp app's on_cleanup hook takes the app)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=GuardedResolver(self.media.allowed_media_domains))
            # No proxy from the environment, no cookies kept between clients' fetches.
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False)
        return self._session

    async def _follow(self, image: ImageUrl, url: yarl.URL) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                async with self._client().get(url, allow_redirects=False) as response:
                    if response.status in REDIRECTS and "Location" in response.headers:
                        target = url.join(yarl.URL(response.headers["Location"]))
                        url = fetch_target(ImageUrl(str(target), image.part), self.media.allowed_media_domains)
                        continue
                    if not 200 <= response.status < 300:
                        message = f"fetching the image from {url.host!r} failed: HTTP {response.status}"
                        raise refuse(image.part, message, "image_fetch_failed")
                    return await self._read(image, response)
            except aiohttp.ClientConnectorError as e:
                os_error = e.os_error
                reason = str(os_error) if isinstance(os_error, NotPublic) else f"cannot connect ({os_error.strerror or os_error})"
                raise refuse(image.part, f"fetching the image from {url.host!r} failed: {reason}", _code(e)) from None
            except (aiohttp.ClientError, ValueError) as e:  # ValueError: a URL aiohttp cannot request
                message = f"fetching the image from {url.host!r} failed: {type(e).__name__}: {e}"
                raise refuse(image.part, message, "image_fetch_failed") from None
        message = f"fetching the image from {url.host!r} redirected more than {MAX_REDIRECTS} times"
        raise refuse(image.part, message, "image_fetch_failed")

    async def _read(self, image: ImageUrl, response: aiohttp.ClientResponse) -> bytes:
        cap = self.media.max_image_bytes
        too_large = f"the image at {response.url.host!r} is larger than this server's {cap} bytes (--max-image-bytes)"
        if response.content_length is not None and response.content_length > cap:
            raise refuse(image.part, too_large, "image_too_large")
        data = bytearray()
        async for chunk in response.content.iter_chunked(CHUNK_BYTES):
            data += chunk
            if len(data) > cap:  # stop reading: the connection is dropped, not drained
                response.close()
                raise refuse(image.part, too_large, "image_too_large")
        if not data:
            raise refuse(image.part, f"the image at {response.url.host!r} is empty", "image_fetch_failed")
        return bytes(data)


def _code(error: aiohttp.ClientConnectorError) -> str:
    return "image_url_not_allowed" if isinstance(error.os_error, NotPublic) else "image_fetch_failed"
