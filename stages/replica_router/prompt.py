"""The routing key of a request: its prompt as text, hashed in fixed-size character chunks.

The router never tokenizes (replicas may even serve different tokenizers' revisions), so it
hashes characters: chunk i's hash names the prompt's first (i + 1) * chunk_chars characters, the
way a KV block's hash names its prefix of tokens (policy.prefix_hashes chains them). Requests
that share an opening share its chunks, whatever follows. A partial last chunk is not hashed, as
a partial KV block is not cached.

The text of a body:
  /v1/completions        `prompt`: a string, or the first of a list of strings, or token ids
                         (hashed as ids; text and ids of one prompt then look unrelated)
  /v1/chat/completions   each message's role and text in order, so a shared system prompt is a
                         shared opening; a content given as parts contributes its text parts and,
                         in its place, a digest of each image part's URL (a data: URL's bytes), so
                         another picture parts ways there
Anything else, and any body that is not a JSON object, routes by load alone (no hashes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence

from conveyor.stages.router.policy import prefix_hashes

ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def prompt_hashes(path: str, body: bytes, chunk_chars: int) -> list[int]:
    """The chained chunk hashes of a request's prompt; [] when it names none."""
    if path not in ROUTED_PATHS:
        return []
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []
    if not isinstance(request, dict):
        return []
    key = routing_key(request)
    return prefix_hashes(key, chunk_chars) if key else []


def routing_key(request: dict) -> Sequence[Hashable]:
    """The items to hash: the prompt's characters, or its token ids."""
    if "messages" in request:
        return _chat_text(request["messages"])
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first names where the batch goes
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return ""


def _chat_text(messages: object) -> str:
    if not isinstance(messages, list):
        return ""
    pieces = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(_part_text(p) for p in content)
        # The role's name and a separator, so that moving text between turns changes the key.
        pieces.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}\n")
    return "".join(pieces)


def _part_text(part: object) -> str:
    """A content part's share of the key: its text, or a mark naming its image's URL."""
    if not isinstance(part, dict):
        return ""
    if isinstance(part.get("text"), str):
        return part["text"]
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if isinstance(url, str):
        return f"\x00image:{hashlib.blake2b(url.encode(), digest_size=8).hexdigest()}\x00"
    return ""
