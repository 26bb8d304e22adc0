"""Every message that crosses a process boundary, grouped by the stage that receives it.

Wire rules (vLLM v1's, and ours): msgspec Structs encoded array-like, defaults omitted, no GC
tracking; new fields only ever go at the end of a struct; one tagged union per inbound socket,
decoded by one typed decoder. A request's data travels in full once; per step only what changed.

    ingress --TokenizeRequest--> tokenizer --ScheduleRequest--> scheduler --StepPlan--> worker
       ^  \\------AbortRequest------------------------------------^  ^          |
       |                                                            +-StepResult-+
       +-- RequestRejected (tokenizer: 400), RequestAccepted / RequestRejected (scheduler: 429),
           DeltaBatch (detokenizer) <--TokenBatch-- scheduler

With data parallelism (several engines) ScheduleRequest and AbortRequest go to the router stage,
which forwards each to one engine's scheduler; each scheduler reports its EngineLoad back.

The step protocol, StepPlan and StepResult with the structs only they carry, is in step.py; the
unions below name them like any other message.
"""

from __future__ import annotations

import enum

from conveyor.wire.images import ContentPart, ImageData, ImageInput
from conveyor.wire.sampling_params import (  # noqa: F401 - every stage imports them from here
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MIN_SAMPLING_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    Pooling,
    SamplingParams,
    StructuredOutput,
)
from conveyor.wire.step import StepPlan, StepResult
from conveyor.wire.struct import Struct


class FinishReason(enum.IntEnum):
    STOP = 1  # EOS, a stop token id (later: a stop string)
    LENGTH = 2  # max_tokens, or the context is full
    ABORT = 3  # the client went away or the request was cancelled
    # The sequence's logits were not finite (NaN, +inf, or every token masked), so no token could
    # be drawn. OpenAI has no such finish reason: the ingress answers it with an error.
    ERROR = 4

    @property
    def openai(self) -> str:
        return self.name.lower()


# --- received by a tokenizer ----------------------------------------------------------------


class ToolCall(Struct):
    """A function call an assistant made, as a later turn carries it back to the chat template."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatMessage(Struct):
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None  # a tool turn: the function's name, where the client gave it
    # A message with images: its content in order, text and images (`content` is then its text
    # parts joined, for what reads text alone). None: `content` is the whole message.
    parts: list[ContentPart] | None = None


class TokenizeRequest(Struct, tag=1):
    request_id: str
    ingress: int  # index of the ingress process that owns the HTTP connection
    params: SamplingParams
    arrival_time: float  # time.time() at the ingress
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    priority: int = 0  # lower runs first; equal priorities are first come first served
    sent_time: float = 0.0  # time.time() when the ingress sent it (per-stage latency)
    tools: str | None = None  # chat: the request's `tools` as JSON text, passed to the chat template
    images: list[ImageData] = []  # the request's images in order; ChatMessage.parts name them by index


TokenizerInbound = TokenizeRequest


# --- received by the scheduler and by every ingress ------------------------------------


class StageFailed(Struct, tag=24):
    """From the launcher, to every ingress and the scheduler: this stage process died (or went
    silent past --stage-timeout) and is being restarted. The requests it held fail: an ingress
    fails those it sent to that tokenizer and that are not admitted yet; the scheduler fails the
    requests streamed through that detokenizer and aborts those owned by that ingress."""

    stage: str
    index: int


# --- received by the scheduler --------------------------------------------------------------


class ScheduleRequest(Struct, tag=2):
    request_id: str
    ingress: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    sent_time: float = 0.0  # time.time() when the tokenizer sent it
    images: list[ImageInput] = []  # preprocessed, in prompt order (wire/images.py)


class AbortRequest(Struct, tag=3):
    request_ids: list[str]


class FinishSeqs(Struct, tag=6):
    """From a detokenizer: these sequences matched a stop string; stop generating them."""

    seq_ids: list[int]


class WorkerReady(Struct, tag=4):
    rank: int
    num_kv_blocks: int  # blocks this rank could allocate; the scheduler uses the minimum
    num_host_slots: int = 0  # KV blocks its host tier holds (--kv-offloading-size); the minimum, too
    kv_block_bytes: int = 0  # one KV block's bytes on this rank, all layers (what a tier moves per block)
    kv_warm: list[tuple[int, int]] = []  # (block name, host slot) read back from --kv-disk-dir, least recently used first
    kv_disk: list[int] = []  # the block names --kv-disk-dir holds for this rank, least recently used first
    num_disk_blocks: int = 0  # blocks --kv-disk-size holds (0: no disk tier)


class KvFetched(Struct, tag=8):
    """From every worker rank, as its disk reads finish (StepPlan.kv_fetches), unasked: each
    (block name, host slot) read and checked into the slot, or missed (no such file, or a bad one).
    Every read is answered once, whether or not a plan is running."""

    rank: int
    fetched: list[tuple[int, int]] = []
    missed: list[tuple[int, int]] = []


class KvDiskChanged(Struct, tag=9):
    """From every worker rank with a disk tier, unasked, as its looks find them (--kv-disk-scan-s):
    block names of this rank's shard that came into --kv-disk-dir (another daemon sharing it wrote
    them) and names that went (evicted by any daemon), each in the order found. A name counts as on
    disk once every rank has reported it (as WorkerReady.kv_disk); gone from one rank, it is gone."""

    rank: int
    came: list[int] = []
    went: list[int] = []


class AdapterCommand(Struct, tag=7):
    """From an ingress (/v1/load_lora_adapter, /v1/unload_lora_adapter): serve the LoRA adapter at
    `path` as `name`, or (path None) stop serving it. Answered under request_id with RequestAccepted
    or RequestRejected."""

    request_id: str
    ingress: int
    name: str
    path: str | None = None


# StepResult: step.py
SchedulerInbound = (
    ScheduleRequest | AbortRequest | FinishSeqs | WorkerReady | StepResult | StageFailed | AdapterCommand | KvFetched | KvDiskChanged
)


# --- received by a worker (StepPlan: step.py) ----------------------------------------------


class InitializeCache(Struct, tag=13):  # tag 11 (a Shutdown nobody sent) is retired, not reused
    """Sent once every rank reported WorkerReady: the pool size all ranks agree on."""

    num_kv_blocks: int


WorkerInbound = StepPlan | InitializeCache


# --- received by a detokenizer --------------------------------------------------------------


class DetokSeq(Struct):
    """A sequence's first appearance at its detokenizer."""

    seq_id: int
    request_id: str
    index: int  # choice index within the request (n > 1)
    ingress: int
    prompt_tail: list[int]  # last prompt tokens: decoding context for the first output tokens
    num_prompt_tokens: int
    skip_special_tokens: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop: list[str] = []  # stop strings (SamplingParams.stop)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings count only from this many output tokens on
    logprobs: bool = False  # turn SeqTokens.logprobs into TextDelta.logprobs


class SeqTokens(Struct):
    seq_id: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0  # sum of the sequence's sampled-token logprobs so far
    # When the sequence asked for logprobs: one entry per token_ids entry.
    logprobs: list[TokenLogprob] = []
    queue_time: float = 0.0  # on the final update: arrival to first scheduled, seconds
    prompt: PromptTokens | None = None  # prompt_logprobs: on the sequence's first update
    embedding: list[float] = []  # a pooling sequence's vector, with its one (discarded) token


class TokenLogprob(Struct):
    logprob: float  # of the sampled token
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # a prompt token's rank in its distribution (1: the most likely); 0: not known


class PromptTokens(Struct):
    """A prompt's tokens with, for each after the first, its TokenLogprob (prompt_logprobs)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]  # len(token_ids) - 1: token i + 1's


class TokenBatch(Struct, tag=12):
    """All new tokens of one scheduler step for the sequences one detokenizer owns."""

    step: int
    new_seqs: list[DetokSeq]
    updates: list[SeqTokens]
    sent_time: float = 0.0  # time.time() when the scheduler sent it
    engine: int = 0  # the engine whose scheduler sent it (steps count per engine)


class EngineStarted(Struct, tag=14):
    """From a scheduler as it starts, before any TokenBatch: sequences of `engine` held from before
    (its previous process died) will get no more tokens. With data parallelism the detokenizers
    outlive an engine's restart, so they drop those."""

    engine: int


DetokenizerInbound = TokenBatch | EngineStarted


# --- received by an ingress -----------------------------------------------------------------


class RequestAccepted(Struct, tag=20):
    """From the scheduler, once the request passed admission control (the queue bounds)."""

    request_id: str
    num_prompt_tokens: int
    engine: int = 0  # the engine (data-parallel index) that admitted it: its failure fails the request


class RequestRejected(Struct, tag=21):
    """An error for the client, in the OpenAI error shape."""

    request_id: str
    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None  # seconds, for a 429: sent as the Retry-After header


class TextDelta(Struct):
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # tokens generated so far for this choice
    num_cached_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[TextLogprob] = []  # one per token in token_ids, when asked for
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    queue_time: float = 0.0  # on the final delta: arrival to first scheduled, seconds
    # prompt_logprobs: one per prompt token, on the first delta of the prompt's first choice. The
    # first token's has its text only: nothing predicts it (logprob NaN, rank 0).
    prompt_logprobs: list[TextLogprob] = []
    embedding: list[float] = []  # a pooling request's vector (its text is no answer)


class TextLogprob(Struct):
    """A token as the client sees it: its text, its UTF-8 bytes, its logprob."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[TextLogprob] = []
    token_id: int = -1  # set for prompt tokens and their alternatives (vLLM's prompt_logprobs keys them by id)
    rank: int = 0  # a prompt token's rank in its distribution (1: the most likely)


class DeltaBatch(Struct, tag=22):
    deltas: list[TextDelta]
    sent_time: float = 0.0  # time.time() when the detokenizer sent it


class EngineStatus(Struct, tag=23):
    """From the launcher. `ready` False: the engine stopped or is restarting (in-flight requests
    fail, new ones get 503 with Retry-After). `draining`: the daemon is shutting down; requests
    in flight finish, new ones get 503, and the ingress says `Drained` once it holds none."""

    ready: bool
    draining: bool = False
    # None: the whole daemon (every engine). An index: that engine alone (data parallelism): its
    # requests in flight fail; the ingress stays ready while another engine is.
    engine: int | None = None


IngressInbound = RequestAccepted | RequestRejected | DeltaBatch | EngineStatus | StageFailed


# --- received by the router (data parallelism only) -----------------------------------------


class EngineLoad(Struct, tag=40):
    """From each scheduler, at most every LOAD_REPORT_INTERVAL_S while busy and once when idle:
    what the router balances on. `num_received` counts the ScheduleRequests it has received since
    it started, so the router knows which of those it sent are still on their way.
    `num_host_blocks`: the host tier's capacity in blocks (--kv-offloading-size; 0: none); the
    engine's prefix cache spans the device pool and the host tier."""

    engine: int
    num_waiting: int
    num_running: int
    num_kv_blocks_used: int
    num_kv_blocks: int
    num_received: int
    num_host_blocks: int = 0


# ScheduleRequest from tokenizers, AbortRequest from ingresses, EngineLoad from schedulers,
# EngineStatus from the launcher (which engines are ready).
RouterInbound = ScheduleRequest | AbortRequest | EngineLoad | EngineStatus


# --- received by the launcher ---------------------------------------------------------------


class StageReady(Struct, tag=30):
    stage: str
    index: int


class Heartbeat(Struct, tag=31):
    """Sent by every ready stage from its main loop, at least every stage_timeout_s / 5: a stage
    whose loop is stuck (a hung kernel, SIGSTOP) goes silent and is declared dead."""

    stage: str
    index: int
    pid: int


class Drained(Struct, tag=32):
    """From an ingress while draining: it holds no request in flight any more."""

    index: int


LauncherInbound = StageReady | Heartbeat | Drained
