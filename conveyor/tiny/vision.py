"""make_llava: a random-weight LLaVA-1.5 checkpoint in real Hugging Face layout, made locally (issue 51).

What the Hub hands out for llava-hf/llava-1.5-*-hf, scaled down: config.json (LlavaConfig: a CLIP
vision config and a Llama text config), model.safetensors in transformers' save layout
(`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`), preprocessor_config.json
(CLIPImageProcessor: shortest edge, centre crop, CLIP's mean and std), and the tiny model's
tokenizer with `<image>` added as a special token, whose chat template renders an image part as
`<image>` where the client put it. transformers loads it offline
(LlavaForConditionalGeneration, CLIPImageProcessor, the tokenizer), so tests compare the worker
against it.

By default the tower sees IMAGE_SIZE-pixel squares in PATCH_SIZE patches: (56 / 14)^2 = 16 placeholder tokens
an image, enough to cut a prompt chunk through one. Weights are drawn like the text model's
(conveyor/tiny/checkpoint.py: unit-RMS sublayers, not HF's 0.02), so an image moves the answer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from conveyor.tiny.checkpoint import _weights, _write_json, make_checkpoint

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
VISION_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}
TEXT_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4160,  # the tokenizer's 4096 + <image>, padded as real checkpoints pad
}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# LLaVA-1.5's conversation format: "USER: <image>\n... ASSISTANT:".
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- message['role'] | upper + ': ' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'image' %}{{ '<image>\\n' }}{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ 'ASSISTANT:' }}{%- endif %}\n"
)


def make_llava(path: str | Path, *, seed: int = 0, dtype: str = "float32", image_size: int = IMAGE_SIZE) -> Path:
    """Write the checkpoint into `path` (created if missing) and return it. `image_size`: the
    square the tower sees (336: LLaVA-1.5's, 576 placeholder tokens an image)."""
    root = Path(path)
    make_checkpoint(root, seed=seed, dtype=dtype, **TEXT_SHAPE)  # the text model's files, rewritten below
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    image_token = tokenizer.token_to_id(IMAGE_TOKEN)
    tokenizer.save(str(root / "tokenizer.json"), pretty=True)
    text = _read(root / "config.json")
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {**{k: v for k, v in text.items() if k != "architectures"}, "model_type": "llama"},
        "vision_config": {
            "model_type": "clip_vision_model",
            **VISION_SHAPE,
            "image_size": image_size,
            "patch_size": PATCH_SIZE,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "projection_dim": VISION_SHAPE["hidden_size"],
        },
        "image_token_index": image_token,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "multimodal_projector_bias": True,
        "image_seq_length": (image_size // PATCH_SIZE) ** 2,
        "tie_word_embeddings": False,
        "dtype": text["dtype"],
    }
    _write_json(root / "config.json", config)
    tensors = {_save_name(k): v for k, v in _weights(text, seed, torch.float32).items()}
    tensors |= _vision_weights(seed + 1, TEXT_SHAPE["hidden_size"], image_size)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    _write_json(
        root / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": image_size},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    tokenizer_config = _read(root / "tokenizer_config.json")
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    _write_json(root / "tokenizer_config.json", tokenizer_config)
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return root


def _save_name(name: str) -> str:
    """The text model's tensor name in transformers' LLaVA save layout."""
    return f"language_model.{name}"


def _vision_weights(seed: int, text_hidden: int, image_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d, inter = VISION_SHAPE["hidden_size"], VISION_SHAPE["intermediate_size"]
    tensors: dict[str, torch.Tensor] = {}

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        tensors[f"{name}.weight"] = normal(out_f, in_f, std=gain / math.sqrt(in_f))
        tensors[f"{name}.bias"] = normal(out_f, std=0.1)

    def layer_norm(name: str, size: int) -> None:
        tensors[f"{name}.weight"] = 1.0 + normal(size, std=0.1)
        tensors[f"{name}.bias"] = normal(size, std=0.1)

    t = "vision_tower.vision_model"  # as the Hub's llava-hf checkpoints name it
    num_positions = (image_size // PATCH_SIZE) ** 2 + 1
    tensors[f"{t}.embeddings.class_embedding"] = normal(d, std=1.0)
    tensors[f"{t}.embeddings.patch_embedding.weight"] = normal(d, 3, PATCH_SIZE, PATCH_SIZE, std=1 / math.sqrt(3 * PATCH_SIZE**2))
    tensors[f"{t}.embeddings.position_embedding.weight"] = normal(num_positions, d, std=0.5)
    layer_norm(f"{t}.pre_layrnorm", d)
    for i in range(VISION_SHAPE["num_hidden_layers"]):
        p = f"{t}.encoder.layers.{i}"
        layer_norm(f"{p}.layer_norm1", d)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{p}.self_attn.{proj}", d, d, 2.0 if proj in ("q_proj", "k_proj") else 1.0)
        layer_norm(f"{p}.layer_norm2", d)
        linear(f"{p}.mlp.fc1", inter, d)
        linear(f"{p}.mlp.fc2", d, inter)
    layer_norm(f"{t}.post_layernorm", d)
    # The projector writes image embeddings at about the text embeddings' scale times a few, so
    # an image shifts the answer without drowning the text.
    linear("multi_modal_projector.linear_1", text_hidden, d)
    linear("multi_modal_projector.linear_2", text_hidden, text_hidden, 0.5)
    return {k: v.contiguous() for k, v in tensors.items()}


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))
