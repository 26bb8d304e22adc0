"""Engine configuration: one frozen dataclass per concern, gathered in EngineConfig.

`conveyor serve` builds an EngineConfig once from the command line, writes it to the run
directory as JSON (msgspec), and every stage process reads it back; the Python API builds the
same object in-process. Nothing mutates it afterwards.

A field made with `option(...)` is also a user setting: its flag, default, help and bound are
declared there once, and `conveyor serve`'s flags and `build_engine_config`'s keywords derive
from it (config/options.py).
"""

from __future__ import annotations

import dataclasses
import enum

from conveyor.config.errors import ConfigError
from conveyor.config.lora import LoraConfig
from conveyor.config.media import MediaConfig
from conveyor.config.model import ModelConfig
from conveyor.config.options import option
from conveyor.config.speculative import SpeculativeConfig
from conveyor.gpu.emulated.devices import DEVICE_NAMES

# --kv-cache-dtype: what the paged KV cache stores, as a torch dtype name; auto: the model's dtype.
# fp8 is e4m3 (float8_e4m3fn) with one scale per layer for keys and one for values
# (gpu/kv/kv_fp8.py): half the bytes of bfloat16, so twice the tokens in the same memory.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV block", minimum=1)
    # A fixed pool size wins; None: the worker sizes the pool from free memory.
    num_kv_blocks: int | None = option(None, "fix the KV pool size", minimum=1, none="from free memory")
    gpu_memory_utilization: float = option(0.90, "CUDA: fraction of device memory the worker may hold")
    # 2 GiB, vLLM CPU's pool as its peer script serves it: the default model's float32 KV is 45 KiB
    # a token, so 1 GiB held 91 sequences of 256 tokens and a burst of 200 ran at 1.79 req/s
    # against 2.24 at 2 GiB (docs/benchmarks.md, issue 29).
    cpu_kv_cache_gib: float = option(2.0, "CPU: memory for the KV pool in GiB", flag="kv-cache-gib")
    kv_cache_dtype: str = option(
        "auto", "what the KV cache stores: auto (the model's dtype) or fp8 (e4m3, per-layer scales)", choices=tuple(KV_CACHE_DTYPES)
    )
    # The tiers beyond the device pool (stages/scheduler/kv_tiers.py, gpu/kv/): vLLM's flag name.
    kv_offloading_size: float = option(
        0.0, "host memory in GiB for prefix-cache KV blocks beyond the device pool (0: no host tier)", minimum=0
    )
    kv_disk_dir: str | None = option(
        None, "directory keeping the host tier's KV blocks across restarts (needs --kv-offloading-size)", none="no disk tier"
    )
    kv_disk_size: float = option(64.0, "GiB of --kv-disk-dir's files; least recently used go past it", minimum=0)
    # A look stats the 256 shard directories and lists those that changed (gpu/kv/disk_news.py):
    # 0.6-0.7 ms for 100k files unchanged, measured on ext4. Another daemon's block joins the index
    # within about twice the period.
    kv_disk_scan_s: float = option(
        1.0, "seconds between looks for blocks other daemons sharing --kv-disk-dir wrote (0: never)", minimum=0
    )

    def __post_init__(self) -> None:
        if self.kv_disk_dir is not None and not self.kv_offloading_size:
            raise ConfigError("--kv-disk-dir needs --kv-offloading-size: the disk keeps the host tier's blocks")

    def kv_dtype(self, model_dtype: str) -> str:
        """The KV cache's torch dtype name for a model of `model_dtype` ("bfloat16", "float8_e4m3fn")."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


class SchedulingPolicy(str, enum.Enum):
    """How a step's token budget is spent. A str enum: it compares equal to its name and travels
    in the JSON config as that name.

    splitfuse: decodes first, then prompt chunks filling the budget exactly (Dynamic SplitFuse).
    prefill_first: whole prompts in steps of their own, decodes only when no prompt waits (vLLM
      before chunked prefill).
    orca: decodes plus whole prompts that fit, never split.
    """

    SPLITFUSE = "splitfuse"
    PREFILL_FIRST = "prefill_first"
    ORCA = "orca"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = option(2048, "token budget per forward pass (decodes + prompt chunks)", minimum=1)
    max_num_seqs: int = option(256, "sequences running at once", minimum=1)
    policy: SchedulingPolicy = option(
        SchedulingPolicy.SPLITFUSE, "splitfuse, or the baselines prefill_first and orca", flag="scheduling-policy"
    )
    # Two steps in flight: docs/architecture.md ("Overlap"). Off: each plan waits for the last result.
    async_scheduling: bool = option(True, "plan the next step while the current one computes")
    enable_prefix_caching: bool = option(True, "reuse the KV of cached full blocks across requests")
    preemption_mode: str = option(
        "recompute",
        "a preempted sequence's KV: recompute it when it resumes, or swap it to the host tier and back (needs --kv-offloading-size)",
        choices=("recompute", "swap"),
    )
    # Multi-step windows (stages/scheduler/windows.py): docs/architecture.md ("Overlap").
    num_scheduler_steps: int = option(1, "decode passes per plan when every row decodes (multi-step)", minimum=1)
    # Admission bounds, on by default so one client cannot fill the server: past them new
    # requests get a 429 with Retry-After. None turns a bound off (0 on the command line).
    max_queued_requests: int | None = option(
        1024, "waiting requests past which new ones get 429 (0: no bound)", zero_is_unbounded=True
    )
    max_queued_tokens: int | None = option(
        1 << 20, "waiting prompt tokens past which new ones get 429 (0: no bound)", zero_is_unbounded=True
    )


# gpu/emulated: what an emulated device's pass times come from.
EMULATE_COSTS = ("table", "roofline")
# gpu/backends: auto is triton on CUDA and cpu (the C++ kernels) on a CPU.
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# torch.set_float32_matmul_precision's values, strictest first.
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")
# The router's policies (stages/router/): see docs/architecture.md.
ROUTING_POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    device: str = "cpu"  # "cpu", "cuda" or "emulated": resolved from the --device option at build time
    # --device emulated: the GPU whose passes are modelled (gpu/emulated/, a row of gpu/emulated/devices.py).
    emulate: str | None = option(None, "with --device emulated: the GPU to model", choices=DEVICE_NAMES, none="h100")
    # Its pass times: the device's calibration table of measured kernel times where it has one for
    # the model (gpu/emulated/calibrated.py), else the roofline; or the roofline alone.
    emulate_cost: str = option(
        "table", "with --device emulated: pass times from measured kernel times (table) or a bare roofline", choices=EMULATE_COSTS
    )
    # Worker ranks one engine's model is split over (gpu/parallel/): one process per rank, a
    # torch.distributed group (gloo on a CPU, NCCL on CUDA).
    tensor_parallel_size: int = option(1, "worker ranks (devices) one engine's model is split over", minimum=1)
    # Engines (a scheduler, its worker ranks, its own KV pool) behind one ingress, tokenizer and
    # detokenizer pool; with more than one, the router stage picks each request's engine.
    data_parallel_size: int = option(1, "engines serving behind one endpoint (each a scheduler and its ranks)", minimum=1)
    routing_policy: str = option(
        "cache_aware",
        "how the router picks an engine: cache_aware (prefix affinity, then load), round_robin, least_loaded",
        choices=ROUTING_POLICIES,
    )
    # An existing Ray cluster to place engines on ("auto": the one this machine belongs to);
    # None: every process runs on this machine.
    ray_address: str | None = option(None, "place engine ranks on this Ray cluster ('auto': the local one's)", none="this machine")
    attention_backend: str = option(
        "auto",
        "attention backend and ops: auto (triton on CUDA, cpu on a CPU), torch (reference), cpu (C++ kernels), "
        "triton (Triton kernels; on a CPU only under TRITON_INTERPRET=1)",
        choices=ATTENTION_BACKENDS,
    )
    # CUDA graphs (gpu/step/cuda_graphs.py): decode-only steps replay a graph captured per padded
    # batch size (1, 2, 4, 8, then steps of 8 up to the cap or --max-num-seqs). CUDA only.
    enforce_eager: bool = option(False, "never capture CUDA graphs (nor record CPU kernel programs): every step runs eagerly")
    max_cuda_graph_batch_size: int = option(256, "largest decode batch replayed from a CUDA graph", minimum=1)
    # torch.set_float32_matmul_precision in the worker (gpu/step/platform.py): a float32 product may
    # round its inputs to a faster format, accumulating and returning float32. What changes: on a
    # CPU with AMX, `medium` lets oneDNN's GEMMs (prefill, and steps of 17+ rows: onednn_linear.py)
    # take bfloat16 inputs, about 2x a prefill step; elsewhere on a CPU nothing. On CUDA, `high`
    # and `medium` allow TF32. Greedy tokens may then differ from float32's (docs/benchmarks/cpu-isa.md,
    # "Prefill on AMX"), so the default leaves float32 alone.
    float32_matmul_precision: str | None = option(
        None,
        "float32 matmuls: highest (float32), high or medium (inputs rounded to TF32 or bfloat16 where the device "
        "multiplies those faster: AMX on a CPU), as torch.set_float32_matmul_precision",
        choices=FLOAT32_MATMUL_PRECISIONS,
        none="torch's own (highest, unless the process set it)",
    )

    @property
    def device_label(self) -> str:
        """What the device is, for logs and metric labels: cpu, cuda, or emulated-h100."""
        return f"emulated-{self.emulate}" if self.device == "emulated" else self.device


@dataclasses.dataclass(frozen=True)
class StagesConfig:
    """How many processes each scalable stage runs."""

    num_ingress: int = option(1, "HTTP processes sharing the port", flag="ingress-workers", minimum=1)
    num_tokenizers: int = option(1, "tokenizer processes", flag="tokenizer-workers", minimum=1)
    num_detokenizers: int = option(1, "detokenizer processes", flag="detokenizer-workers", minimum=1)


VISION_BODY_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address the HTTP server listens on (the only network listener)")
    port: int = option(8000, "TCP port of the HTTP server")
    run_dir: str = ""  # private 0700 directory holding the ipc sockets; set by the launcher
    # A request body's cap; a vision model's is VISION_BODY_BYTES (build_engine_config): base64
    # images ride in the body, a phone photo alone is several MiB.
    max_body_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    # When set, every route but /health and /metrics requires it. The CLI also reads it from
    # --api-key-file or CONVEYOR_API_KEY (conveyor/cli.py).
    api_key: str | None = option(
        None,
        "require this key (Authorization: Bearer or X-Api-Key); visible in ps: prefer CONVEYOR_API_KEY or --api-key-file",
        none="none",
    )
    allowed_origins: tuple[str, ...] = option((), "CORS origins allowed to call the API ('*' for any)", none="none")
    # Jinja text overriding the checkpoint's chat template; the option takes a file or the text.
    chat_template: str | None = option(None, "Jinja file (or text) overriding the checkpoint's chat template", none="the checkpoint's")
    # Tool calls and reasoning in chat answers (stages/ingress/): which text format the served
    # model writes them in. None: guessed from the model's chat template.
    tool_call_parser: str | None = option(
        None, "how the model writes tool calls: hermes, llama3_json or mistral", none="from the model"
    )
    reasoning_parser: str | None = option(None, "split <think>...</think> into reasoning_content: qwen3 or deepseek_r1", none="none")
    # Stored /v1/responses answers (stages/ingress/responses_api/store.py), per ingress process:
    # what previous_response_id, GET and cancel find. Least recently used go first past the size.
    responses_store_size: int = option(1024, "responses kept for previous_response_id and GET /v1/responses/{id}", positive=True)
    responses_store_ttl_s: float = option(
        3600.0, "seconds a stored response stays retrievable", flag="responses-store-ttl", positive=True
    )
    # Sequences one HTTP request may start (prompts x max(n, best_of)): past it, a 400.
    max_seqs_per_request: int = option(256, "sequences one request may start (prompts x n)", positive=True)
    # HTTP hardening, per ingress process: a client slower than these is disconnected.
    # header_timeout_s runs from connection (or the next request's first byte) to full headers.
    header_timeout_s: float = option(
        10.0, "seconds a client has to send a request's headers", flag="http-header-timeout", positive=True
    )
    body_timeout_s: float = option(  # from the headers to the end of the body
        30.0, "seconds a client has to send a request's body", flag="http-body-timeout", positive=True
    )
    keepalive_timeout_s: float = option(
        15.0, "seconds an idle keep-alive connection stays open", flag="http-keepalive-timeout", positive=True
    )
    max_keepalive_requests: int = option(
        1000, "requests per connection before it is closed", flag="http-max-keepalive-requests", positive=True
    )
    # Past it new connections wait in the listen backlog.
    max_connections: int = option(1024, "open HTTP connections per ingress process", positive=True)
    # Chat: special tokens written inside message content are encoded as plain text unless this
    # is set (then a user could forge `<|eot_id|>` and a role header).
    special_tokens_in_content: bool = option(
        False,
        "encode special tokens written inside chat message content as special tokens "
        "(off: they are plain text, so users cannot forge roles)",
        flag="chat-content-special-tokens",
    )
    # Liveness and shutdown (the launcher).
    stage_timeout_s: float = option(
        30.0,
        "seconds of silence (no heartbeat) after which a stage is declared dead",
        flag="stage-timeout",
        positive=True,
    )
    drain_timeout_s: float = option(30.0, "on SIGTERM, seconds in-flight requests get to finish", flag="drain-timeout", positive=True)
    max_engine_restarts: int = option(3, "engine failures in --restart-window before the daemon exits", positive=True)
    restart_window_s: float = option(300.0, "seconds over which engine failures are counted", flag="restart-window", positive=True)
    # Stage inboxes that other nodes reach (engines placed by Ray: stages/ray/), as pairs of
    # ("stage-index", "tcp://ip:port"), CurveZMQ on every one (wire/curve.py); a stage not named
    # here listens on its ipc:// socket in the run directory. Addresses only: the keys travel in
    # the environment. Set by the launcher.
    endpoints: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    stages: StagesConfig = StagesConfig()
    server: ServerConfig = ServerConfig()
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: no speculation
    lora: LoraConfig = LoraConfig()  # --enable-lora and its adapters
    media: MediaConfig = MediaConfig()  # images the ingress takes (config/media.py)

    def replace(self, **changes) -> EngineConfig:
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
