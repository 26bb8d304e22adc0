"""The detokenizer's state, without its sockets: each sequence's incremental decoder and stop
matcher, and what one TokenBatch turns into (a TextDelta per updated sequence, and the ids of the
sequences that matched a stop string). Used by the detokenizer stage's loop (main.py) and by the
Python API (conveyor/llm.py).
"""

from __future__ import annotations

import dataclasses
import logging

from tokenizers import Tokenizer

from conveyor.stages.detokenizer.incremental import IncrementalDetokenizer
from conveyor.stages.detokenizer.stop_strings import StopMatcher
from conveyor.stages.detokenizer.token_texts import TokenTexts
from conveyor.wire.messages import DetokSeq, FinishReason, SeqTokens, TextDelta, TokenBatch

log = logging.getLogger(__name__)

# A sequence stopped here keeps generating until the scheduler reads FinishSeqs, so tokens for it
# may still be in flight; its id is remembered this many steps to drop them without complaint.
STOPPED_MEMORY_STEPS = 4096


@dataclasses.dataclass
class SeqText:
    info: DetokSeq
    decoder: IncrementalDetokenizer
    stop: StopMatcher | None = None  # None: no stop strings
    num_output_tokens: int = 0

    def decode(self, token_ids: list[int], final: bool) -> str:
        """The text `token_ids` add, held back and cut by the stop strings (then `stop` is
        stopped); with `final`, everything held comes out unless a stop string ends it."""
        before, self.num_output_tokens = self.num_output_tokens, self.num_output_tokens + len(token_ids)
        if self.stop is None:
            return self.decoder.step(token_ids, final=final)
        # Text of the first min_tokens tokens cannot complete a stop string (vLLM's rule): an
        # update that crosses the line is decoded in two parts.
        num_protected = min(max(0, self.info.min_tokens - before), len(token_ids))
        rest, text = token_ids[num_protected:], ""
        if num_protected:
            text = self.stop.add(self.decoder.step(token_ids[:num_protected], final=final and not rest), can_stop=False)
        if rest or not num_protected:  # an empty final step still flushes the decoder's held bytes
            text += self.stop.add(self.decoder.step(rest, final=final))
        if final and not self.stop.is_stopped:
            text += self.stop.flush()
        return text


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.seqs: dict[int, SeqText] = {}
        # Per engine (its steps count on their own): seq_id -> step it matched a stop string at,
        # oldest first.
        self._stopped: dict[int, dict[int, int]] = {}

    @property
    def stopped(self) -> dict[int, int]:
        """Sequences that matched a stop string, whose last updates may still come: seq_id -> step."""
        return {seq_id: step for by_seq in self._stopped.values() for seq_id, step in by_seq.items()}

    def drop_engine(self, engine: int, num_engines: int) -> None:
        """Engine `engine` (of `num_engines`) started afresh: its sequences (ids engine mod
        num_engines) will get no more tokens."""
        self.seqs = {seq_id: s for seq_id, s in self.seqs.items() if seq_id % num_engines != engine}
        self._stopped.pop(engine, None)

    def process(self, batch: TokenBatch, out: list[list[TextDelta]]) -> list[int]:
        """Decode one step's tokens, appending deltas to `out[ingress]`; return the ids of the
        sequences that matched a stop string (the scheduler should finish them)."""
        for info in batch.new_seqs:
            decoder = IncrementalDetokenizer(self.tokenizer, info.prompt_tail, info.skip_special_tokens)
            stop = StopMatcher(info.stop, info.include_stop_str_in_output) if info.stop else None
            self.seqs[info.seq_id] = SeqText(info, decoder, stop)
        stopped = []
        engine_stopped = self._stopped.setdefault(batch.engine, {})
        for update in batch.updates:
            state = self.seqs.get(update.seq_id)
            if state is None:
                if update.seq_id in engine_stopped:
                    if update.finish_reason is not None:  # the scheduler sends nothing after this
                        del engine_stopped[update.seq_id]
                else:
                    log.error("tokens for unknown sequence %d", update.seq_id)
                continue
            delta = self._delta(state, update)
            out[state.info.ingress].append(delta)
            if delta.finish_reason is not None:
                del self.seqs[update.seq_id]
                if update.finish_reason is None:  # finished here: the scheduler does not know
                    stopped.append(update.seq_id)
                    engine_stopped[update.seq_id] = batch.step
        self._forget_stopped(engine_stopped, batch.step)
        return stopped

    def _delta(self, state: SeqText, update: SeqTokens) -> TextDelta:
        text = state.decode(update.token_ids, final=update.finish_reason is not None)
        finish_reason, stop_reason = update.finish_reason, None
        if state.stop is not None and state.stop.is_stopped:  # a stop string outranks EOS or length
            finish_reason, stop_reason = FinishReason.STOP, state.stop.stop_reason
        info = state.info
        logprobs = self.token_texts.logprobs(update.token_ids, update.logprobs) if info.logprobs else []
        return TextDelta(
            request_id=info.request_id,
            index=info.index,
            text=text,
            token_ids=update.token_ids,
            finish_reason=finish_reason,
            num_prompt_tokens=info.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=info.num_cached_tokens,
            cumulative_logprob=update.cumulative_logprob,
            logprobs=logprobs,
            stop_reason=stop_reason,
            queue_time=update.queue_time,
            prompt_logprobs=self.token_texts.prompt_logprobs(update.prompt) if update.prompt is not None else [],
            embedding=update.embedding,
        )

    @staticmethod
    def _forget_stopped(stopped: dict[int, int], step: int) -> None:
        while stopped:
            seq_id, stopped_at = next(iter(stopped.items()))
            if step - stopped_at < STOPPED_MEMORY_STEPS:
                return
            del stopped[seq_id]
