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
"""

from __future__ import annotations

import enum

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


class StepResult(Struct, tag=5):
    """One forward pass's draws, keyed by sequence: draw d is sequence seq_ids[d]'s token
    sampled_token_ids[d] (a forking row's own draw and each fork's are draws of their own
    sequences). The scheduler matches them to the pass's rows by id, never by position."""

    step: int
    sampled_token_ids: list[int]
    busy_time: float = 0.0  # seconds the device computed this step
    idle_time: float = 0.0  # seconds it waited on the host since the last step ended
    # log p(id) under the model's own distribution (log_softmax of the raw logits, before
    # temperature or filters), one per draw: ranks best_of candidates.
    sampled_logprobs: list[float] = []
    # Empty when no draw's sequence asked for logprobs; else one per draw, the top alternatives
    # under the same raw distribution (empty lists for a draw whose sequence did not ask).
    top_logprobs: list[TopLogprobs] = []
    # Draws whose logits were not finite (NaN, +inf, or every token masked), as indices into
    # the draws: their id is a placeholder 0, and the scheduler ends their sequence with
    # FinishReason.ERROR. The step and the other draws go on.
    failed_draws: list[int] = []
    # Multi-step plans (StepPlan.num_steps > 1) send one result per pass, as each pass ends:
    # `pass_index` is its pass (0-based), `last_pass` True on the plan's final result (which may
    # come early: every row stopped). Pass k's draws are the rows whose num_tokens > k.
    # `masked_draws`: draws the worker skipped because their sequence already stopped inside the
    # window (EOS, a stop token, a failed draw); their id is a placeholder 0.
    pass_index: int = 0
    last_pass: bool = True
    masked_draws: list[int] = []
    seq_ids: list[int] = []  # one per draw: whose token it is (last, as new fields go)
    # Speculative decoding: a row that verified drafts reports a run of consecutive draws of its
    # sequence, the accepted drafts then the token drawn after them, and here (seq_id, drafts
    # verified, drafts accepted) once per such row; a draw after a stopping token is not sent.
    spec_rows: list[tuple[int, int, int]] = []
    # Sequences asking for prompt_logprobs whose prompt tokens this pass predicted (last, as new fields go).
    prompt_logprobs: list[PromptLogprobs] = []
    # Pooling sequences (SamplingParams.pooling) whose prompt this pass finished: their vectors.
    embeddings: list[SeqEmbedding] = []


class SeqEmbedding(Struct):
    seq_id: int
    values: list[float]  # pooled, cut to the request's dimensions, normalized where the model is


class PromptLogprobs(Struct):
    """Prompt tokens [start, start + len(logprobs)) of a sequence, each's log p under the model's
    raw distribution at the position before it (as sampled_logprobs), its rank there (1: the most
    likely), and the params.prompt_logprobs most likely alternatives. start >= 1."""

    seq_id: int
    start: int
    logprobs: list[float]
    ranks: list[int]
    top: list[TopLogprobs] = []  # one per token where params.prompt_logprobs > 0


class TopLogprobs(Struct):
    token_ids: list[int]  # the params.logprobs most likely ids, most likely first
    logprobs: list[float]


class AdapterCommand(Struct, tag=7):
    """From an ingress (/v1/load_lora_adapter, /v1/unload_lora_adapter): serve the LoRA adapter at
    `path` as `name`, or (path None) stop serving it. Answered under request_id with RequestAccepted
    or RequestRejected."""

    request_id: str
    ingress: int
    name: str
    path: str | None = None


SchedulerInbound = ScheduleRequest | AbortRequest | FinishSeqs | WorkerReady | StepResult | StageFailed | AdapterCommand


# --- received by a worker -------------------------------------------------------------------


class NewSeq(Struct):
    """A sequence the worker has not seen (or sees again after preemption), sent once in full."""

    seq_id: int
    token_ids: list[int]  # prompt, plus any outputs already generated (after preemption)
    params: SamplingParams
    num_prompt_tokens: int  # outputs start here: the seeded draw for output i uses index i
    index: int = 0  # choice index within its request: seeded draws mix it in, so samples differ
    # Leading tokens whose KV is already in the blocks its table will name (prefix-cache hit):
    # the worker starts computing after them.
    num_computed_tokens: int = 0
    lora_slot: int = -1  # the device slot holding its adapter (StepPlan.lora_loads); -1: the base weights


class Fork(Struct):
    seq_id: int
    index: int  # choice index of the new sequence


class ScheduledSeq(Struct):
    """One row of a step: compute `num_tokens` more of the sequence's known tokens.

    Before the step, `replaced_blocks` (table position, new block id) rewrite entries of the
    block table (copy-on-write: the plan's copy_blocks filled the new block), then
    `new_block_ids` are appended. A sampling row with `forks` draws one token for itself and
    one per fork from the same logits; each fork starts as a copy of this sequence (tokens,
    computed count, block table) taken after the step, plus its own token.
    """

    seq_id: int
    num_tokens: int
    new_block_ids: list[int] = []
    replaced_blocks: list[tuple[int, int]] = []
    forks: list[Fork] = []
    # Speculative decoding: a one-token decode row may verify up to this many draft tokens the
    # worker proposes after its token (its table holds their slots); its draws then come back as
    # a run of 1 to 1 + num_lookahead draws of the sequence (StepResult).
    num_lookahead: int = 0


class StepPlan(Struct, tag=10):
    """One forward pass (or `num_steps` decode passes). The worker keeps each sequence's tokens, computed count and block table,
    appends what it samples, and drops a sequence when it appears in `finished_seq_ids`."""

    step: int
    new_seqs: list[NewSeq]
    scheduled: list[ScheduledSeq]
    finished_seq_ids: list[int] = []
    copy_blocks: list[tuple[int, int]] = []  # (src, dst) KV block copies, before the forward
    # The engine had nothing to run before this plan: the time since the last step is not a GPU
    # bubble (nobody was waiting), only the time from the plan's arrival on is.
    after_idle: bool = False
    # Multi-step: > 1 runs this many forward passes back to back. Only for plans whose every row
    # decodes (no prompt chunk, no new prompt, no fork): row r then decodes one token per pass in
    # passes 0 .. num_tokens - 1 (its new_block_ids hold all of them), each pass's input being the
    # token the pass before drew, on the device. One StepResult per pass.
    num_steps: int = 1
    # Adapters to place before the forward (a slot's previous adapter is evicted): the plan's
    # new sequences name these slots.
    lora_loads: list[LoraLoad] = []
    # The KV host tier (stages/scheduler/kv_tiers.py), applied before the plan's passes, saves
    # first: (device block, host slot) copies to host memory, then (host slot, device block)
    # copies back, which no row of this plan reads.
    kv_saves: list[tuple[int, int]] = []
    kv_loads: list[tuple[int, int]] = []


class LoraLoad(Struct):
    slot: int
    name: str
    path: str  # a PEFT adapter directory, read and checked by the scheduler (config/lora_adapter.py)


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
    it started, so the router knows which of those it sent are still on their way."""

    engine: int
    num_waiting: int
    num_running: int
    num_kv_blocks_used: int
    num_kv_blocks: int
    num_received: int


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
