"""The detokenizer stage process (one of a pool): token ids to text, incrementally.

Takes (DetokenizerInbound): TokenBatch from the scheduler, one per step, for the sequences this
process owns. Sends: one DeltaBatch per ingress per batch of work, carrying every owned sequence
that ingress serves. When several TokenBatches are queued they are decoded together and answered
with one DeltaBatch per ingress: under load the detokenizer catches up instead of falling behind.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from conveyor.config import EngineConfig
from conveyor.stages.detokenizer.incremental import IncrementalDetokenizer
from conveyor.stages.runtime import report_ready
from conveyor.wire.addresses import address
from conveyor.wire.channel import Receiver, Sender
from conveyor.wire.messages import DeltaBatch, DetokenizerInbound, DetokSeq, TextDelta, TokenBatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SeqState:
    info: DetokSeq
    decoder: IncrementalDetokenizer
    num_output_tokens: int = 0


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.seqs: dict[int, SeqState] = {}

    def process(self, batch: TokenBatch, out: list[list[TextDelta]]) -> None:
        """Decode one step's tokens, appending deltas to `out[ingress]`."""
        for info in batch.new_seqs:
            decoder = IncrementalDetokenizer(self.tokenizer, info.prompt_tail, info.skip_special_tokens)
            self.seqs[info.seq_id] = SeqState(info, decoder)
        for update in batch.updates:
            state = self.seqs.get(update.seq_id)
            if state is None:
                log.error("tokens for unknown sequence %d", update.seq_id)
                continue
            state.num_output_tokens += len(update.token_ids)
            text = state.decoder.step(update.token_ids, final=update.finish_reason is not None)
            info = state.info
            out[info.ingress].append(
                TextDelta(
                    request_id=info.request_id,
                    index=info.index,
                    text=text,
                    token_ids=update.token_ids,
                    finish_reason=update.finish_reason,
                    num_prompt_tokens=info.num_prompt_tokens,
                    num_output_tokens=state.num_output_tokens,
                    num_cached_tokens=info.num_cached_tokens,
                    cumulative_logprob=update.cumulative_logprob,
                )
            )
            if update.finish_reason is not None:
                del self.seqs[update.seq_id]


def run(config: EngineConfig, index: int) -> None:
    run_dir = config.server.run_dir
    tokenizer = Tokenizer.from_file(str(Path(config.model.path) / "tokenizer.json"))
    detokenizer = Detokenizer(tokenizer)
    ctx = zmq.Context()
    try:
        inbox: Receiver[DetokenizerInbound] = Receiver(ctx, address(run_dir, "detokenizer", index), DetokenizerInbound)
        ingresses = [Sender(ctx, address(run_dir, "ingress", i)) for i in range(config.stages.num_ingress)]
        report_ready(ctx, config, "detokenizer", index)
        while True:
            out: list[list[TextDelta]] = [[] for _ in ingresses]
            batch = inbox.recv()
            while batch is not None:
                detokenizer.process(batch, out)
                batch = inbox.recv_nowait()
            for sender, deltas in zip(ingresses, out):
                if deltas:
                    sender.send(DeltaBatch(deltas))
    finally:
        ctx.destroy(linger=0)
