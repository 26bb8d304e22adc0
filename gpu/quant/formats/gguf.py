"""GGUF blocks -> QuantizedWeight, keeping each block's codes and its scales as they are.

conveyor's GGUF conversion (gpu/loading/gguf/convert.py) writes a packed tensor as its raw blocks,
`<layer>.gguf_blocks` [N, bytes per row] uint8, beside `<layer>.gguf_type` (its GGML type id), and
marks config.json `quant_method: gguf`. Here the blocks become the kernels' form with no
float copy and no rounding: the codes move, the fp16 scales widen to float32.

| type | block              | kind | group | scale, min                 |
| Q4_0 | d, 32 x 4-bit      | u4   | 32    | d, -8 d                    |
| Q4_1 | d, m, 32 x 4-bit   | u4   | 32    | d, m                       |
| Q8_0 | d, 32 x int8       | u8   | 32    | d, -128 d (codes + 128)    |
| Q4_K | 256: 8 x 32 4-bit  | u4   | 32    | d * sc, -dmin * m          |
| Q5_K | 256: 8 x 32 5-bit  | u8   | 32    | d * sc, -dmin * m          |
| Q6_K | 256: 16 x 16 6-bit | u8   | 16    | d * sc, -32 d * sc         |
Q5_K and Q6_K codes sit in a byte each (their 5 and 6 bits are not repacked). Other GGML types
are written dequantized by the conversion (gpu/loading/gguf/weights.py PACKED_TYPES), so a layer is
either packed here or float.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from conveyor.config.errors import ConfigError
from conveyor.gpu.quant.scheme import QuantScheme
from conveyor.gpu.quant.weight import QuantizedWeight, pack_u4

BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
BLOCK_SIZE = {T.Q4_0: 32, T.Q4_1: 32, T.Q8_0: 32, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256}


class GgufScheme(QuantScheme):
    required = ("gguf_blocks", "gguf_type")
    quantizes_embedding = True

    def convert(self, prefix: str, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        blocks, type_id = parts["gguf_blocks"], int(parts["gguf_type"].item())
        try:
            qtype = T(type_id)
        except ValueError:
            qtype = None
        if qtype not in BLOCK_BYTES:
            raise ConfigError(f"tensor {prefix}.gguf_blocks: GGML type {type_id} is not kept packed")
        n, k = shape
        if k % BLOCK_SIZE[qtype] or tuple(blocks.shape) != (n, k // BLOCK_SIZE[qtype] * BLOCK_BYTES[qtype]):
            raise ConfigError(f"tensor {prefix}.gguf_blocks has shape {tuple(blocks.shape)}, not {n} rows of {k} {qtype.name} weights")
        b = blocks.numpy().reshape(n * k // BLOCK_SIZE[qtype], BLOCK_BYTES[qtype])
        kind, group, codes, scales, mins = _READERS[qtype](b)
        q = torch.from_numpy(np.ascontiguousarray(codes)).reshape(n, k)
        return QuantizedWeight(
            kind,
            group,
            pack_u4(q) if kind == "u4" else q,
            torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).reshape(n, k // group),
            torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32)).reshape(n, k // group),
        )


def _half(b: np.ndarray) -> np.ndarray:
    """[B, 2] bytes -> [B] float32 (an fp16 field of each block)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles_by_half(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes, input j low and j + 16 high -> codes [B, 32]."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray):
    d = _half(b[:, :2])
    return "u4", 32, _nibbles_by_half(b[:, 2:]), d, -8 * d


def _q4_1(b: np.ndarray):
    return "u4", 32, _nibbles_by_half(b[:, 4:]), _half(b[:, :2]), _half(b[:, 2:4])


def _q8_0(b: np.ndarray):
    d = _half(b[:, :2])
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return "u8", 32, codes, d, -128 * d


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: each 32-input group's scale d * sc and min -dmin * m, [B, 8]."""
    d, dmin = _half(b[:, :2])[:, None], _half(b[:, 2:4])[:, None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def _q4_k(b: np.ndarray):
    scales, mins = _k_scales(b)
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return "u4", 32, (qs & 0xF).reshape(-1, 256), scales, mins


def _q5_k(b: np.ndarray):
    scales, mins = _k_scales(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return "u8", 32, low.reshape(-1, 8, 32) | (high << 4), scales, mins


def _q6_k(b: np.ndarray):
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32)
    scales = _half(b[:, 208:210])[:, None] * sc  # [B, 16]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = low.reshape(-1, 2, 4, 32) | (high.reshape(-1, 2, 4, 32) << 4)
    return "u8", 16, codes.reshape(-1, 256), scales, -32 * scales


_READERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
