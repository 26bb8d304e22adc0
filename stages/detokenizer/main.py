"""The detokenizer stage process (one of a pool): token ids to text, incrementally.

Takes (DetokenizerInbound): TokenBatch from a scheduler, one per step, for the sequences this
process owns; EngineStarted from a scheduler as it starts (with data parallelism the detokenizers
outlive an engine's restart, and drop the sequences of the process that died). Sends: one
DeltaBatch per ingress per batch of work, carrying every owned sequence that ingress serves; and to
the scheduler that owns them (a sequence id names its engine), one FinishSeqs per batch of work
naming the sequences that matched a stop string (stop_strings.py), so it stops generating them. When several
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
from conveyor.wire.messages import DeltaBatch, EngineStarted, FinishSeqs, TextDelta
from conveyor.wire.topology import DETOKENIZER, INGRESS, SCHEDULER, engine_of_seq, receiver, senders


def run(config: EngineConfig, index: int) -> None:
    tokenizer = Tokenizer.from_file(str(Path(config.model.path) / "tokenizer.json"))
    detokenizer = Detokenizer(tokenizer)
    ctx = zmq.Context()
    try:
        inbox = receiver(ctx, config, DETOKENIZER, index)
        schedulers = senders(ctx, config, SCHEDULER)
        ingresses = senders(ctx, config, INGRESS)
        report_ready(ctx, config, DETOKENIZER, index)
        inbox.on_wait = Pulse(ctx, config, DETOKENIZER, index).beat
        while True:
            out: list[list[TextDelta]] = [[] for _ in ingresses]
            stopped: list[int] = []
            batch = inbox.recv()
            while batch is not None:
                if isinstance(batch, EngineStarted):
                    detokenizer.drop_engine(batch.engine, len(schedulers))
                else:
                    stopped += detokenizer.process(batch, out)
                    if batch.sent_time:  # scheduler to here, decoding included
                        metrics.stage_latency.labels("detokenizer").observe(max(0.0, time.time() - batch.sent_time))
                batch = inbox.recv_nowait()
            by_engine: dict[int, list[int]] = {}
            for seq_id in stopped:
                by_engine.setdefault(engine_of_seq(config, seq_id), []).append(seq_id)
            for engine, seq_ids in by_engine.items():  # first: every step a scheduler runs before reading it is wasted
                schedulers[engine].send(FinishSeqs(seq_ids))
            for ingress, deltas in zip(ingresses, out):
                if deltas:
                    ingress.send(DeltaBatch(deltas, sent_time=time.time()))
    finally:
        ctx.destroy(linger=0)
