"""GET /v1/responses/{id}/input_items: a stored response's input items, a page at a time.

The items are the whole conversation the response answered (its previous responses' input and
output, then its own input), in OpenAI's list shape: {object: "list", data, first_id, last_id,
has_more}. Query: `order` ("desc", the default, newest first; or "asc"), `limit` (1 to 100,
default 20), and the cursors `after` / `before`, an item id the page starts after or ends
before, in that order. A bad value, or a cursor that is not one of the items, is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.stages.ingress.errors import ApiError

MAX_LIMIT = 100


def input_items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", param="order")
    limit = _limit(query.get("limit", "20"))
    ordered = items[::-1] if order == "desc" else list(items)
    start, end = 0, len(ordered)
    ids = [item["id"] for item in ordered]
    if (after := query.get("after")) is not None:
        start = _position(ids, after, "after") + 1
    if (before := query.get("before")) is not None:
        end = _position(ids, before, "before")
    window = ordered[start:end]
    data = window[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(window) > limit,
    }


def _limit(text: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 3 and 1 <= int(text) <= MAX_LIMIT):
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return int(text)


def _position(ids: list[str], item_id: str, param: str) -> int:
    if item_id not in ids:
        raise ApiError(400, f"{param} names {item_id!r}, which is not one of this response's input items", param=param)
    return ids.index(item_id)
