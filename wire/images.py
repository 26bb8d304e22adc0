"""Images on the wire (issue 51): what the ingress sends a tokenizer, and what a tokenizer sends on.

    ingress --TokenizeRequest.images: ImageData (the encoded file)--> tokenizer
    tokenizer --ScheduleRequest.images: ImageInput (pixels + where their tokens sit)--> scheduler
    scheduler --NewSeq.images: ImageInput--> worker (its vision tower turns pixels into embeddings)

The ingress only finds the bytes (a data: URL's base64, an http(s) fetch, an Anthropic base64
source) and checks their count and size; decoding, resizing and patching happen in the tokenizer
stage's processes, which scale on their own. A chat message with images carries its content as
ContentParts in order, each image part naming its index in TokenizeRequest.images, so the chat
template renders the family's image markers where the client put them.

Invariants: an ImageInput's placeholder tokens are prompt_token_ids[offset : offset + length],
one per embedding the vision tower makes for it (after the projector), in order; its `hash` is a
64-bit digest of its pixels and shape (what the encoder cache and the prefix cache key it by), so
the same picture sent twice, in any encoding that decodes to the same pixels, hits both caches.
Pixels travel as raw float32 bytes (msgspec, no pickle).
"""

from __future__ import annotations

from conveyor.wire.struct import Struct


class ImageData(Struct):
    """An image as the client gave it: the encoded file (PNG, JPEG, WebP, GIF, BMP), base64-decoded
    or fetched by the ingress."""

    data: bytes
    part: str  # where the request held it, for errors: "messages[1].content[0]", "input[0].content[2]"


class ContentPart(Struct):
    """One part of a chat message's content, in order: text, or (text None) the request's image
    number `image` (an index into TokenizeRequest.images)."""

    text: str | None = None
    image: int = -1


class ImageInput(Struct):
    """One image of a prompt, preprocessed for the model's vision tower."""

    hash: int  # 64-bit digest of pixels and shape: the encoder cache's and the prefix cache's key
    offset: int  # its first placeholder token's index in the prompt's token ids
    length: int  # its placeholder tokens: one per embedding the vision tower makes
    pixels: bytes  # float32, C order, `shape`
    shape: list[int]  # LLaVA: [3, H, W]; Qwen2-VL: [patches, C * temporal_patch * patch * patch]
    grid: list[int] = []  # Qwen2-VL: (t, h, w) in patches; empty where the family has no grid
    # Its placeholders attend to each other, not only to earlier ones (Gemma 3): the scheduler never
    # ends a prompt chunk inside it, and the worker gives a pass through it its rows' extents.
    bidirectional: bool = False


def message_content(parts: list[ContentPart]) -> tuple[str, list[ContentPart] | None]:
    """A chat message's (content, parts) from its parts in order: the text parts joined with "\n",
    and the parts themselves only where one is an image (text alone travels as the text)."""
    text = "\n".join(part.text for part in parts if part.text is not None)
    return text, parts if any(part.text is None for part in parts) else None
