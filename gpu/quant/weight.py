"""QuantizedWeight: the one form every quantized checkpoint's linear weights take once loaded.

Each format's reader (gpu/quant/formats/) turns its published tensors into this; every backend's
kernel reads only this (gpu/backends/*: `Ops.quant_linear`), so formats and kernels meet in one
place. A weight is logically [N, K] (out, in), in groups of `group_size` consecutive inputs of
one output row that share a scale and a min:

    w[n, k] = code(q[n, k]) * scales[n, k // G] + mins[n, k // G]

- kind "u4": q in 0..15, two per byte. Within each chunk of 32 inputs (16 bytes) byte j holds
  input j in its low nibble and input j + 16 in its high nibble (GGUF Q4_0/Q4_1's own order, so
  a kernel loads x's chunk as two contiguous halves). qweight [N, K / 2] uint8; G % 32 == 0.
- kind "u8": q in 0..255, qweight [N, K] uint8 (signed codes are stored + 128, min -128 * s).
- kind "e4m3": q an FP8 e4m3 code, qweight [N, K] float8_e4m3fn; mins is None (zero).
scales and mins are [N, K / G] float32 as loaded (fp16 GGUF scales widen exactly; a K-quant's
scale times its 6-bit sub-scale needs float32); `compact` stores both as float16 where that is
exact (the cpu backend's prepare does: a sixth fewer bytes per Q4_1 weight), and every reader
widens them. `perm` [K] int64, where not None, is GPTQ's act-order: the kernel's input j is
x[:, perm[j]], so its groups are contiguous.
"""

from __future__ import annotations

import dataclasses

import torch

from conveyor.config.errors import ConfigError
from conveyor.gpu.parallel.shard import Split, cut, pieces

KINDS = {"u4": 4, "u8": 8, "e4m3": 8}  # kind -> bits per weight
CHUNK = 32  # a u4 chunk: 32 inputs in 16 bytes


@dataclasses.dataclass
class QuantizedWeight:
    kind: str
    group_size: int
    qweight: torch.Tensor  # [N, K / 2] uint8 (u4), [N, K] uint8 (u8) or float8_e4m3fn (e4m3)
    scales: torch.Tensor  # [N, K / G] float32, or float16 (compact)
    mins: torch.Tensor | None  # [N, K / G] as scales; None: zero
    perm: torch.Tensor | None = None  # [K] int64: input order (GPTQ act-order); None: as is
    # A backend's own form of the same weight (set once by its ops' prepare); None: this one.
    prepared: object | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.kind not in KINDS:
            raise ValueError(f"quantized weight kind {self.kind!r}: one of {', '.join(KINDS)}")
        if k % self.group_size or (self.kind == "u4" and self.group_size % CHUNK):
            raise ValueError(f"group size {self.group_size} does not fit {k} inputs")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups or (self.mins is not None and tuple(self.mins.shape) != groups):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not match a [{n}, {k}] weight in groups of {self.group_size}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): the float weight's shape."""
        n, stored = self.qweight.shape
        return n, stored * 8 // KINDS[self.kind]

    @property
    def nbytes(self) -> int:
        """Bytes as stored: codes, scales and mins (what a decode step streams)."""
        parts = (self.qweight, self.scales, self.mins, self.perm)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def compact(self) -> None:
        """Scales and mins to float16, in place, where every value survives the round trip (so
        the weight is the same; a tied head, sharing this object, sees it too); else as they are."""
        if self.scales.dtype != torch.float32:
            return
        parts = [t for t in (self.scales, self.mins) if t is not None]
        halves = [t.half() for t in parts]
        if all(torch.equal(h.float(), t) for h, t in zip(halves, parts)):
            self.scales, self.mins = halves[0], None if self.mins is None else halves[1]
            self.prepared = None

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The codes as float32 [N, K] (or of `rows` only), in the kernel's input order."""
        q = self.qweight if rows is None else self.qweight[rows]
        if self.kind == "u4":
            chunks = q.view(q.shape[0], -1, CHUNK // 2)  # [N, K / 32, 16]
            q = torch.cat([chunks & 0xF, chunks >> 4], dim=-1).reshape(q.shape[0], -1)
        return q.float()

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [N, K] (or its `rows`), in the checkpoint's input order: the
        reference every kernel is tested against, and the torch backend's linear."""
        q = self.codes(rows)
        n, k = q.shape
        scales = (self.scales if rows is None else self.scales[rows]).float()
        w = q.view(n, -1, self.group_size) * scales.unsqueeze(-1)
        if self.mins is not None:
            w = w + (self.mins if rows is None else self.mins[rows]).float().unsqueeze(-1)
        w = w.reshape(n, k)
        if self.perm is not None:  # column j holds input perm[j]
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins.to(device)
        perm = None if self.perm is None else self.perm.to(device)
        return dataclasses.replace(
            self, qweight=self.qweight.to(device), scales=self.scales.to(device), mins=mins, perm=perm, prepared=None
        )

    def cut(self, split: Split | None, rank: int, size: int, name: str) -> QuantizedWeight:
        """This rank's slice along the same Split as the float weight's ([N, K] coordinates):
        rows are cut as they are; columns in whole groups (and whole u4 chunks), or a ConfigError
        naming the tensor."""
        if split is None or size == 1 and not split.pad:
            return self
        if split.dim == 0:
            return dataclasses.replace(
                self,
                qweight=cut(self.qweight, split, rank, size),
                scales=cut(self.scales, split, rank, size),
                mins=None if self.mins is None else cut(self.mins, split, rank, size),
            )
        if self.perm is not None:
            raise ConfigError(f"weight {name}: act-order (desc_act) weights cannot be split by input columns over {size} ranks")
        ranges = pieces(split, rank, size, self.shape[1])
        if self.group_size == self.shape[1] and len(ranges) == 1:
            # One group per row (per channel or per tensor): each element keeps its scale and min,
            # so the rank's columns are one group of their own (the all-reduce adds the mins' parts).
            start, length = ranges[0]
            per_byte = 8 // KINDS[self.kind]
            if self.kind == "u4" and (start % CHUNK or length % CHUNK):
                raise ConfigError(f"weight {name}: 4-bit chunks of {CHUNK} inputs do not split over {size} ranks")
            qweight = self.qweight[:, start // per_byte : (start + length) // per_byte]
            return dataclasses.replace(self, qweight=qweight, group_size=length)
        if any(start % self.group_size or length % self.group_size for start, length in ranges):
            raise ConfigError(f"weight {name}: groups of {self.group_size} inputs do not split over {size} ranks")
        per_byte = 8 // KINDS[self.kind]

        def columns(t: torch.Tensor, per: int) -> torch.Tensor:
            return torch.cat([t[:, start // per : (start + length) // per] for start, length in ranges], dim=1)

        return dataclasses.replace(
            self,
            qweight=columns(self.qweight, per_byte),
            scales=columns(self.scales, self.group_size),
            mins=None if self.mins is None else columns(self.mins, self.group_size),
        )


def pack_u4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 (K a multiple of 32) -> qweight [N, K / 2] uint8 in the u4 chunk
    order (module docstring)."""
    n, k = q.shape
    chunks = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)  # [N, K / 32, (low, high), 16]
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2)


def quantize_groups(w: torch.Tensor, kind: str, group_size: int) -> QuantizedWeight:
    """w [N, K] float -> the asymmetric min/max quantization of each group (u4, u8), or a
    per-group absmax e4m3: the online `--quantization` and the tests' packer."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    if kind == "e4m3":
        scales = (g.abs().amax(-1) / 448.0).clamp_min(1e-12)  # 448: e4m3's largest finite value
        codes = (g / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(n, k)
        return QuantizedWeight("e4m3", group_size, codes, scales, None)
    top = (1 << KINDS[kind]) - 1
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / top).clamp_min(1e-12)
    q = ((g - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, top).to(torch.uint8).view(n, k)
    return QuantizedWeight(kind, group_size, pack_u4(q) if kind == "u4" else q, scales, lo)
