"""A fake engine for the ingress tests: the stages behind an ingress, answering from a script.

FakeEngine is a thread that binds the tokenizer-0, scheduler-0 and launcher-0 sockets of a run
directory and answers every TokenizeRequest the way the real stages would (the tokenizer's 400,
then the scheduler's admission), deterministically:
  - a prompt containing TOO_LONG: RequestRejected(400, code="context_length_exceeded");
  - a prompt containing QUEUE_FULL: RequestRejected(429, retry_after=2.5), as a full scheduler;
  - a prompt containing SLOW: accepted, then one token every 20 ms that never finishes, until an
    AbortRequest for it arrives;
  - a prompt containing NO_ACCEPT: no RequestAccepted, the first TextDelta implies it;
  - a prompt containing FAILS_AT_ONCE: accepted, and right behind the acceptance a delta whose
    draw failed (FinishReason.ERROR), as a request whose first step cannot sample;
  - anything else: accepted, then one DeltaBatch per step holding a delta for every choice still
    running (`params.num_samples` of them). Choice j, token i is `token(j, i)` and weighs
    `token_logprob(j)`; choice j runs `choice_length(j)` tokens (finish "stop"), or max_tokens if
    that is not more (finish "length"). Like the detokenizer, it ends a choice at the first
    stop string (matched across tokens; cut, or kept with include_stop_str_in_output) or stop
    token id (its text dropped), with stop_reason saying which; with params.logprobs set, each
    delta carries its token's TextLogprob and `top_alternatives` of it.
Every delta says num_prompt_tokens (the prompt's words) and, for a prompt containing CACHED,
num_cached_tokens = num_prompt_tokens - 1.
The real ingress runs against it in tests/ingress_server.py.
"""

from __future__ import annotations

import queue
import threading

import zmq

from conveyor.wire.addresses import address
from conveyor.wire.channel import Receiver, Sender
from conveyor.wire.messages import (
    AbortRequest,
    DeltaBatch,
    EngineStatus,
    FinishReason,
    IngressInbound,
    LauncherInbound,
    RequestAccepted,
    RequestRejected,
    SchedulerInbound,
    StageReady,
    TextDelta,
    TextLogprob,
    TokenizeRequest,
    TokenizerInbound,
)

NUM_TOKENS = 5
MAX_MODEL_LEN = 256  # the context of the model it stands in for (tests/ingress_server.py's checkpoint)


def choice_length(index: int) -> int:
    return max(1, NUM_TOKENS - index)


def token(index: int, i: int) -> tuple[str, int]:
    """Text and id of choice `index`'s token i: " t{i}" and 100 + i for choice 0."""
    return (f" t{i}" if index == 0 else f" t{i}/{index}"), 100 + i + 20 * index


def token_logprob(index: int) -> float:
    """Choice 0 takes -1.0 a token, choice 1 -1.5, choice 2 -0.5, and so on around."""
    return -0.5 * (1 + (index + 1) % 3)


def choice_output(index: int, max_tokens: int | None) -> tuple[str, list[int], str, float]:
    """What choice `index` generates: text, ids, finish reason and cumulative logprob."""
    length = choice_length(index)
    num_tokens, reason = (max_tokens, "length") if max_tokens is not None and max_tokens <= length else (length, "stop")
    tokens = [token(index, i) for i in range(num_tokens)]
    return "".join(t for t, _ in tokens), [i for _, i in tokens], reason, num_tokens * token_logprob(index)


def top_alternatives(index: int, i: int, k: int) -> list[TextLogprob]:
    """The k alternatives the fake reports for choice `index`'s token i: the token itself first."""
    text, _ = token(index, i)
    alts = [text] + [f" alt{a}" for a in range(1, k)]
    return [TextLogprob(t, list(t.encode()), token_logprob(index) - a) for a, t in enumerate(alts)]


def choice_deltas(req: TokenizeRequest, index: int, num_prompt: int, num_cached: int) -> list[TextDelta]:
    """Choice `index`'s deltas, one per token, ended early by a stop string or stop token id."""
    params = req.params
    _, ids, reason, _ = choice_output(index, params.max_tokens)
    texts = [token(index, i)[0] for i in range(len(ids))]
    starts = [sum(map(len, texts[:i])) for i in range(len(ids) + 1)]
    joined = "".join(texts)
    # The text kept, the final token, and why it stopped (a stop string or a stop token id).
    end, last = len(joined), len(ids) - 1
    stop_reason: str | int | None = None
    matches = sorted((joined.find(stop), stop) for stop in params.stop if stop in joined)
    if matches:  # the earliest wins
        pos, stop_reason = matches[0]
        end = pos + len(stop_reason) if params.include_stop_str_in_output else pos
        last = next(i for i in range(len(ids)) if starts[i + 1] >= pos + len(stop_reason))
    hit = next((i for i, t in enumerate(ids) if t in params.stop_token_ids), None)
    if hit is not None and (hit < last or stop_reason is None):
        end, last, stop_reason = starts[hit], hit, ids[hit]
    finish = FinishReason.STOP if stop_reason is not None else FinishReason[reason.upper()]
    deltas = []
    for i in range(last + 1):
        text = joined[min(starts[i], end) : min(starts[i + 1], end)]
        logprobs = []
        if params.logprobs is not None:
            top = top_alternatives(index, i, params.logprobs)
            logprobs = [TextLogprob(texts[i], list(texts[i].encode()), token_logprob(index), top)]
        deltas.append(
            TextDelta(
                req.request_id,
                index,
                text,
                [ids[i]],
                finish if i == last else None,
                num_prompt,
                i + 1,
                num_cached,
                (i + 1) * token_logprob(index),
                logprobs,
                stop_reason if i == last else None,
            )
        )
    return deltas


def prompt_text(req: TokenizeRequest) -> str:
    if req.messages is not None:
        return " ".join(m.content for m in req.messages)
    return req.prompt if req.prompt is not None else " ".join(map(str, req.prompt_token_ids or []))


class FakeEngine(threading.Thread):
    def __init__(self, run_dir: str):
        super().__init__(daemon=True, name="fake-engine")
        self.run_dir = run_dir
        self.requests: list[TokenizeRequest] = []
        self.aborts: list[str] = []
        self.stage_ready: list[tuple[str, int]] = []
        self.launcher_notes: list = []  # Heartbeat and Drained messages, in order
        self._outbox: queue.Queue = queue.Queue()
        self._slow: dict[str, int] = {}  # request id -> tokens sent so far
        self._stopping = threading.Event()
        self._bound = threading.Event()

    def start(self) -> None:
        super().start()
        assert self._bound.wait(5)

    def send(self, msg) -> None:
        """Send a message to the ingress from the engine's thread (zmq sockets are not shared)."""
        self._outbox.put(msg)

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)

    def run(self) -> None:
        ctx = zmq.Context()
        tokenizer: Receiver[TokenizerInbound] = Receiver(ctx, address(self.run_dir, "tokenizer", 0), TokenizerInbound)
        scheduler: Receiver[SchedulerInbound] = Receiver(ctx, address(self.run_dir, "scheduler", 0), SchedulerInbound)
        launcher: Receiver[LauncherInbound] = Receiver(ctx, address(self.run_dir, "launcher", 0), LauncherInbound)
        self.ingress: Sender[IngressInbound] = Sender(ctx, address(self.run_dir, "ingress", 0))
        poller = zmq.Poller()
        for r in (tokenizer, scheduler, launcher):
            poller.register(r.socket, zmq.POLLIN)
        self._bound.set()
        while not self._stopping.is_set():
            poller.poll(20)
            while (req := tokenizer.recv_nowait()) is not None:
                self.requests.append(req)
                self._answer(req)
            while (msg := scheduler.recv_nowait()) is not None:
                if isinstance(msg, AbortRequest):
                    self.aborts.extend(msg.request_ids)
                    for request_id in msg.request_ids:
                        self._slow.pop(request_id, None)
            while (note := launcher.recv_nowait()) is not None:
                if isinstance(note, StageReady):
                    self.stage_ready.append((note.stage, note.index))
                else:  # Heartbeat, Drained
                    self.launcher_notes.append(note)
            while not self._outbox.empty():
                msg = self._outbox.get()
                if msg == EngineStatus(ready=False):
                    self._slow.clear()
                self.ingress.send(msg)
            for request_id, num_sent in self._slow.items():
                self._slow[request_id] = num_sent + 1
                self.ingress.send(DeltaBatch([TextDelta(request_id, 0, f" s{num_sent}", [100 + num_sent])]))
        for s in (tokenizer, scheduler, launcher, self.ingress):
            s.close()
        ctx.term()

    def _answer(self, req: TokenizeRequest) -> None:
        text = prompt_text(req)
        rid = req.request_id
        if "TOO_LONG" in text:  # the tokenizer's verdict
            message = f"prompt is longer than the {MAX_MODEL_LEN} tokens this model takes"
            self.ingress.send(RequestRejected(rid, 400, message, param="prompt", code="context_length_exceeded"))
            return
        if "QUEUE_FULL" in text:  # the scheduler's
            self.ingress.send(RequestRejected(rid, 429, "the waiting queue is full", retry_after=2.5))
            return
        num_prompt = len(text.split())
        num_cached = num_prompt - 1 if "CACHED" in text else 0
        if "NO_ACCEPT" not in text:
            self.ingress.send(RequestAccepted(rid, num_prompt))
        if "SLOW" in text:
            self._slow[rid] = 0
            return
        if "FAILS_AT_ONCE" in text:
            self.ingress.send(DeltaBatch([TextDelta(rid, 0, "", [0], finish_reason=FinishReason.ERROR, num_prompt_tokens=num_prompt)]))
            return
        per_choice = [choice_deltas(req, j, num_prompt, num_cached) for j in range(req.params.num_samples)]
        for i in range(max(map(len, per_choice))):  # one batch per step: a delta per running choice
            self.ingress.send(DeltaBatch([deltas[i] for deltas in per_choice if i < len(deltas)]))


class ScriptedEngine(FakeEngine):
    """Answers a conversation whose last word is a key of `scripts` (a subclass's) with that text,
    in deltas of PIECE characters that cut through tags and JSON, every choice alike; a max_tokens
    below the pieces cuts the text there with finish "length". Anything else: FakeEngine's answer."""

    scripts: dict[str, str] = {}
    PIECE = 7  # characters per delta
    NUM_PROMPT_TOKENS = 3  # what it says every prompt has

    def _answer(self, req: TokenizeRequest) -> None:
        words = prompt_text(req).split()
        if not words or words[-1] not in self.scripts:
            return super()._answer(req)
        text = self.scripts[words[-1]]
        pieces = [text[i : i + self.PIECE] for i in range(0, len(text), self.PIECE)]
        finish = FinishReason.STOP
        if req.params.max_tokens is not None and req.params.max_tokens < len(pieces):
            pieces, finish = pieces[: req.params.max_tokens], FinishReason.LENGTH
        num_prompt = self.NUM_PROMPT_TOKENS
        self.ingress.send(RequestAccepted(req.request_id, num_prompt))
        for i, piece in enumerate(pieces):
            reason = finish if i == len(pieces) - 1 else None
            deltas = [TextDelta(req.request_id, j, piece, [100 + i], reason, num_prompt, i + 1) for j in range(req.params.num_samples)]
            self.ingress.send(DeltaBatch(deltas))
