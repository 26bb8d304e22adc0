"""Build an EngineConfig from user-facing options: shared by `conveyor serve` and `LLM(...)`.

The front door's job, above both layers: `--model` is resolved to a checkpoint directory (a
conveyor name or a GGUF file is made into one first), which is read with its family's config
adapter (gpu/models/registry.py `read_model_config`); the options are the option() fields of
config/engine_options.py's OPTION_CLASSES, named as the flags with underscores:
`build_engine_config(model, max_num_seqs=64, scheduling_policy="orca")`. Nothing here restates a
default: an option left out (or None) keeps its field's. The model code (torch) is imported only
when a config is built, so `conveyor --help` and the router stay light.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conveyor.config.engine import (
    VISION_BODY_BYTES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    StagesConfig,
)
from conveyor.config.engine_options import OPTION_CLASSES, ModelOptions, SpeculationOptions
from conveyor.config.errors import ConfigError
from conveyor.config.lora import LoraConfig
from conveyor.config.media import MediaConfig
from conveyor.config.model import ModelConfig
from conveyor.config.options import collect
from conveyor.config.speculative import parse_speculative_config
from conveyor.draft_config import read_draft


def resolve_device(device: str) -> str:
    """`auto` is "cuda" when available, else "cpu"; the choices were checked by collect()."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_engine_config(model: str | None = None, **options) -> EngineConfig:
    """`model` is what --model takes (resolve_model; None: the default model); `options` are those of
    `conveyor serve` (module docstring). `chat_template` is a path to a Jinja file or the template
    text itself. Unknown names and values out of bounds are a ConfigError."""
    from conveyor.gpu.models.registry import read_model_config

    fields = collect(tuple(OPTION_CLASSES.values()), {"model": model, **options})
    load = ModelOptions(**fields[ModelOptions])
    device = resolve_device(load.device)
    path, served_name = resolve_model(load.model, device, load.dtype)
    model_config = read_model_config(
        path,
        dtype=None if load.dtype == "auto" else load.dtype,
        max_model_len=load.max_model_len,
        served_name=load.served_model_name or served_name,
        quantization=load.quantization,
    )
    if device == "cpu" and model_config.dtype == "float16":
        # Half-precision matmuls on CPU are slow or missing; bf16 and fp32 are fine.
        model_config = dataclasses.replace(model_config, dtype="float32")
    parallel_fields = fields[ParallelConfig]
    if device == "emulated":
        parallel_fields.setdefault("emulate", "h100")
    elif "emulate" in parallel_fields:
        raise ConfigError(f"--emulate {parallel_fields['emulate']} models a GPU only with --device emulated")
    parallel = ParallelConfig(device=device, **parallel_fields)
    check_tensor_parallel(model_config, parallel)
    scheduler = SchedulerConfig(**fields[SchedulerConfig])
    speculative = parse_speculative_config(fields[SpeculationOptions].get("speculative_config"))
    if speculative is not None and scheduler.num_scheduler_steps > 1:
        raise ConfigError("--num-scheduler-steps above 1 cannot be combined with --speculative-config: pick one")
    if speculative is not None and speculative.model is not None:
        speculative = read_draft(speculative, model_config, parallel)
        if speculative.method == "draft_model" and speculative.draft is not None:
            try:
                check_tensor_parallel(speculative.draft, parallel)
            except ConfigError as e:
                raise ConfigError(f"--speculative-config: the draft model: {e}") from None
    if model_config.vision is not None and (device == "emulated" or speculative is not None):
        # The emulated device models no vision tower's time; a drafter would read placeholder ids, not images.
        what = "--device emulated" if device == "emulated" else "--speculative-config"
        raise ConfigError(f"{what} with a vision-language model ({model_config.architecture}) is not supported yet")
    lora = LoraConfig(**fields[LoraConfig])
    check_lora(lora, model_config)
    if lora.enable_lora and parallel.data_parallel_size > 1:
        raise ConfigError("--enable-lora with --data-parallel-size above 1 is not supported yet (each engine would load each adapter)")
    cache = CacheConfig(**fields[CacheConfig])
    if lora.enable_lora and cache.kv_disk_dir is not None:
        # A block's name covers its adapter's name, not its weights: another adapter under the same
        # name after a restart would read stale KV from disk.
        raise ConfigError("--kv-disk-dir with --enable-lora is not supported yet (KV on disk is keyed by adapter name, not weights)")
    if scheduler.preemption_mode == "swap" and not cache.kv_offloading_size:
        raise ConfigError("--preemption-mode swap needs --kv-offloading-size: a preempted sequence's KV goes to the host tier")
    if cache.kv_disk_dir is not None:
        from conveyor.gpu.kv.disk_dir import open_kv_dir  # torch-free

        open_kv_dir(cache.kv_disk_dir)  # a missing or read-only directory: one line at start-up, before any stage starts
    server = fields[ServerConfig]
    if model_config.vision is not None:
        server["max_body_bytes"] = VISION_BODY_BYTES
    if "chat_template" in server:
        server["chat_template"] = _read_template(server["chat_template"])
    return EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=scheduler,
        parallel=parallel,
        stages=StagesConfig(**fields[StagesConfig]),
        server=ServerConfig(**server),
        speculative=speculative,
        lora=lora,
        media=MediaConfig(**fields[MediaConfig], model_accepts_images=model_config.vision is not None),
    )


def check_lora(lora: LoraConfig, model: ModelConfig) -> None:
    """Each --lora-modules adapter read and checked against the model (config/lora_adapter.py):
    one ConfigError line naming the adapter and what is wrong."""
    if not lora.enable_lora:
        return
    from conveyor.config.lora_adapter import read_adapter_info

    names = set()
    for name, path in lora.modules():
        if name in names or name == model.served_name:
            raise ConfigError(f"--lora-modules: the name {name!r} is taken")
        names.add(name)
        try:
            read_adapter_info(name, path, model, lora.max_lora_rank)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"--lora-modules {name}: {e}") from None


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse a --tensor-parallel-size the model cannot be split over (gpu/parallel/shard.py: a
    dimension splits evenly over the ranks, or, KV heads only, is replicated when it divides
    them), or more ranks than this machine's CUDA devices. One ConfigError line each."""
    tp = parallel.tensor_parallel_size
    if tp == 1:
        return
    flag = f"--tensor-parallel-size {tp}"
    if model.num_heads % tp:
        raise ConfigError(f"{flag}: the model's {model.num_heads} attention heads do not split evenly over {tp} ranks")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ConfigError(f"{flag}: the model's {model.num_kv_heads} KV heads neither split evenly over {tp} ranks nor divide them")
    sizes = {"intermediate_size": model.intermediate_size}
    if model.moe is not None:  # each expert's intermediate dim is split too
        sizes |= {"moe_intermediate_size": model.moe.moe_intermediate_size}
        if model.moe.shared_expert_intermediate_size:
            sizes |= {"shared_expert_intermediate_size": model.moe.shared_expert_intermediate_size}
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"{flag}: the model's {name} {size} does not split evenly over {tp} ranks")
    if parallel.device == "cuda" and parallel.ray_address is None:
        import torch

        if tp > torch.cuda.device_count():
            raise ConfigError(f"{flag}: only {torch.cuda.device_count()} CUDA device(s) visible on this machine")


def resolve_model(model: str | None, device: str, dtype: str) -> tuple[str, str | None]:
    """(checkpoint directory, served name or None for the directory's) for --model: an existing
    path first (a directory, or a .gguf file converted once into the cache), then a name that
    conveyor knows (conveyor/default_model.py); None is the default model."""
    from conveyor import default_model

    # A GGUF's weights are written in the serving dtype: the one asked for, else bfloat16 on a
    # GPU (an emulated one too) and float32 on a CPU (whose half-precision matmuls are slow; float16 becomes float32
    # there anyway, below).
    if device == "cpu":
        gguf_dtype = "bfloat16" if dtype == "bfloat16" else "float32"
    else:
        gguf_dtype = "bfloat16" if dtype == "auto" else dtype
    name = model or default_model.DEFAULT
    source = Path(name).expanduser()
    if source.suffix == ".gguf" and not source.is_dir():
        from conveyor.gpu.loading.gguf import ensure_checkpoint

        return str(ensure_checkpoint(source, gguf_dtype)), source.stem
    if not source.exists():
        named = default_model.checkpoint_for_name(name, gguf_dtype)
        if named is not None:
            return str(named[0]), named[1]
    return name, None


def _read_template(value: str) -> str:
    if "{" in value:  # already template text
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the chat template {value!r}: {e.strerror}") from None
