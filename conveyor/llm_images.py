"""Images through the Python API (issue 51), in vLLM's shapes, made into what the tokenizer stage
takes: TokenizeRequest.images (the encoded files) and ChatMessage.parts (their order).

- `LLM.generate({"prompt": "USER: <image>\\n...", "multi_modal_data": {"image": img}})`: the
  prompt holds the model's image marker once per image, in order (`img` one image or a list);
- `LLM.chat` messages whose content is a list of parts: {"type": "text", "text"},
  {"type": "image_url", "image_url": {"url"}} (a data: URL; the offline API fetches nothing),
  {"type": "image_pil", "image_pil": img} or {"type": "image", "image": img}.

An image is a PIL image (sent on losslessly, as an uncompressed PNG), the bytes of an image file, or a data: URL.
Everything else is a ValueError naming the part.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from conveyor.wire.images import ContentPart, ImageData, message_content
from conveyor.wire.messages import ChatMessage

NO_LIMIT = 1 << 62  # the offline API's caller sized its own images


def image_data(image: Any, part: str) -> ImageData:
    """One image as the tokenizer stage takes it."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return ImageData(bytes(image), part)
    if isinstance(image, str):
        if not image.startswith("data:"):
            raise ValueError(f"{part}: the Python API reads images, not URLs: pass a PIL image, the file's bytes or a data: URL")
        from conveyor.stages.ingress.errors import ApiError
        from conveyor.stages.ingress.media.urls import ImageUrl, data_url_bytes

        try:
            return ImageData(data_url_bytes(ImageUrl(image, part), NO_LIMIT), part)
        except ApiError as e:
            raise ValueError(e.message) from None
    if hasattr(image, "save") and hasattr(image, "size"):  # a PIL image
        out = io.BytesIO()
        image.save(out, format="PNG", compress_level=0)  # lossless, unpacked in this process: no time on deflate
        return ImageData(out.getvalue(), part)
    raise ValueError(f"{part}: an image is a PIL image, an image file's bytes or a data: URL, not {type(image).__name__}")


def prompt_images(prompt: Mapping[str, Any], at: int) -> list[ImageData]:
    """A generate() prompt dict's images: multi_modal_data["image"], one or a list."""
    data = prompt.get("multi_modal_data") or {}
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"prompts[{at}].multi_modal_data: only images are served, not {sorted(unknown)}")
    images = data.get("image", [])
    images = images if isinstance(images, (list, tuple)) else [images]
    return [image_data(image, f"prompts[{at}].multi_modal_data.image[{i}]") for i, image in enumerate(images)]


def chat_messages(conversation: Sequence[Mapping[str, Any]]) -> tuple[list[ChatMessage], list[ImageData]]:
    """A conversation's messages and, in order, the images their content parts hold."""
    messages: list[ChatMessage] = []
    images: list[ImageData] = []
    for i, message in enumerate(conversation):
        content = message["content"]
        if isinstance(content, str):
            messages.append(ChatMessage(message["role"], content))
            continue
        parts: list[ContentPart] = []
        for j, part in enumerate(content):
            at, kind = f"messages[{i}].content[{j}]", part.get("type")
            if kind == "text":
                parts.append(ContentPart(text=part["text"]))
                continue
            if kind == "image_url":
                url = part["image_url"]
                image = url["url"] if isinstance(url, Mapping) else url
            elif kind in ("image_pil", "image"):
                image = part[kind]
            else:
                raise ValueError(f"{at}: a content part is text, image_url, image_pil or image, not {kind!r}")
            parts.append(ContentPart(image=len(images)))
            images.append(image_data(image, at))
        text, with_images = message_content(parts)
        messages.append(ChatMessage(message["role"], text, parts=with_images))
    return messages, images
