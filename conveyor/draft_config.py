"""The draft of `--speculative-config` with a `model`: its checkpoint read and checked against the
target's once, at start-up, so a draft that cannot serve is one ConfigError line, never a
failure at the first request.

- `draft_model`: any checkpoint the registry reads, with the target's vocabulary (the same size
  and, where both hold a tokenizer.json, the same token strings for the same ids).
- `eagle3`: a head in the published EAGLE-3 layout for Llama (config.json: a one-layer Llama
  config, `architectures` ["LlamaForCausalLMEagle3"], plus `draft_vocab_size`, optionally
  `target_hidden_size`, `norm_before_residual` and `eagle_config.eagle_aux_hidden_state_layer_ids`;
  weights `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, optionally `embed_tokens`). It
  reads the target's hidden states, so it must have been trained for this target's width.

With tensor parallelism a draft model is sharded as the target (the same divisibility checks);
an EAGLE-3 head is whole on every rank.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from conveyor.config.engine import ParallelConfig
from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.config.speculative import Eagle3Layout, SpeculativeConfig

FLAG = "--speculative-config"
# config.json `architectures` of EAGLE-3 heads for Llama: the published checkpoints' name, and vLLM's.
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def read_draft(spec: SpeculativeConfig, target: ModelConfig, parallel: ParallelConfig) -> SpeculativeConfig:
    """`spec` with its draft's config (and an EAGLE-3 head's layout) filled in."""
    assert spec.model is not None
    if not Path(spec.model).is_dir():
        raise ConfigError(f"{FLAG}: the draft model {spec.model!r} is not a directory")
    if spec.method == "eagle3":
        if parallel.device == "emulated":
            raise ConfigError(f"{FLAG}: an EAGLE-3 head reads the model's hidden states, which an emulated device has none of")
        head, layout = read_eagle3_config(spec.model, target)
        return dataclasses.replace(spec, draft=head, eagle=layout)
    return dataclasses.replace(spec, draft=read_draft_config(spec.model, target))


def read_draft_config(path: str, target: ModelConfig) -> ModelConfig:
    """The draft model's ModelConfig (in the target's dtype and context length), once it is
    checked to share the target's vocabulary."""
    from conveyor.gpu.models.registry import read_model_config

    draft = read_model_config(path, dtype=target.dtype, max_model_len=target.max_model_len)
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{FLAG}: the draft's vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}")
    mine, theirs = Path(target.path) / "tokenizer.json", Path(path) / "tokenizer.json"
    if mine.exists() and theirs.exists() and _vocabulary(mine) != _vocabulary(theirs):
        raise ConfigError(f"{FLAG}: the draft's tokenizer maps tokens to other ids than the model's (another vocabulary)")
    return draft


def read_eagle3_config(path: str, target: ModelConfig) -> tuple[ModelConfig, Eagle3Layout]:
    """An EAGLE-3 head's layer config (a Llama layer's, its rope tables as long as the target's
    context) and its layout, checked against the target: its width, vocabulary and layers."""
    from conveyor.gpu.models.llama import llama_config

    hf = json.loads((Path(path) / "config.json").read_text()) if (Path(path) / "config.json").is_file() else {}
    if not set(hf.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        got = hf.get("architectures") or "no config.json architectures"
        raise ConfigError(f"{FLAG}: {path} is not an EAGLE-3 head (architectures {got!r}; expected {EAGLE3_ARCHITECTURES[0]})")
    adapters = {name: llama_config for name in EAGLE3_ARCHITECTURES}
    head = ModelConfig.from_checkpoint(path, adapters, dtype=target.dtype)
    # Its positions are the target's: the rope table must reach the target's context.
    longest = max(head.max_position_embeddings, target.max_model_len)
    head = dataclasses.replace(head, max_model_len=target.max_model_len, max_position_embeddings=longest)
    if head.num_layers != 1:
        raise ConfigError(f"{FLAG}: the EAGLE-3 head has {head.num_layers} layers; heads of one layer are served")
    if head.vocab_size != target.vocab_size:
        raise ConfigError(f"{FLAG}: the EAGLE-3 head's vocabulary has {head.vocab_size} tokens, the model's {target.vocab_size}")
    width = int(hf.get("target_hidden_size", head.hidden_size))
    if width != target.hidden_size:
        raise ConfigError(f"{FLAG}: the EAGLE-3 head reads hidden states of width {width}, the model's are {target.hidden_size}")
    draft_vocab = int(hf.get("draft_vocab_size") or head.vocab_size)
    if not 0 < draft_vocab <= head.vocab_size:
        raise ConfigError(
            f"{FLAG}: the EAGLE-3 head's draft_vocab_size {draft_vocab} is not within its vocabulary of {head.vocab_size}"
        )
    layout = Eagle3Layout(draft_vocab, _aux_layers(hf, target.num_layers), bool(hf.get("norm_before_residual", False)))
    return head, layout


def _aux_layers(hf: dict[str, Any], num_layers: int) -> tuple[int, int, int]:
    """The three target layers whose inputs the head reads: its config's, or the layout's default
    (an early, the middle and a late layer: 2, L // 2, L - 3)."""
    eagle = hf.get("eagle_config")
    eagle = eagle if isinstance(eagle, dict) else {}
    named = eagle.get("eagle_aux_hidden_state_layer_ids", hf.get("eagle_aux_hidden_state_layer_ids"))
    layers = tuple(named) if named else (2, num_layers // 2, num_layers - 3)
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
        raise ConfigError(
            f"{FLAG}: the EAGLE-3 head reads layers {list(layers)}; it needs three of the model's {num_layers} layers"
            " (config.json eagle_config.eagle_aux_hidden_state_layer_ids)"
        )
    return layers


def _vocabulary(tokenizer_json: Path) -> dict:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    return {
        "vocab": data.get("model", {}).get("vocab"),
        "added": [(t.get("id"), t.get("content")) for t in data.get("added_tokens", [])],
    }
