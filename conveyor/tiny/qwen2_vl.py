"""make_qwen2_vl: a random-weight Qwen2-VL or Qwen2.5-VL checkpoint in real Hugging Face layout,
made locally (issue 51).

What transformers 5's save_pretrained writes for Qwen2VLForConditionalGeneration /
Qwen2_5_VLForConditionalGeneration, scaled down: config.json (the language model in text_config, its
rope_parameters with `mrope_section`; the tower in vision_config; the vision token ids),
model.safetensors in the Hub's names (`model.*`, `lm_head.*`, `visual.*`),
preprocessor_config.json (Qwen2VLImageProcessor: min/max pixels, patch 14, merge 2, CLIP's mean and
std), and the tiny Qwen2 tokenizer with the Qwen2-VL special tokens (<|im_start|>, <|im_end|>,
<|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>), whose chat template renders an
image part as <|vision_start|><|image_pad|><|vision_end|> where the client put it. transformers
loads it offline (the model classes, Qwen2VLImageProcessorPil, the tokenizer), so tests compare
the worker against it.

Kept small for 2 cores: images of 56x56 to MAX_PIXELS pixels make 4 to 20 placeholder tokens. The
rope base is small (ROPE_THETA) so that every M-RoPE section turns visibly over a short prompt: with
Qwen's 1e6 the width section would hardly move and a wrong position would hide in rounding. Weights
are drawn at unit scale (conveyor/tiny/checkpoint.py's gains), so an image moves the answer.
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
from conveyor.tiny.vision import CLIP_MEAN, CLIP_STD

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 14, 2, 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 20  # at most 20 placeholder tokens an image
ROPE_THETA = 100.0
MROPE_SECTION = [4, 6, 6]  # of head_dim / 2 = 16 frequencies, in Qwen2-VL's 16:24:24 proportion
TEXT_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4160,  # the tokenizer's 4096 + 6 specials, padded as real checkpoints pad
}
TOWERS: dict[str, dict[str, Any]] = {
    "2": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 4, "hidden_act": "quick_gelu"},
    # windows of 56 / 14 / 2 = 2 merge units a side, the middle layer attending over the whole image
    "2.5": {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "hidden_act": "silu"}
    | {"window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2},
}
ARCHITECTURES = {"2": ("Qwen2VLForConditionalGeneration", "qwen2_vl"), "2.5": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl")}

# Qwen2-VL's conversation format (ChatML, a default system turn, the vision markers).
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)


def make_qwen2_vl(path: str | Path, *, seed: int = 0, dtype: str = "float32", version: str = "2") -> Path:
    """Write the checkpoint into `path` (created if missing) and return it. `version`: "2"
    (Qwen2-VL) or "2.5" (Qwen2.5-VL: another tower, the same language model)."""
    if version not in TOWERS:
        raise ValueError(f"unknown Qwen2-VL version {version!r}; choose one of {', '.join(TOWERS)}")
    root = Path(path)
    make_checkpoint(root, "Qwen2ForCausalLM", seed=seed, dtype=dtype, rope_theta=ROPE_THETA, **TEXT_SHAPE)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer.save(str(root / "tokenizer.json"), pretty=True)
    text = json.loads((root / "config.json").read_text(encoding="utf-8"))
    architecture, model_type = ARCHITECTURES[version]
    tower = TOWERS[version]
    rope = {**text.pop("rope_parameters"), "mrope_section": MROPE_SECTION}
    text = {k: v for k, v in text.items() if k != "architectures"}
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": {**text, "model_type": f"{model_type}_text", "rope_parameters": rope},
        "vision_config": {
            "model_type": f"{model_type}_vision",
            **tower,
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH,
            ("hidden_size" if version == "2" else "out_hidden_size"): TEXT_SHAPE["hidden_size"],
        },
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "dtype": text["dtype"],
    }
    _write_json(root / "config.json", config)
    tensors = _weights({**text, "architectures": ["Qwen2ForCausalLM"]}, seed, torch.float32)
    tensors |= _tower_weights(version, seed + 1)
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, root / "model.safetensors", metadata={"format": "pt"})
    _write_json(
        root / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "min_pixels": MIN_PIXELS,
            "max_pixels": MAX_PIXELS,
            "patch_size": PATCH_SIZE,
            "merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH,
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    tokenizer_config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    _write_json(root / "tokenizer_config.json", tokenizer_config)
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return root


def _tower_weights(version: str, seed: int) -> dict[str, torch.Tensor]:
    """The tower under `visual.`, in the order and with the names transformers gives it."""
    gen = torch.Generator().manual_seed(seed)
    spec = TOWERS[version]
    d = spec["embed_dim"] if version == "2" else spec["hidden_size"]
    inner = d * spec["mlp_ratio"] if version == "2" else spec["intermediate_size"]
    wide, out = d * MERGE_SIZE**2, TEXT_SHAPE["hidden_size"]
    tensors: dict[str, torch.Tensor] = {}

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        tensors[f"{name}.weight"] = normal(out_f, in_f, std=gain / math.sqrt(in_f))
        tensors[f"{name}.bias"] = normal(out_f, std=0.1)

    def norm(name: str, size: int) -> None:  # Qwen2-VL's LayerNorm has a bias; Qwen2.5-VL's RMSNorm has none
        tensors[f"{name}.weight"] = 1.0 + normal(size, std=0.1)
        if version == "2":
            tensors[f"{name}.bias"] = normal(size, std=0.1)

    fan_in = 3 * TEMPORAL_PATCH * PATCH_SIZE**2
    tensors["visual.patch_embed.proj.weight"] = normal(d, 3, TEMPORAL_PATCH, PATCH_SIZE, PATCH_SIZE, std=1 / math.sqrt(fan_in))
    for i in range(spec["depth"]):
        p = f"visual.blocks.{i}"
        norm(f"{p}.norm1", d)
        linear(f"{p}.attn.qkv", 3 * d, d, gain=2.0)  # sharpened, so a patch's 2D position matters
        linear(f"{p}.attn.proj", d, d)
        norm(f"{p}.norm2", d)
        if version == "2":
            linear(f"{p}.mlp.fc1", inner, d)
            linear(f"{p}.mlp.fc2", d, inner)
        else:
            linear(f"{p}.mlp.gate_proj", inner, d)
            linear(f"{p}.mlp.up_proj", inner, d)
            linear(f"{p}.mlp.down_proj", d, inner)
    norm("visual.merger.ln_q", d)
    linear("visual.merger.mlp.0", wide, wide)
    # Image rows a few times the text embeddings' scale: an image moves the answer without drowning the text.
    linear("visual.merger.mlp.2", out, wide, gain=0.5)
    return {k: v.contiguous() for k, v in tensors.items()}
