"""MediaConfig: what the ingress takes as images, and from where (issue 51). vLLM's flag names.

`--limit-mm-per-prompt` bounds the images one prompt may carry, in vLLM's JSON ('{"image": 4}';
its older 'image=4' form too); vLLM's own default is 999 per modality, ours 16: each image is
hundreds of prompt tokens and up to --max-image-bytes of memory in the ingress, so a prompt with
more is a mistake or an attack. Keys for modalities conveyor does not serve (video, audio) are
accepted and ignored, so a vLLM command line works unchanged; a key it does not know is an error.
`--allowed-media-domains` lists the hosts whose http(s) image URLs the ingress fetches (a name
also allows its subdomains); empty: any host whose addresses are all public. A host that resolves
to a loopback, private or link-local address (a metadata service, a port on the server itself)
is fetched only when listed. `--max-image-bytes` caps an image's encoded size (a data: URL's
decoded bytes, a fetch stops reading past it), `--media-fetch-timeout` a whole fetch, redirects
included; `--max-image-pixels` a decoded image, enforced where images are decoded, in the
tokenizer stage.

Whether the served model takes images at all is a fact of its checkpoint, not a setting:
`model_accepts_images`, filled at build time; ask `accepts_images(config)`.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
from typing import TYPE_CHECKING, Any

from conveyor.config.errors import ConfigError
from conveyor.config.options import option

if TYPE_CHECKING:
    from conveyor.config.engine import EngineConfig

MODALITIES = ("image", "video", "audio")  # vLLM's; conveyor serves images alone
DEFAULT_MAX_IMAGES = 16  # also where --limit-mm-per-prompt names other modalities alone


@dataclasses.dataclass(frozen=True)
class MediaConfig:
    limit_mm_per_prompt: str = option(
        f'{{"image": {DEFAULT_MAX_IMAGES}}}',
        "most images one prompt may carry, as vLLM's JSON: '{\"image\": 4}' (0: no images; video and audio keys are ignored)",
    )
    allowed_media_domains: tuple[str, ...] = option(
        (),
        "hosts whose http(s) image URLs are fetched (each also allows its subdomains); a host resolving to "
        "a private or loopback address is fetched only when listed",
        none="any public host",
    )
    max_image_bytes: int = option(20 * 1024 * 1024, "largest encoded image (a data: URL's bytes, or a fetched file)", positive=True)
    media_fetch_timeout_s: float = option(
        10.0, "seconds an image URL fetch may take, redirects included", flag="media-fetch-timeout", positive=True
    )
    max_image_pixels: int = option(8192 * 8192, "largest decoded image, width x height", positive=True)
    # From the checkpoint at build time (a vision family), never from a flag: see accepts_images.
    model_accepts_images: bool = False

    def __post_init__(self) -> None:
        image_limit(self.limit_mm_per_prompt)  # a ConfigError at start, not at the first image
        for domain in self.allowed_media_domains:
            if _is_address(domain):
                continue
            if not domain or any(c in domain for c in "/:@[] ") or domain != domain.strip("."):
                raise ConfigError(f"--allowed-media-domains {domain!r}: give a host name like example.com (no scheme, port or path)")

    @property
    def max_images(self) -> int:
        """Images one prompt may carry."""
        return image_limit(self.limit_mm_per_prompt)


def accepts_images(config: EngineConfig) -> bool:
    """Whether the served model takes images: False unless its checkpoint has a vision tower."""
    return config.media.model_accepts_images


@functools.lru_cache(maxsize=8)
def image_limit(text: str) -> int:
    """The image count of --limit-mm-per-prompt: '{"image": 4}', '{"image": {"count": 4}}' or
    'image=4,video=0'. Left out, images keep the default (vLLM keeps its own, 999)."""
    flag = "--limit-mm-per-prompt"
    limits: Any
    try:
        limits = json.loads(text)
    except json.JSONDecodeError:
        pairs = [item.partition("=") for item in text.split(",") if item.strip()]
        if not pairs or any(not sep for _, sep, _ in pairs):
            raise ConfigError(f"{flag} {text!r}: give JSON like '{{\"image\": 4}}'") from None
        limits = {key.strip(): value.strip() for key, _, value in pairs}
    if not isinstance(limits, dict):
        raise ConfigError(f"{flag} {text!r}: give a JSON object like '{{\"image\": 4}}'")
    unknown = sorted(set(limits) - set(MODALITIES))
    if unknown:
        raise ConfigError(f"{flag}: unknown modality {unknown[0]!r}; known: {', '.join(MODALITIES)}")
    counts = {key: _count(key, value, flag) for key, value in limits.items()}
    return counts.get("image", DEFAULT_MAX_IMAGES)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _count(key: str, value: Any, flag: str) -> int:
    if isinstance(value, dict):  # vLLM's newer form: {"count": 4, "width": ..., "height": ...}
        value = value.get("count")
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{flag}: the {key} limit must be a count of 0 or more, got {value!r}")
    return value
