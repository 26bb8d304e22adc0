"""Build an EngineConfig from user-facing options: shared by `conveyor serve` and `LLM(...)`."""

from __future__ import annotations

import dataclasses

from conveyor.config.engine import (
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    StagesConfig,
)
from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


def build_engine_config(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    kv_cache_gib: float | None = None,
    gpu_memory_utilization: float = 0.90,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    scheduling_policy: str = "splitfuse",
    enable_prefix_caching: bool = True,
    async_scheduling: bool = True,
    max_queued_requests: int | None = None,
    max_queued_tokens: int | None = None,
    tensor_parallel_size: int = 1,
    ingress_workers: int = 1,
    tokenizer_workers: int = 1,
    detokenizer_workers: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    allowed_origins: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> EngineConfig:
    """`chat_template` is a path to a Jinja file or the template text itself."""
    if tensor_parallel_size != 1:
        raise ConfigError("tensor parallelism is not implemented yet; use --tensor-parallel-size 1")
    for name, value in (  # counts that must be positive; None means "not set"
        ("block-size", block_size), ("max-num-batched-tokens", max_num_batched_tokens),
        ("max-num-seqs", max_num_seqs), ("ingress-workers", ingress_workers),
        ("tokenizer-workers", tokenizer_workers), ("detokenizer-workers", detokenizer_workers),
        ("num-kv-blocks", num_kv_blocks), ("max-queued-requests", max_queued_requests),
        ("max-queued-tokens", max_queued_tokens),
    ):  # fmt: skip
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be at least 1, got {value}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ConfigError(f"unknown scheduling policy {scheduling_policy!r}; choose {', '.join(SCHEDULING_POLICIES)}")
    device = resolve_device(device)
    if model is None:
        from conveyor.tiny.checkpoint import ensure_default_model

        model = str(ensure_default_model())
    model_config = ModelConfig.from_pretrained(
        model,
        dtype=None if dtype == "auto" else dtype,
        max_model_len=max_model_len,
        served_name=served_model_name,
    )
    if device == "cpu" and model_config.dtype == "float16":
        # Half-precision matmuls on CPU are slow or missing; bf16 and fp32 are fine.
        model_config = dataclasses.replace(model_config, dtype="float32")
    cache = CacheConfig(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        gpu_memory_utilization=gpu_memory_utilization,
        **({"cpu_kv_cache_gib": kv_cache_gib} if kv_cache_gib is not None else {}),
    )
    return EngineConfig(
        model=model_config,
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=scheduling_policy,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling,
            max_queued_requests=max_queued_requests,
            max_queued_tokens=max_queued_tokens,
        ),
        parallel=ParallelConfig(device=device, tensor_parallel_size=tensor_parallel_size),
        stages=StagesConfig(
            num_ingress=ingress_workers,
            num_tokenizers=tokenizer_workers,
            num_detokenizers=detokenizer_workers,
        ),
        server=ServerConfig(
            host=host,
            port=port,
            api_key=api_key,
            allowed_origins=tuple(allowed_origins),
            chat_template=_read_template(chat_template),
        ),
    )



def _read_template(value: str | None) -> str | None:
    if value is None or "{" in value:  # already template text
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the chat template {value!r}: {e.strerror}") from None
