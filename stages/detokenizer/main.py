"""The detokenizer stage process (one of a pool): token ids to text, incrementally.

Takes (DetokenizerInbound): TokenBatch from the scheduler, one per step, for the sequences this
process owns. Sends: one DeltaBatch per ingress per batch of work, carrying every owned sequence
that ingress serves; and to the scheduler, one FinishSeqs per batch of work naming the sequences
that matched a stop string (stop_strings.py), so it stops generating them. When several
TokenBatches are queued they are decoded together and answered with one DeltaBatch per ingress:
under load the detokenizer catches up instead of falling behind.
"""

from __future__ import annotations

import time
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from conveyor.config import EngineConfig
from conveyor.stages import metrics
from conveyor.stages.detokenizer.detokenizer import Detokenizer
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import report_ready
from conveyor.wire.messages import DeltaBatch, FinishSeqs, TextDelta
from conveyor.wire.topology import DETOKENIZER, INGRESS, SCHEDULER, receiver, sender, senders


def run(config: EngineConfig, index: int) -> None:
    tokenizer = Tokenizer.from_file(str(Path(config.model.path) / "tokenizer.json"))
    detokenizer = Detokenizer(tokenizer)
    ctx = zmq.Context()
    try:
        inbox = receiver(ctx, config, DETOKENIZER, index)
        scheduler = sender(ctx, config, SCHEDULER)
        ingresses = senders(ctx, config, INGRESS)
        report_ready(ctx, config, DETOKENIZER, index)
        inbox.on_wait = Pulse(ctx, config, DETOKENIZER, index).beat
        while True:
            out: list[list[TextDelta]] = [[] for _ in ingresses]
            stopped: list[int] = []
            batch = inbox.recv()
            while batch is not None:
                stopped += detokenizer.process(batch, out)
                if batch.sent_time:  # scheduler to here, decoding included
                    metrics.stage_latency.labels("detokenizer").observe(max(0.0, time.time() - batch.sent_time))
                batch = inbox.recv_nowait()
            if stopped:  # first: every step the scheduler runs before reading it is wasted
                scheduler.send(FinishSeqs(stopped))
            for ingress, deltas in zip(ingresses, out):
                if deltas:
                    ingress.send(DeltaBatch(deltas, sent_time=time.time()))
    finally:
        ctx.destroy(linger=0)
