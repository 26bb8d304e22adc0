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
    tower: str  # the tower's family: "clip" (LLaVA-1.5)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the square the tower takes, in pixels
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

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (1 if self.feature_select == "full" else 0)
