"""The KV disk tier's file format and validity key (torch-free; disk_tier.py stores the files).

A block's file is `<dir>/<validity key>/<hh>/<hash>.kv`: `hash` the block's prefix-cache name
(stages/scheduler/block_manager.py's chain_hash) as 16 hex digits of its unsigned 64 bits, `hh`
their first two. The validity key is a short digest of everything that makes a block's bytes valid
(`KVValidity`): a changed model, dtype, block size, layout, adapter, rank or format reads under
another key, so never stale KV. Each key's directory holds a `validity.json` saying what it is.

A file is a 40-byte header and the payload, the block's bytes (host_tier.py's slot, all layers):
    magic "CVKV" | format version u16 | reserved u16 | hash u64 | payload length u64 |
    crc32 of the payload u32 | reserved u32 | validity key 8 bytes            (little-endian)
CRC-32, not a cryptographic digest: it guards against accidents (a torn write after a power cut,
a truncated copy, bit rot), which it catches but for 2^-32, and zlib's runs at ~6 GB/s against
blake2b's ~1.3 GB/s, on the load path of a hit. A digest would add nothing against a writer with
access to the directory, who could as well write a valid file of wrong KV. The length catches a
truncated file whatever its CRC; the hash and key in the header catch a file moved or copied
under another name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

FORMAT_VERSION = 1
MAGIC = b"CVKV"
HEADER = struct.Struct("<4sHHQQII8s")  # see the module docstring
HASH_MASK = (1 << 64) - 1


if TYPE_CHECKING:
    from conveyor.config.model import ModelConfig


def python_hash_scheme() -> str:
    """What chain_hash's values depend on: CPython's tuple hash (stable since 3.8, but a version
    is cheap to include) and the width of hash()."""
    return f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}-{sys.hash_info.width}bit"


@dataclasses.dataclass(frozen=True)
class KVValidity:
    """What makes a block's bytes valid; any change names another directory.

    model: the model's identity, weights included: its name and revision, or for a local
    checkpoint a digest of its config and weight files' names, sizes and times, plus its
    quantization (the KV depends on every weight). layout: the attention backend's layout inside a
    block (gpu/backends: torch and cpu differ). The adapter, per block, goes to `key`."""

    model: str
    kv_dtype: str  # the cache's torch dtype name, "bfloat16" or "float8_e4m3fn"
    block_size: int
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    hash_scheme: str = dataclasses.field(default_factory=python_hash_scheme)
    format_version: int = FORMAT_VERSION

    def describe(self, adapter: str | None) -> dict[str, object]:
        """What validity.json holds: the fields, and the adapter (its name and a digest of its
        weights, as the worker identifies it; None: the base model)."""
        return {**dataclasses.asdict(self), "adapter": adapter}

    def key(self, adapter: str | None = None) -> str:
        """The directory name: 16 hex digits of a digest of `describe(adapter)`."""
        text = json.dumps(self.describe(adapter), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def file_name(block_hash: int) -> str:
    """A chain hash (signed 64-bit) -> "<16 hex digits>.kv"."""
    return f"{block_hash & HASH_MASK:016x}.kv"


def hash_of_name(name: str) -> int | None:
    """file_name's inverse, the signed value chain_hash gave; None for any other name."""
    stem, dot, ext = name.partition(".")
    if ext != "kv" or len(stem) != 16:
        return None
    try:
        value = int(stem, 16)
    except ValueError:
        return None
    return value - (1 << 64) if value >= 1 << 63 else value


def encode_header(block_hash: int, key: str, payload: memoryview | bytes) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, block_hash & HASH_MASK, len(payload), zlib.crc32(payload), 0, bytes.fromhex(key))


class BadFile(Exception):
    """A file that is not a valid block of the expected name: the message says why."""


def check_header(header: bytes, block_hash: int, key: str, payload_bytes: int) -> int:
    """The payload's CRC-32 from a header read back, after checking that it is this block's:
    raises BadFile otherwise."""
    if len(header) != HEADER.size:
        raise BadFile(f"truncated header ({len(header)} of {HEADER.size} bytes)")
    magic, version, _, stored_hash, length, crc, _, stored_key = HEADER.unpack(header)
    if magic != MAGIC:
        raise BadFile("not a KV block file (bad magic)")
    if version != FORMAT_VERSION:
        raise BadFile(f"format version {version}, expected {FORMAT_VERSION}")
    if stored_hash != block_hash & HASH_MASK or stored_key.hex() != key:
        raise BadFile("header names another block")
    if length != payload_bytes:
        raise BadFile(f"payload length {length}, expected {payload_bytes}")
    return crc


def model_identity(model: ModelConfig) -> str:
    """A local checkpoint's identity for KVValidity.model: a digest of the model config as read
    (dtype and quantization included) and of its directory's files by name, size and modification
    time, so that replaced weights name another directory."""
    root = Path(model.path)
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in root.iterdir() if f.is_file())
    text = json.dumps([repr(model), files])
    return f"{root.name}-{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"
