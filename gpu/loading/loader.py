"""Load a Hugging Face safetensors checkpoint into our model.

The model is built on the meta device (no random init), materialised empty on the target device
in ModelConfig.dtype, then filled by its own `load_weights` from the checkpoint's (name, tensor)
stream (gpu/models/base.py: a name lookup, the MoE families' stacked experts mapped), and
adjusted once by its `after_load`. Either `model.safetensors` or a sharded checkpoint described
by `model.safetensors.index.json` is read, one tensor at a time. With tensor parallelism
(backend.tp) the model's layers have one rank's shapes, and the model cuts each tensor to the
rank's slice as it is read. A quantized checkpoint's layers are built without a float weight and
take theirs from its scheme (gpu/quant/load.py), so the start-up log's weight bytes are as
stored. Per-layer fp8 KV cache scales, where the checkpoint has them, go to their attention
layers first (gpu/quant/kv_scales.py). Problems a user can cause (no weight files, a tensor missing or of the wrong shape)
raise ConfigError with one clear line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends import Backend, torch_backend
from conveyor.gpu.models import CausalLM, build_model
from conveyor.gpu.models.layers import Linear, VocabParallelEmbedding
from conveyor.gpu.quant.kv_scales import KVScaleLoad
from conveyor.gpu.quant.load import QuantLoad
from conveyor.gpu.quant.scheme import scheme_for

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that we compute instead of load.
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)

log = logging.getLogger(__name__)


def load_model(config: ModelConfig, device: torch.device | str, backend: Backend | None = None) -> CausalLM:
    """Build the model for `config` on `device` with the checkpoint's weights, in eval mode,
    running on `backend` (None: the torch backend), whose ops prepare the loaded weights."""
    device = torch.device(device)
    dtype = getattr(torch, config.dtype)
    backend = backend or torch_backend(config, device)
    with torch.device("meta"):
        model = build_model(config, rope_device=device, backend=backend)
    quant = None
    if config.quantization is not None:
        scheme = scheme_for(config.quantization)
        quant = QuantLoad(model, scheme, checkpoint_header(config.path), backend.tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each parameter its own storage: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    kv_scales = KVScaleLoad(model)
    tensors = kv_scales.route(checkpoint_tensors(config.path))
    model.load_weights(tensors if quant is None else quant.route(tensors, device))
    if quant is not None:
        quant.finish()
    model.after_load()
    model = model.eval().requires_grad_(False)
    backend.ops.prepare(model)
    log.info("weights: %.1f MiB as stored (%s)", stored_bytes(model) / 2**20, describe_storage(config, quant))
    if backend.attn.kv_fp8:
        log.info(
            "fp8 KV cache: scales of %d of %d layers from the checkpoint, 1.0 elsewhere", len(kv_scales.layers), config.num_layers
        )
    return model


def stored_bytes(model: CausalLM) -> int:
    """The model's weights in bytes as they sit in memory: float parameters, and quantized weights
    as packed (a tied head counted once)."""
    tensors = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    weights = [m.quantized for m in model.modules() if isinstance(m, (Linear, VocabParallelEmbedding)) and m.quantized is not None]
    packed = {id(w): w.nbytes for w in weights}
    return sum(tensors.values()) + sum(packed.values())


def describe_storage(config: ModelConfig, quant: QuantLoad | None) -> str:
    if quant is None:
        return config.dtype
    kinds = sorted({f"{w.kind}/g{w.group_size}" for w in quant.quantized_weights()})
    return f"{quant.scheme.describe()}: {len(quant.layers)} layers quantized ({', '.join(kinds)}), the rest {config.dtype}"


def checkpoint_header(path: str | Path) -> dict[str, torch.dtype]:
    """Every checkpoint tensor's name and dtype, read from the files' headers (no data)."""
    header: dict[str, torch.dtype] = {}
    for file in weight_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    header[name] = _DTYPES.get(f.get_slice(name).get_dtype(), torch.uint8)
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"cannot read weight file {file}: {e}") from None
    return header


# safetensors' dtype names -> torch's (the ones quantized checkpoints use).
_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint's safetensors files, read one at a time, except the
    buffers we compute instead (SKIPPED_SUFFIXES)."""
    for file in weight_files(Path(path)):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (OSError, SafetensorError) as e:
            raise ConfigError(f"cannot read weight file {file}: {e}") from None
        with handle as f:
            for name in f.keys():
                if not name.endswith(SKIPPED_SUFFIXES):
                    yield name, f.get_tensor(name)


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
