"""VisionConfig: a vision-language model's vision tower and projector, as data (issue 51).

Part of ModelConfig (its `vision` field, None for a text model), read once with the rest of
config.json by the family's adapter (gpu/models/llava.py `llava_config`, from its
`vision_config` and top-level fields) and sent to every stage in the JSON config: the ingress
asks it whether the model takes images (config/media.py), the worker builds the tower from it.
No torch here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    tower: str  # the tower's family: "clip" (LLaVA-1.5), "qwen2_vl", "qwen2_5_vl", "siglip" (Gemma 3)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the square the tower takes, in pixels; 0: any size (Qwen2-VL: a grid per image)
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP: quick_gelu (CLIP), gelu
    image_token_id: int  # the placeholder token each image embedding replaces
    # The hidden states the projector reads, by index into (embeddings, layer 1, ..., layer n)
    # as transformers counts them (negative from the end); several are concatenated.
    feature_layers: tuple[int, ...] = (-2,)
    feature_select: str = "default"  # "default": drop the class token; "full": keep it
    projector_act: str = "gelu"
    projector_bias: bool = True
    num_channels: int = 3
    # Qwen2-VL / Qwen2.5-VL (gpu/models/vision/qwen2_vl.py): the patch merger's output width (the
    # language model's hidden size), its side in patches, the frames one patch spans, and
    # Qwen2.5-VL's window attention (the window's side in pixels, 0: none; the layers that attend
    # over the whole image instead).
    out_hidden_size: int = 0
    spatial_merge_size: int = 1
    temporal_patch_size: int = 1
    window_size: int = 0
    full_attention_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # Gemma 3 (gpu/models/gemma3_vl.py): the tokens an image's patches are average-pooled to (a
    # square; mm_tokens_per_image), 0: one per patch.
    pooled_tokens: int = 0

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        if self.pooled_tokens:
            return self.pooled_tokens
        return self.num_patches + (1 if self.feature_select == "full" else 0)
