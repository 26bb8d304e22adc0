"""An image part's URL, before any byte is fetched: what a request names, and what may be fetched.

`ImageUrl` is one image of a request as its body gave it (a `data:` URL or an http(s) URL) with
the label of the part that held it in the route's own terms (`messages[0].content[1]`,
`input[2].content[0]`), which every refusal names. `data_url_bytes` decodes a base64 data: URL;
`fetch_target` checks an http(s) URL against --allowed-media-domains and the address rule
(config/media.py) before a connection is opened. Every refusal is an ApiError 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import re

import yarl

from conveyor.stages.ingress.errors import ApiError

SCHEMES = ("http", "https")
_SPACE = re.compile(r"\s+")


@dataclasses.dataclass(frozen=True)
class ImageUrl:
    url: str
    part: str  # where the request held it: "messages[0].content[1]"


def refuse(part: str, message: str, code: str) -> ApiError:
    """A 400 naming the part: in `param` for OpenAI's shape, first in the message for Anthropic's."""
    return ApiError(400, f"{part}: {message}", param=part, code=code)


def data_url_bytes(image: ImageUrl, max_bytes: int) -> bytes:
    """The bytes of `data:image/<type>;base64,<data>`. Whitespace and missing padding are forgiven
    (some clients wrap or trim base64); any other character outside the alphabet is a 400."""
    head, comma, data = image.url.partition(",")
    media_type, *params = head[len("data:") :].split(";")
    if not comma or "base64" not in params:
        raise refuse(image.part, "a data: URL must be base64: data:image/png;base64,...", "invalid_image_url")
    if not media_type.lower().startswith("image/"):
        message = f"a data: URL must hold an image (image/png, image/jpeg, ...), not {media_type!r}"
        raise refuse(image.part, message, "invalid_image_url")
    if _SPACE.search(data):
        data = _SPACE.sub("", data)
    if len(data) * 3 // 4 > max_bytes + 2:  # before decoding: an oversize image costs no copy
        raise _too_large(image.part, max_bytes)
    try:
        raw = base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise refuse(image.part, f"the data: URL's base64 does not decode ({e})", "invalid_image_url") from None
    if len(raw) > max_bytes:
        raise _too_large(image.part, max_bytes)
    if not raw:
        raise refuse(image.part, "the data: URL holds no bytes", "invalid_image_url")
    return raw


def fetch_target(image: ImageUrl, allowed_domains: tuple[str, ...]) -> yarl.URL:
    """The URL to fetch, if its scheme is http(s) and its host may be fetched: listed (or a
    subdomain of one listed) when a list is given. An IP address in the URL is refused unless
    public or listed; a name's addresses are checked when it resolves (fetch.py)."""
    try:
        url = yarl.URL(image.url)
    except (ValueError, TypeError):
        url = None
    if url is None or url.scheme.lower() not in SCHEMES or not url.host:
        scheme = url.scheme if url is not None and url.scheme else image.url.partition(":")[0][:16]
        message = f"image URLs must be data: (base64) or http(s) URLs, not {scheme!r}"
        raise refuse(image.part, message, "image_url_not_allowed")
    host = url.host.lower().rstrip(".")
    if allowed_domains and not host_listed(host, allowed_domains):
        message = f"the host {host!r} is not in this server's --allowed-media-domains"
        raise refuse(image.part, message, "image_url_not_allowed")
    if is_ip(host) and not is_public(host) and not host_listed(host, allowed_domains):
        raise refuse(image.part, private_host_message(host), "image_url_not_allowed")
    return url


def host_listed(host: str, domains: tuple[str, ...]) -> bool:
    """Exactly a listed name, or a subdomain of one (`img.example.com` under `example.com`); an
    address, the same address however written (`::ffff:127.0.0.1` is `::ffff:7f00:1`)."""
    host = host.lower().rstrip(".")
    if (ip := _ip(host)) is not None:
        return any(_ip(d) == ip for d in domains)
    return any(host == d.lower() or host.endswith("." + d.lower()) for d in domains)


def is_ip(host: str) -> bool:
    return _ip(host) is not None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_public(address: str) -> bool:
    """A globally routable address: not loopback, private, link-local (cloud metadata services),
    shared, reserved or multicast. An IPv4-mapped IPv6 address is judged by its IPv4 address."""
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 scope id (fe80::1%eth0) is not part of it
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def private_host_message(host: str) -> str:
    return (
        f"the host {host!r} is not a public address (loopback, private or link-local); "
        "the server fetches such hosts only when --allowed-media-domains lists them"
    )


def _too_large(part: str, max_bytes: int) -> ApiError:
    return refuse(part, f"the image is larger than this server's {max_bytes} bytes (--max-image-bytes)", "image_too_large")
