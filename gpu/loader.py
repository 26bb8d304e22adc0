"""Load a Hugging Face safetensors checkpoint into our model.

The model is built on the meta device (no random init), materialised empty on the target device
in ModelConfig.dtype, then every parameter is filled from the checkpoint by name: our parameter
names are the safetensors names (fused projections too: Phi-3's qkv_proj and gate_up_proj are
fused in our model as in the checkpoint), then the family's `after_load` adjusts them once.
Either `model.safetensors` or a sharded checkpoint described by `model.safetensors.index.json`
is read. With tensor parallelism (backend.tp) the model's layers have one rank's shapes, and each
tensor is cut to the rank's slice as it is read, by the split its layer declares
(gpu/parallel/shard.py `cut`); a parameter only rank 0 has (a row-parallel bias) is skipped on
the others. Problems a user can cause (no weight files, a tensor
missing or of the wrong shape) raise ConfigError with one clear line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends import Backend, torch_backend
from conveyor.gpu.models import LlamaForCausalLM, build_model
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.gpu.parallel.shard import cut, splits_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that we compute instead of load.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(config: ModelConfig, device: torch.device | str, backend: Backend | None = None) -> LlamaForCausalLM:
    """Build the model for `config` on `device` with the checkpoint's weights, in eval mode,
    running on `backend` (None: the torch backend), whose ops prepare the loaded weights."""
    device = torch.device(device)
    dtype = getattr(torch, config.dtype)
    backend = backend or torch_backend(config, device)
    with torch.device("meta"):
        model = build_model(config, rope_device=device, backend=backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each parameter its own storage: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    load_stacked = getattr(model, "load_checkpoint_tensors", None)  # MoE: stacked experts are not a name lookup
    if callable(load_stacked):
        load_stacked(checkpoint_tensors(config.path))
    else:
        load_weights(model, config.path, backend.tp)
    if hasattr(model, "after_load"):  # a family's one-time transform of its weights (Gemma's norm offset)
        model.after_load()
    model = model.eval().requires_grad_(False)
    backend.ops.prepare(model)
    return model


def load_weights(model: torch.nn.Module, path: str | Path, tp: TensorParallel = SINGLE) -> None:
    """Copy every parameter of `model` from the safetensors files in `path`, casting dtype; each
    cut to rank tp.rank's slice where its layer splits it."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    splits = splits_of(model)
    missing = set(params)
    for file, name, f in _entries(path):
        if name not in params:
            continue  # unknown extras (e.g. a tied lm_head shipped anyway) are ignored, unread
        try:
            tensor = cut(f.get_tensor(name), splits.get(name), tp.rank, tp.size)
        except ValueError as e:
            raise ConfigError(f"weight {name} in {file.name}: {e}: checkpoint and config.json disagree") from None
        param = params[name]
        if tensor.shape != param.shape:
            raise ConfigError(
                f"weight {name} in {file.name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(param.shape)}: checkpoint and config.json disagree"
            )
        with torch.no_grad():
            param.copy_(tensor)
        missing.discard(name)
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} weight(s): {shown}")


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint's safetensors files, read one at a time."""
    for _, name, f in _entries(path):
        yield name, f.get_tensor(name)


def _entries(path: str | Path) -> Iterator[tuple[Path, str, Any]]:
    """(file, tensor name, open safetensors handle) of every tensor we may load, file by file."""
    for file in weight_files(Path(path)):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"cannot read weight file {file}: {e}") from None
        with handle as f:
            for name in f.keys():
                if not name.endswith(SKIPPED_SUFFIXES):
                    yield file, name, f


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single or sharded."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"cannot read {index}: {e!r}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
    elif (root / SINGLE_FILE).is_file():
        files = [root / SINGLE_FILE]
    else:
        raise ConfigError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}: only safetensors checkpoints load")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ConfigError(f"checkpoint {root} is missing weight file(s): {', '.join(absent)}")
    return files
