"""expand_placeholders: each image's one marker token becomes its run of placeholder tokens.

The chat template renders one image token per image part, where the client put it; an image
that makes n embeddings needs n placeholder tokens, whose embeddings the worker replaces with
the image's. Only the template's markup can yield the image token: the encoder reads special-token
text inside a message's content (a user typing "<image>") as plain text (encoder.py). So a count
that differs from the number of images means the ids came from elsewhere (prompt_token_ids, or
--chat-content-special-tokens) or the template dropped or repeated an image: refused, since the
worker could not pair embeddings with placeholders. Call it for text-only prompts too (no
counts), so an image token with no image is refused here and not in the worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.stages.tokenizer.rejected import Rejected


def expand_placeholders(
    token_ids: Sequence[int], image_token_id: int, counts: Sequence[int], *, param: str = "messages"
) -> tuple[list[int], list[int]]:
    """(ids with the i-th image token repeated counts[i] times, each run's first index in them)."""
    markers = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(markers) != len(counts):
        raise Rejected(
            f"the prompt holds {len(markers)} image placeholder token(s) (id {image_token_id}) for "
            f"{len(counts)} image(s); each image must appear once, as an image part of a message",
            param=param,
        )
    ids: list[int] = []
    offsets: list[int] = []
    start = 0
    for marker, count in zip(markers, counts):
        ids.extend(token_ids[start:marker])
        offsets.append(len(ids))
        ids.extend([image_token_id] * count)
        start = marker + 1
    ids.extend(token_ids[start:])
    return ids, offsets
