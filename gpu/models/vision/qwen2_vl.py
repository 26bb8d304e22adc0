"""Qwen2VisionTower: Qwen2-VL's and Qwen2.5-VL's vision transformer, with its config reader (issue 51).

Pixels [patches, C * T * P * P] (stages/tokenizer/images/qwen2_vl.py: each image's patches in merge
windows, window by window, the merge^2 patches of a window row by row) and each image's grid
(t, h, w) in patches -> per image, [t * h * w / merge^2, out_hidden_size] embeddings, one per
placeholder token. On the way:
- patch embedding: the checkpoint's Conv3d over (T, P, P) with stride its kernel, run as one matmul
  over the flattened patch (the same dot products);
- 2D rotary embedding: the first half of each head's rotary angles from the patch's row, the second
  from its column (head_dim / 4 frequencies each, then the halves repeated as rotate_half pairs);
- pre-norm blocks whose attention is bidirectional within one frame of one image (transformers'
  cu_seqlens), LayerNorm + fc1/act/fc2 (Qwen2-VL, QuickGELU) or RMSNorm + SwiGLU (Qwen2.5-VL);
- Qwen2.5-VL's window attention: every layer not in `full_attention_layers` attends only within
  windows of window_size / patch / merge merge units a side, tiled from each frame's top left (the
  last row and column of windows cut short);
- the patch merger: a norm per patch, then an MLP over each merge window's merge^2 patches.

Tokens stay in the input order throughout: a window is a gather of token rows, its output scattered
back, where transformers permutes the whole stream into window order and undoes it after the
merger. Attention is per token set, so the two agree; no inverse permutation is needed here.

Parameter names are the checkpoint's under `visual.` (the Hub's files) or `model.visual.`
(transformers 5's modules): `patch_embed.proj`, `blocks.i.{norm1,attn.qkv,attn.proj,norm2,mlp.*}`,
`merger.{ln_q,mlp.0,mlp.2}`, so loading is a name lookup. Plain torch (SDPA), replicated on every
tensor-parallel rank: the tower runs once per image.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config.errors import ConfigError
from conveyor.config.vision import VisionConfig
from conveyor.gpu.models.base import check_loaded, copy_weight
from conveyor.gpu.models.vision.clip import QuickGelu
from conveyor.gpu.models.vision.segments import Segments, frame_segments, window_segments

CHECKPOINT_PREFIXES = ("model.visual.", "visual.")  # transformers 5's module path, the Hub's files
TOWERS = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl"}  # config.json model_type -> tower


def qwen2_vl_vision_config(hf: dict[str, Any]) -> VisionConfig:
    """The tower from a Qwen2-VL / Qwen2.5-VL config.json (its vision_config and image_token_id).
    Qwen2-VL names the tower's width embed_dim and the merger's output hidden_size; Qwen2.5-VL
    names them hidden_size and out_hidden_size."""
    tower = TOWERS.get(str(hf.get("model_type")))
    if tower is None:
        raise ConfigError(f"not a Qwen2-VL or Qwen2.5-VL config: model_type {hf.get('model_type')!r}")
    v = hf.get("vision_config") or {}
    qwen2 = tower == "qwen2_vl"
    width = int(v["embed_dim"] if qwen2 else v["hidden_size"])
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        tower=tower,
        hidden_size=width,
        intermediate_size=width * int(v.get("mlp_ratio", 4)) if qwen2 else int(v["intermediate_size"]),
        num_layers=int(v["depth"]),
        num_heads=int(v["num_heads"]),
        image_size=0,  # any size: each image brings its grid
        patch_size=int(v.get("patch_size", 14)),
        layer_norm_eps=1e-6,  # transformers' constant for both towers
        hidden_act=str(v.get("hidden_act", "quick_gelu" if qwen2 else "silu")),
        image_token_id=int(hf.get("image_token_id", 151655)),
        num_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        out_hidden_size=int(v["hidden_size"] if qwen2 else v["out_hidden_size"]),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        window_size=0 if qwen2 else int(v.get("window_size", 112)),
        full_attention_layers=() if qwen2 else tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


class RmsNorm(nn.Module):
    """Qwen2.5-VL's: normalized in float32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def norm(config: VisionConfig, dim: int) -> nn.Module:
    if config.tower == "qwen2_vl":
        return nn.LayerNorm(dim, eps=config.layer_norm_eps)
    return RmsNorm(dim, config.layer_norm_eps)


def activation(name: str) -> nn.Module:
    acts: dict[str, type[nn.Module]] = {"silu": nn.SiLU, "gelu": nn.GELU, "quick_gelu": QuickGelu}
    if name not in acts:
        raise ValueError(f"unsupported vision activation {name!r}")
    return acts[name]()


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        t, p = config.temporal_patch_size, config.patch_size
        self.proj = nn.Conv3d(config.num_channels, config.hidden_size, (t, p, p), stride=(t, p, p), bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C * T * P * P] -> [N, D]: the kernel flattened in the patch's (C, T, P, P) order."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.flatten(1))


class Attention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segments: Segments) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        q, k = rotate(q, rotary), rotate(k, rotary)
        return self.proj(segments.attend(q, k, v).reshape(n, d))


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [N, heads, head_dim] rotated by cos, sin [N, head_dim], in float32 as transformers does."""
    cos, sin = (r[:, None] for r in rotary)
    x32 = x.float()
    half = x32.shape[-1] // 2
    turned = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + turned * sin).to(x.dtype)


class Mlp(nn.Module):
    """Qwen2-VL: fc2(act(fc1 x)). Qwen2.5-VL: down_proj(act(gate_proj x) * up_proj x), with biases."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gated = config.tower == "qwen2_5_vl"
        if self.gated:
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)
        else:
            self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = norm(config, config.hidden_size)
        self.attn = Attention(config)
        self.norm2 = norm(config, config.hidden_size)
        self.mlp = Mlp(config)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        wide = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = norm(config, config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N / merge^2, out]: a merge window's patches are consecutive rows."""
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class Qwen2VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.tower not in TOWERS.values():
            raise ValueError(f"not a Qwen2-VL tower: {config.tower!r}")
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.merger = PatchMerger(config)

    def encode(self, pixels: torch.Tensor, grids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """pixels [sum of t*h*w, C*T*P*P], images in order, -> each image's [t*h*w / merge^2, out]."""
        m = self.config.spatial_merge_size
        grid_list = [(int(t), int(h), int(w)) for t, h, w in grids]
        num_patches = sum(t * h * w for t, h, w in grid_list)
        if pixels.shape[0] != num_patches:
            raise ValueError(f"{pixels.shape[0]} patches for grids {grid_list} ({num_patches} patches)")
        device = pixels.device
        x = self.patch_embed(pixels)  # [N, D]
        rotary = self.rotary(grid_list, device)
        frames = frame_segments(grid_list, device)
        windows = frames
        if self.config.window_size:
            units = self.config.window_size // m // self.config.patch_size  # a window's side in merge units
            windows = window_segments(grid_list, m, units, device)
        full = set(self.config.full_attention_layers)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, frames if (i in full or not self.config.window_size) else windows)
        merged = self.merger(x)
        return list(merged.split([t * h * w // (m * m) for t, h, w in grid_list]))

    def rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim]: each patch's (row, column) in its image, in the pixels' order."""
        m = self.config.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grids:
            r = torch.arange(h, device=device)[:, None].expand(h, w)
            c = torch.arange(w, device=device)[None, :].expand(h, w)
            # [h, w] -> [h/m, w/m, m, m]: merge windows row by row, then a window's patches row by row
            rows.append(r.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
            cols.append(c.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        # head_dim / 4 frequencies shared by rows and columns, in float32 whatever the weights' dtype
        half = self.config.hidden_size // self.config.num_heads // 2
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
        angles = torch.cat([torch.cat(rows)[:, None] * inv_freq, torch.cat(cols)[:, None] * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]
        return angles.cos(), angles.sin()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], path: str = "") -> None:
        """Fill every parameter from (name, tensor) pairs named under CHECKPOINT_PREFIXES; other names
        (the language model's) are skipped."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in tensors:
            prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
            if prefix is None or name[len(prefix) :] not in params:
                continue
            copy_weight(name, tensor, params[name[len(prefix) :]])
            missing.discard(name[len(prefix) :])
        check_loaded(missing, path)
