"""Images in the benchmark's requests: `--image-fraction F` of the requests of any dataset carry
`--images-per-request K` generated pictures of `--image-size WxH`, as OpenAI chat `image_url`
parts with data: URLs (what a client without an image host sends); the rest stay text.

Which requests carry images: exactly round(F x N) of them, drawn by the seed. A picture is
random pixels (every pixel its own draw, as vLLM's random-mm draws them: the worst case for the
JPEG size, and no two alike), so an encoder cache or a prefix cache that keys on the image never
hits by chance. `--image-repeat-fraction R` asks for hits on purpose: round(R x the image
requests) of them, never the first, carry the very pictures of an earlier image request (picked
uniformly among the earlier ones that drew their own), byte for byte the same data: URL.

Everything follows from the dataset's seed, from streams of their own beside the system prompts'
(system_prompts.py): the picks from [seed, 3], picture set j from [seed, 4, j]. So the same seed
gives the same requests, a request's text is the one drawn without images, and the pictures do
not depend on which requests carry them. A request's prompt_len counts its text only (the
counter cannot count an image's placeholder tokens); the server's usage replaces it per result.
"""

from __future__ import annotations

import base64
import dataclasses
import io
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # dataset.py imports this module
    from conveyor.bench.dataset import BenchRequest, DatasetConfig

PICKS_STREAM, PIXELS_STREAM = 3, 4  # second words of the seed sequences (system_prompts.py has 1, 2)
JPEG_QUALITY = 90  # image_ttft.py's: 640x480 random pixels make a 276 KB JPEG, 368 KB as a data: URL


def parse_size(text: str) -> tuple[int, int]:
    """'640x480' -> (640, 480): width, height in pixels."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.strip().isdigit() or not height.strip().isdigit() or int(width) < 1 or int(height) < 1:
        raise ValueError(f"an image size is WIDTHxHEIGHT in pixels, e.g. 640x480, not {text!r}")
    return int(width), int(height)


def jpeg_data_url(width: int, height: int, rng: np.random.Generator) -> str:
    """A width x height JPEG of random pixels as a data: URL."""
    from PIL import Image  # only a run with images pays for the import

    out = io.BytesIO()
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)  # [H, W, RGB]
    Image.fromarray(pixels).save(out, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def plan_images(num_requests: int, fraction: float, repeat_fraction: float, seed: int) -> list[int | None]:
    """Per request, the picture set it carries (None: text only). Sets are numbered in the order
    of the requests that draw them; a repeat names an earlier request's set."""
    if not 0 <= fraction <= 1 or not 0 <= repeat_fraction <= 1:
        raise ValueError("the image fraction and the repeated share are fractions in [0, 1]")
    rng = np.random.default_rng([seed, PICKS_STREAM])
    num_images = round(fraction * num_requests)
    carriers = sorted(int(i) for i in rng.permutation(num_requests)[:num_images])
    num_repeats = min(round(repeat_fraction * num_images), max(num_images - 1, 0))  # the first draws its own
    repeats = {int(i) + 1 for i in rng.permutation(max(num_images - 1, 0))[:num_repeats]}  # positions among carriers
    plan: list[int | None] = [None] * num_requests
    num_sets = 0
    for position, request in enumerate(carriers):
        if position in repeats:
            plan[request] = int(rng.integers(0, num_sets))  # an earlier set: at least one exists
        else:
            plan[request] = num_sets
            num_sets += 1
    return plan


def add_images(requests: list[BenchRequest], config: DatasetConfig) -> list[BenchRequest]:
    """The requests, the planned ones carrying `config.images_per_request` pictures each."""
    if config.images_per_request < 1:
        raise ValueError("a request with images carries at least one")
    plan = plan_images(len(requests), config.image_fraction, config.image_repeat_fraction, config.seed)
    width, height = config.image_size
    sets: dict[int, tuple[str, ...]] = {}
    for j in sorted({j for j in plan if j is not None}):
        rng = np.random.default_rng([config.seed, PIXELS_STREAM, j])
        sets[j] = tuple(jpeg_data_url(width, height, rng) for _ in range(config.images_per_request))
    return [r if j is None else dataclasses.replace(r, images=sets[j]) for r, j in zip(requests, plan)]


def describe(requests: list[BenchRequest], config: DatasetConfig) -> str:
    """One line for the run's header: how many requests carry how many pictures, how many repeat."""
    carriers = [r for r in requests if r.images]
    distinct = len({r.images for r in carriers})
    width, height = config.image_size
    size = sum(len(url) for r in carriers for url in r.images) / max(1, sum(len(r.images) for r in carriers))
    return (
        f"\n{len(carriers)} of {len(requests)} requests carry {config.images_per_request} image(s) of {width}x{height} "
        f"(JPEG data: URLs of ~{size / 1e3:.0f} kB), {len(carriers) - distinct} of them repeating an earlier request's"
    )
