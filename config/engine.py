"""Engine configuration: one frozen dataclass per concern, gathered in EngineConfig.

`conveyor serve` builds an EngineConfig once from the command line, writes it to the run
directory as JSON (msgspec), and every stage process reads it back; the Python API builds the
same object in-process. Nothing mutates it afterwards.
"""

from __future__ import annotations

import dataclasses

from conveyor.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # fixed pool size; None: sized by the worker from free memory
    gpu_memory_utilization: float = 0.90  # CUDA: fraction of device memory the worker may hold
    cpu_kv_cache_gib: float = 1.0  # CPU: KV pool size when num_kv_blocks is not given


SCHEDULING_POLICIES = ("splitfuse", "prefill_first", "orca")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the per-step token budget (decodes + prompt chunks)
    max_num_seqs: int = 256  # sequences running at once
    # splitfuse: decodes first, then prompt chunks filling the budget exactly (Dynamic SplitFuse).
    # prefill_first: whole prompts in steps of their own, decodes only when no prompt waits
    #   (vLLM before chunked prefill). orca: decodes plus whole prompts that fit, never split.
    policy: str = "splitfuse"
    # Plan step n+1 while step n computes, so the device never waits on the scheduler (vLLM's
    # --async-scheduling, SGLang's overlap scheduler). Off: each plan waits for the last result.
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    # Admission bounds, on by default so one client cannot fill the server: past them new
    # requests get a 429 with Retry-After. None turns a bound off.
    max_queued_requests: int | None = 1024  # waiting requests
    max_queued_tokens: int | None = 1 << 20  # waiting prompt tokens


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    device: str = "cpu"  # "cpu" or "cuda"
    tensor_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class StagesConfig:
    """How many processes each scalable stage runs."""

    num_ingress: int = 1
    num_tokenizers: int = 1
    num_detokenizers: int = 1


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: str = ""  # private 0700 directory holding the ipc sockets; set by the launcher
    max_body_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    api_key: str | None = None  # when set, every route but /health and /metrics requires it
    allowed_origins: tuple[str, ...] = ()  # CORS: origins allowed to call the API ("*" for any)
    chat_template: str | None = None  # Jinja text overriding the checkpoint's chat template
    # Sequences one HTTP request may start (prompts x max(n, best_of)): past it, a 400.
    max_seqs_per_request: int = 256
    # HTTP hardening, per ingress process: a client slower than these is disconnected.
    header_timeout_s: float = 10.0  # from connection (or the next request's first byte) to full headers
    body_timeout_s: float = 30.0  # from the headers to the end of the body
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this
    max_keepalive_requests: int = 1000  # requests per connection before it is closed
    max_connections: int = 1024  # open connections; past it new ones wait in the listen backlog
    # Chat: special tokens written inside message content are encoded as plain text unless this
    # is set (then a user could forge `<|eot_id|>` and a role header).
    special_tokens_in_content: bool = False
    # Liveness and shutdown (the launcher).
    stage_timeout_s: float = 30.0  # a stage silent this long (no heartbeat) is declared dead
    drain_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    max_engine_restarts: int = 3  # engine failures within restart_window_s before the daemon exits
    restart_window_s: float = 300.0


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    stages: StagesConfig = StagesConfig()
    server: ServerConfig = ServerConfig()

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def config_to_json(config: EngineConfig) -> bytes:
    """The config as written to the run directory: without the API key, which never touches the
    disk (stages read it from the environment: config/env.py)."""
    import msgspec

    server = dataclasses.replace(config.server, api_key=None)
    return msgspec.json.encode(dataclasses.replace(config, server=server))


def config_from_json(data: bytes) -> EngineConfig:
    import msgspec

    return msgspec.json.decode(data, type=EngineConfig)
