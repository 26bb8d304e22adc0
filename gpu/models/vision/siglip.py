"""SiglipVisionTower: SigLIP's vision transformer, as Gemma 3 reads it (issue 51).

Pixels [N, 3, S, S] -> patch embeddings (a stride-P convolution with a bias), learned positions
(one per patch: no class token), the encoder layers, then `post_layernorm`; the output is the
last layer's normalised hidden states [N, (S/P)^2, D], every patch kept. The encoder layers are
CLIP's block unchanged (pre-LayerNorm attention over all the image's patches, then an MLP, here
gelu_pytorch_tanh), so they are gpu/models/vision/clip.py's; what differs is the embeddings (no
class token, a patch bias) and the ends (no pre-LayerNorm, a post-LayerNorm that is read).

Parameter names are the checkpoint's (`embeddings.patch_embedding`, `encoder.layers.i.self_attn.q_proj`,
`post_layernorm`), so loading is a name lookup. Plain torch, once per image, replicated on every
tensor-parallel rank. SigLIP's attention-pooling head is not built: Gemma 3 reads the hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.config.vision import VisionConfig
from conveyor.gpu.models.vision.clip import ClipEncoder


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, d, config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.num_patches, d)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> [N, (S/P)^2, D], patches row by row."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = ClipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C, S, S] -> last hidden states [N, (S/P)^2, D], normalised."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
