"""ImageLoader: a request's image parts become the ImageData sent in its TokenizeRequest.

`load(gen)` runs before a request is submitted (GenerateRoutes.run), so every refusal is a 400
before the tokenizer sees anything, in the order a client would want to hear it: the model takes
no images; more images than --limit-mm-per-prompt (before any fetch); then each part in order,
data: URLs decoded and http(s) URLs checked against the allowed hosts before any connection;
then the fetches, all of a request's at once (the first failure cancels the others). Images keep
their request order: ContentPart.image indexes them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from conveyor.config import EngineConfig, accepts_images
from conveyor.stages.ingress.media.fetch import ImageFetcher
from conveyor.stages.ingress.media.urls import ImageUrl, data_url_bytes, fetch_target, refuse
from conveyor.wire.images import ImageData

if TYPE_CHECKING:
    from conveyor.stages.ingress.protocol import Generation


class ImageLoader:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.media = config.media
        self.fetcher = ImageFetcher(config.media)

    async def load(self, gen: Generation) -> None:
        """Fill gen.images from gen.image_urls (once: a second call does nothing)."""
        if gen.images is None:
            gen.images = await self.resolve(gen.image_urls)

    def check(self, images: list[ImageUrl]) -> None:
        """What needs no byte of any image: the model takes images, and this many."""
        if not images:
            return
        if not accepts_images(self.config):
            message = f"the model `{self.config.model.served_name}` does not accept images"
            raise refuse(images[0].part, message, "images_not_supported")
        limit = self.media.max_images
        if len(images) > limit:
            message = (
                f"this prompt has {len(images)} images; this server takes at most {limit} per prompt (--limit-mm-per-prompt)"
                if limit
                else "this server takes no images (--limit-mm-per-prompt)"
            )
            raise refuse(images[limit].part, message, "too_many_images")

    async def resolve(self, images: list[ImageUrl]) -> list[ImageData]:
        self.check(images)
        found: dict[int, bytes] = {}
        to_fetch: list[int] = []
        for i, image in enumerate(images):
            if image.url[:5].lower() == "data:":
                found[i] = data_url_bytes(image, self.media.max_image_bytes)
            else:
                fetch_target(image, self.media.allowed_media_domains)  # refused before any fetch begins
                to_fetch.append(i)
        if to_fetch:
            tasks = [asyncio.ensure_future(self.fetcher.fetch(images[i])) for i in to_fetch]
            try:
                fetched = await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # after a failure (or the client leaving): stop the other fetches
                    task.cancel()
            found.update(zip(to_fetch, fetched))
        return [ImageData(found[i], image.part) for i, image in enumerate(images)]

    async def close(self, app: object = None) -> None:
        await self.fetcher.close()
