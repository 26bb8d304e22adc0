"""ClipVisionTower: CLIP's vision transformer, as LLaVA-1.5 reads it (issue 51).

Pixels [N, 3, S, S] -> patch embeddings (a stride-P convolution), a class token in front, learned
positions, a pre-LayerNorm, then pre-norm encoder layers (bidirectional attention over the
(S/P)^2 + 1 tokens, an MLP); the features are the hidden states of `feature_layers` (index 0: the
embeddings after the pre-LayerNorm, i: after layer i, negative from the end, as transformers'
hidden_states count them), concatenated, the class token dropped unless `feature_select` is
"full". Layers past the deepest one read are not run (LLaVA reads the one before last).

Parameter names are the checkpoint's (`embeddings.patch_embedding`, `pre_layrnorm`,
`encoder.layers.i.self_attn.q_proj`, ...), so loading is a name lookup. The tower runs once per
image, not per token, in plain torch (SDPA for attention); it is replicated on every
tensor-parallel rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config.vision import VisionConfig


def activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGelu()
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        return nn.GELU(approximate="none" if name == "gelu" else "tanh")
    raise ValueError(f"unsupported vision activation {name!r}")


class QuickGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ClipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(config.num_channels, d, config.patch_size, stride=config.patch_size, bias=False)
        self.position_embedding = nn.Embedding(config.num_patches + 1, d)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, 1 + (S/P)^2, D]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (proj(x).view(n, t, self.num_heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # [N, heads, T, D / heads], every token sees every other
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class ClipMlp(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ClipLayer(config) for _ in range(config.num_layers))


class ClipVisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # the checkpoint's spelling
        self.encoder = ClipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # loaded, unread by LLaVA
        num_states = config.num_layers + 1
        self.read = [i % num_states for i in config.feature_layers]  # hidden-state indices, non-negative

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> features [N, tokens, D * len(feature_layers)]."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        kept = {0: x} if 0 in self.read else {}
        for i, layer in enumerate(self.encoder.layers[: max(self.read)], start=1):
            x = layer(x)
            if i in self.read:
                kept[i] = x
        features = torch.cat([kept[i] for i in self.read], dim=-1)
        return features if self.config.feature_select == "full" else features[:, 1:]
