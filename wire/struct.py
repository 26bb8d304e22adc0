"""The base of every message: msgspec Structs encoded array-like, defaults omitted, no GC tracking
(vLLM v1's wire settings). New fields only ever go at the end of a struct."""

from __future__ import annotations

import msgspec


class Struct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base for everything on the wire."""
