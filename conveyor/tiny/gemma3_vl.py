"""make_gemma3_vl: a random-weight Gemma 3 vision checkpoint (Gemma3ForConditionalGeneration) in real
Hugging Face layout, made locally (issue 51).

What transformers 5's save_pretrained writes for Gemma3ForConditionalGeneration, scaled down:
config.json (a Gemma 3 text_config with sliding and global layers and a rope per layer type, a
SigLIP vision_config, mm_tokens_per_image and the boi / eoi / image token ids), model.safetensors
in its save names (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, the
lm_head tied), preprocessor_config.json (Gemma3ImageProcessor: a resize to the tower's square,
bilinear, mean and std 0.5, no pan-and-scan), processor_config.json (image_seq_length), and the
tiny tokenizer with Gemma 3's turn and image tokens, whose chat template (Gemma 3's) renders an
image part as <start_of_image>. transformers loads it offline (the model, Gemma3ImageProcessorPil,
the tokenizer and Gemma3Processor), so tests compare the worker against it.

Kept small for 2 cores: 64-pixel images in 8-pixel patches, 64 patches pooled to 16 tokens. The
window (SLIDING_WINDOW) is shorter than a prompt, so windowed layers cut through images and
text. Gemma's norms are centred on 0 (they scale by 1 + w); the embeddings are small and the final
norm large (the head is tied), so answers vary and an image moves them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from conveyor.tiny.checkpoint import _write_json, make_checkpoint

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
SPECIAL_TOKENS = ("<start_of_turn>", "<end_of_turn>", BOI, EOI, IMAGE)
IMAGE_SIZE, PATCH_SIZE, IMAGE_TOKENS = 64, 8, 16
SLIDING_WINDOW = 12
TEXT_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 4160,  # the tokenizer's 4096 + 5 specials, padded as real checkpoints pad
}
VISION_SHAPE: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}

# Gemma 3's chat template (its system turn folded into the first user turn, "model" for the
# assistant, image parts as <start_of_image>), without its role-alternation check.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}\n"
    "{%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}\n"
    "{%- else -%}{%- for item in message['content'] -%}\n"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}\n"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}\n"
    "{%- endfor -%}{%- endif -%}\n"
    "{{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}\n"
)


def make_gemma3_vl(path: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the checkpoint into `path` (created if missing) and return it."""
    root = Path(path)
    make_checkpoint(root, seed=seed, dtype=dtype, **{k: v for k, v in TEXT_SHAPE.items() if k != "head_dim"})
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer.save(str(root / "tokenizer.json"), pretty=True)
    base = json.loads((root / "config.json").read_text(encoding="utf-8"))
    text = {
        "model_type": "gemma3_text",
        **TEXT_SHAPE,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 24,  # != head_dim, so the scale is read
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": base["bos_token_id"],
        "eos_token_id": [*base["eos_token_id"], ids["<end_of_turn>"]],
        "pad_token_id": 0,
        "dtype": base["dtype"],
    }
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            **VISION_SHAPE,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "num_channels": 3,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6,
            "vision_use_head": False,
        },
        "mm_tokens_per_image": IMAGE_TOKENS,
        "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI],
        "image_token_index": ids[IMAGE],
        "tie_word_embeddings": True,
        "dtype": base["dtype"],
    }
    _write_json(root / "config.json", config)
    tensors = _text_weights(seed) | _vision_weights(seed + 1)
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, root / "model.safetensors", metadata={"format": "pt"})
    _write_json(
        root / "preprocessor_config.json",
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "resample": 2,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": None,
            "do_pan_and_scan": None,
            "pan_and_scan_max_num_crops": None,
            "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None,
        },
    )
    _write_json(root / "processor_config.json", {"image_seq_length": IMAGE_TOKENS, "processor_class": "Gemma3Processor"})
    tokenizer_config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config["extra_special_tokens"] = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE}
    _write_json(root / "tokenizer_config.json", tokenizer_config)
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    generation = json.loads((root / "generation_config.json").read_text(encoding="utf-8"))
    _write_json(root / "generation_config.json", {**generation, "eos_token_id": text["eos_token_id"]})
    return root


def _text_weights(seed: int) -> dict[str, torch.Tensor]:
    """Gemma 3's language model under `language_model.model.`; norms centred on 0 (scale 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = TEXT_SHAPE["hidden_size"], TEXT_SHAPE["intermediate_size"], TEXT_SHAPE["vocab_size"]
    heads, kv_heads, head_dim = TEXT_SHAPE["num_attention_heads"], TEXT_SHAPE["num_key_value_heads"], TEXT_SHAPE["head_dim"]
    tensors: dict[str, torch.Tensor] = {}

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        tensors[f"{name}.weight"] = normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm(name: str, size: int = h, offset: float = 0.0) -> None:
        tensors[f"{name}.weight"] = offset + normal(size, std=0.1)

    p = "language_model.model"
    # RMS 0.1 once scaled by sqrt(h): Gemma's post-norms write unit-RMS sublayer outputs, and with
    # tied embeddings a larger current-token component makes the model repeat its last input.
    tensors[f"{p}.embed_tokens.weight"] = normal(vocab, h, std=0.1 / math.sqrt(h))
    for i in range(TEXT_SHAPE["num_hidden_layers"]):
        q = f"{p}.layers.{i}"
        norm(f"{q}.input_layernorm")
        linear(f"{q}.self_attn.q_proj", heads * head_dim, h)
        linear(f"{q}.self_attn.k_proj", kv_heads * head_dim, h)
        linear(f"{q}.self_attn.v_proj", kv_heads * head_dim, h)
        linear(f"{q}.self_attn.o_proj", h, heads * head_dim)
        norm(f"{q}.self_attn.q_norm", head_dim, offset=0.5)  # sharpened after the q/k norms, so the context matters
        norm(f"{q}.self_attn.k_norm", head_dim, offset=0.5)
        norm(f"{q}.post_attention_layernorm")
        norm(f"{q}.pre_feedforward_layernorm")
        linear(f"{q}.mlp.gate_proj", inter, h)
        linear(f"{q}.mlp.up_proj", inter, h)
        linear(f"{q}.mlp.down_proj", h, inter)
        norm(f"{q}.post_feedforward_layernorm")
    norm(f"{p}.norm", offset=30.0)  # the tied embeddings are small: logits of std ~3
    return tensors


def _vision_weights(seed: int) -> dict[str, torch.Tensor]:
    """The SigLIP tower under `vision_tower.` and the projector, as transformers 5 saves them."""
    gen = torch.Generator().manual_seed(seed)
    d, inter = VISION_SHAPE["hidden_size"], VISION_SHAPE["intermediate_size"]
    tensors: dict[str, torch.Tensor] = {}

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        tensors[f"{name}.weight"] = normal(out_f, in_f, std=gain / math.sqrt(in_f))
        tensors[f"{name}.bias"] = normal(out_f, std=0.1)

    def layer_norm(name: str) -> None:
        tensors[f"{name}.weight"] = 1.0 + normal(d, std=0.1)
        tensors[f"{name}.bias"] = normal(d, std=0.1)

    t = "vision_tower"
    tensors[f"{t}.embeddings.patch_embedding.weight"] = normal(d, 3, PATCH_SIZE, PATCH_SIZE, std=1 / math.sqrt(3 * PATCH_SIZE**2))
    tensors[f"{t}.embeddings.patch_embedding.bias"] = normal(d, std=0.1)
    tensors[f"{t}.embeddings.position_embedding.weight"] = normal((IMAGE_SIZE // PATCH_SIZE) ** 2, d, std=0.5)
    for i in range(VISION_SHAPE["num_hidden_layers"]):
        p = f"{t}.encoder.layers.{i}"
        layer_norm(f"{p}.layer_norm1")
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"{p}.self_attn.{proj}", d, d, 2.0 if proj in ("q_proj", "k_proj") else 1.0)
        layer_norm(f"{p}.layer_norm2")
        linear(f"{p}.mlp.fc1", inter, d)
        linear(f"{p}.mlp.fc2", d, inter)
    layer_norm(f"{t}.post_layernorm")
    tensors["multi_modal_projector.mm_soft_emb_norm.weight"] = normal(d, std=0.1)
    # Image rows of RMS ~0.3, a few times the scaled text embeddings': an image moves the answer without drowning the text.
    tensors["multi_modal_projector.mm_input_projection_weight"] = normal(d, TEXT_SHAPE["hidden_size"], std=0.3 / math.sqrt(d))
    return {k: v.contiguous() for k, v in tensors.items()}
