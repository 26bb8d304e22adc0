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
    max_queued_requests: int | None = None,  # None: the default bound; 0: no bound
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
    server_options: dict | None = None,
) -> EngineConfig:
    """`chat_template` is a path to a Jinja file or the template text itself. `server_options`
    sets other ServerConfig fields by name (the hardening limits: `SERVER_OPTIONS`)."""
    server_options = dict(server_options or {})
    unknown = set(server_options) - set(ServerConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown server options: {', '.join(sorted(unknown))}")
    for name, flag, *_ in SERVER_OPTIONS:
        value = server_options.get(name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag} must be positive, got {value}")
    if tensor_parallel_size != 1:
        raise ConfigError("tensor parallelism is not implemented yet; use --tensor-parallel-size 1")
    for name, value in (  # counts that must be positive; None means "not set"
        ("block-size", block_size), ("max-num-batched-tokens", max_num_batched_tokens),
        ("max-num-seqs", max_num_seqs), ("ingress-workers", ingress_workers),
        ("tokenizer-workers", tokenizer_workers), ("detokenizer-workers", detokenizer_workers),
        ("num-kv-blocks", num_kv_blocks),
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
            max_queued_requests=_queue_bound("max_queued_requests", max_queued_requests),
            max_queued_tokens=_queue_bound("max_queued_tokens", max_queued_tokens),
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
            **{name: value for name, value in server_options.items() if value is not None},
        ),
    )



# ServerConfig fields that `conveyor serve` exposes as flags: (field, flag, type, help). The
# defaults live on ServerConfig alone; the CLI shows them from there.
SERVER_OPTIONS = (
    ("max_seqs_per_request", "max-seqs-per-request", int, "sequences one request may start (prompts x n)"),
    ("header_timeout_s", "http-header-timeout", float, "seconds a client has to send a request's headers"),
    ("body_timeout_s", "http-body-timeout", float, "seconds a client has to send a request's body"),
    ("keepalive_timeout_s", "http-keepalive-timeout", float, "seconds an idle keep-alive connection stays open"),
    ("max_keepalive_requests", "http-max-keepalive-requests", int, "requests per connection before it is closed"),
    ("max_connections", "max-connections", int, "open HTTP connections per ingress process"),
    ("stage_timeout_s", "stage-timeout", float, "seconds of silence after which a stage is declared dead"),
    ("drain_timeout_s", "drain-timeout", float, "on SIGTERM, seconds in-flight requests get to finish"),
    ("max_engine_restarts", "max-engine-restarts", int, "engine failures in --restart-window before the daemon exits"),
    ("restart_window_s", "restart-window", float, "seconds over which engine failures are counted"),
)


def server_option_default(name: str):
    return ServerConfig.__dataclass_fields__[name].default


def _queue_bound(name: str, value: int | None) -> int | None:
    """None: SchedulerConfig's default bound; 0: no bound; else at least 1."""
    if value is None:
        return SchedulerConfig.__dataclass_fields__[name].default
    if value < 0:
        raise ConfigError(f"--{name.replace('_', '-')} must be 0 (no bound) or more, got {value}")
    return value or None


def _read_template(value: str | None) -> str | None:
    if value is None or "{" in value:  # already template text
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read the chat template {value!r}: {e.strerror}") from None
