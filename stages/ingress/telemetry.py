"""Request lifecycle metrics and logs, as the client sees them (the ingress is where tokens leave).

Per engine request: time to first token, inter-token latency, time per output token, end-to-end
latency, prompt and generation token counts, the finish reasons, and one structured log line
when it finishes. Per message: the "return" hop (detokenizer to here), and the inter-token
latencies its deltas tallied (`flush`). Fed by EngineClient.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from conveyor.stages import metrics
from conveyor.wire.messages import TextDelta

log = logging.getLogger("conveyor.requests")


@dataclasses.dataclass
class Timing:
    arrival: float  # time.time() when the HTTP request reached its handler
    num_choices: int
    first_token: float | None = None
    last_token: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_finished: int = 0
    queue_time: float = 0.0
    finish_reasons: list[str] = dataclasses.field(default_factory=list)


class Telemetry:
    def __init__(self) -> None:
        self.timings: dict[str, Timing] = {}
        self.inter_token = metrics.Tally(metrics.inter_token_latency)  # per token: written once per batch

    def submitted(self, request_id: str, arrival: float, num_choices: int) -> None:
        self.timings[request_id] = Timing(arrival, num_choices)
        metrics.stage_latency.labels("ingress").observe(max(0.0, time.time() - arrival))

    def batch_received(self, sent_time: float) -> None:
        if sent_time:
            metrics.stage_latency.labels("return").observe(max(0.0, time.time() - sent_time))

    def delta(self, d: TextDelta, now: float) -> None:
        t = self.timings.get(d.request_id)
        if t is None:
            return
        if d.token_ids:
            if t.first_token is None:
                t.first_token = now
                metrics.time_to_first_token.observe(now - t.arrival)
            else:
                self.inter_token.observe((now - t.last_token) / len(d.token_ids), len(d.token_ids))
            t.last_token = now
            t.num_output_tokens += len(d.token_ids)
        t.num_prompt_tokens = d.num_prompt_tokens
        if d.finish_reason is not None:
            t.num_finished += 1
            t.queue_time = max(t.queue_time, d.queue_time)
            t.finish_reasons.append(d.finish_reason.openai)
            if t.num_finished == t.num_choices:
                self._finished(d.request_id, t, now)

    def flush(self) -> None:
        """Write what this message's deltas tallied (once per DeltaBatch, not per token)."""
        self.inter_token.flush()

    def forget(self, request_id: str) -> None:
        self.timings.pop(request_id, None)

    def _finished(self, request_id: str, t: Timing, now: float) -> None:
        del self.timings[request_id]
        e2e = now - t.arrival
        metrics.e2e_latency.observe(e2e)
        metrics.request_prompt_tokens.observe(t.num_prompt_tokens)
        metrics.request_generation_tokens.observe(t.num_output_tokens)
        ttft = (t.first_token - t.arrival) if t.first_token is not None else e2e
        per_choice = t.num_output_tokens / t.num_choices
        if per_choice > 1:
            metrics.time_per_output_token.observe((e2e - ttft) / (per_choice - 1))
        log.info(
            "request finished id=%s arrival=%.4f prompt_tokens=%d output_tokens=%d "
            "queue_time=%.4f ttft=%.4f e2e=%.4f finish_reason=%s",
            request_id,
            t.arrival,
            t.num_prompt_tokens,
            t.num_output_tokens,
            t.queue_time,
            ttft,
            e2e,
            ",".join(t.finish_reasons),
        )
