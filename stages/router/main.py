"""The router stage process (data parallelism only; one process): each request's engine.

Takes (RouterInbound): ScheduleRequest from tokenizers, AbortRequest from ingresses, EngineLoad
from each engine's scheduler, EngineStatus from the launcher (which engines are ready).
Sends: each ScheduleRequest to the scheduler of the engine policy.py picks, each AbortRequest to
the engine holding its request (requests.py keeps the books); a RequestRejected (503) to the
owning ingress for a request no engine is ready to take, or one sent to an engine that died
before receiving it.

One router sees every request, so its map of which engine holds which prompt blocks is one map;
a map per tokenizer process would see only that process's share of the traffic. An image's
placeholder ids are all alike, so `routing_items` puts the image's hash in their place: a prompt
with another picture shares its blocks only up to the image, as in the scheduler's prefix cache.
"""

from __future__ import annotations

import logging

import zmq

from conveyor.config import EngineConfig
from conveyor.stages import metrics
from conveyor.stages.liveness import Pulse
from conveyor.stages.router import policy
from conveyor.stages.router.policy import REASONS, RoutingPolicy, prefix_hashes
from conveyor.stages.router.requests import RoutedRequests
from conveyor.stages.runtime import report_ready
from conveyor.wire.images import ImageInput
from conveyor.wire.messages import AbortRequest, EngineLoad, EngineStatus, RequestRejected, RouterInbound, ScheduleRequest
from conveyor.wire.topology import INGRESS, ROUTER, SCHEDULER, receiver, senders

log = logging.getLogger(__name__)

UNAVAILABLE = "no engine is ready to serve this request; retry it"


class RouterStage:
    def __init__(self, config: EngineConfig, ctx: zmq.Context):
        self.block_size = config.cache.block_size
        self.inbox = receiver(ctx, config, ROUTER)
        self.schedulers = senders(ctx, config, SCHEDULER)
        self.ingresses = senders(ctx, config, INGRESS)
        self.policy = RoutingPolicy(config.parallel.routing_policy, len(self.schedulers))
        self.books = RoutedRequests(len(self.schedulers))
        for engine in range(len(self.schedulers)):
            for reason in REASONS:
                metrics.routed.labels(str(engine), reason)  # 0 from the first scrape

    def loop(self) -> None:
        while True:
            msg = self.inbox.recv()
            if msg is not None:
                self.handle(msg)

    def handle(self, msg: RouterInbound) -> None:
        match msg:
            case ScheduleRequest():
                self.route(msg)
            case AbortRequest():
                self.abort(msg.request_ids)
            case EngineLoad():
                # A report from an engine not ready is from a process that died, or from one
                # that is starting: it counts from the launcher's word on.
                if self.policy.is_ready(msg.engine):
                    self.policy.report(
                        msg.engine,
                        policy.EngineLoad(
                            msg.num_waiting,
                            msg.num_running,
                            msg.num_kv_blocks_used,
                            msg.num_kv_blocks,
                            msg.num_received,
                            msg.num_host_blocks,
                        ),
                    )
                    self.books.received(msg.engine, msg.num_received)
            case EngineStatus(ready=ready, engine=engine):
                for e in range(len(self.schedulers)) if engine is None else [engine]:
                    self.set_ready(e, ready)

    def route(self, request: ScheduleRequest) -> None:
        if self.books.was_aborted(request.request_id):
            return
        route = self.policy.route(prefix_hashes(routing_items(request.prompt_token_ids, request.images), self.block_size))
        if route is None:
            metrics.routed_unavailable.inc()
            self.reject(request.request_id, request.ingress)
            return
        self.schedulers[route.engine].send(request)
        self.books.sent(request.request_id, request.ingress, route.engine)
        metrics.routed.labels(str(route.engine), route.reason).inc()

    def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int | None, list[str]] = {}
        for request_id in request_ids:
            by_engine.setdefault(self.books.engine_of(request_id), []).append(request_id)
        for engine, ids in by_engine.items():
            if engine is not None:
                self.schedulers[engine].send(AbortRequest(ids))
                continue
            for request_id in ids:  # not routed yet, or forgotten: both cases covered
                self.books.abort_early(request_id)
            for scheduler in self.schedulers:
                scheduler.send(AbortRequest(ids))

    def set_ready(self, engine: int, ready: bool) -> None:
        if not ready and self.policy.is_ready(engine):
            for request_id, ingress in self.books.engine_lost(engine):
                self.reject(request_id, ingress)
            self.policy.forget(engine)
        if ready != self.policy.is_ready(engine):
            log.info("engine %d %s", engine, "ready" if ready else "not ready")
        self.policy.set_ready(engine, ready)

    def reject(self, request_id: str, ingress: int) -> None:
        self.ingresses[ingress].send(RequestRejected(request_id, 503, UNAVAILABLE, code="engine_not_ready"))


def run(config: EngineConfig, index: int) -> None:
    ctx = zmq.Context()
    stage = RouterStage(config, ctx)
    try:
        report_ready(ctx, config, ROUTER, index)
        stage.inbox.on_wait = Pulse(ctx, config, ROUTER, index).beat
        stage.loop()
    finally:
        ctx.destroy(linger=0)


def routing_items(token_ids: list[int], images: list[ImageInput]) -> list[int] | list[int | tuple[int, int]]:
    """The prompt as the router hashes it: its ids, each image's placeholder ids replaced by
    (the image's hash, the index into it)."""
    if not images:
        return token_ids
    items: list[int | tuple[int, int]] = list(token_ids)
    for image in images:
        items[image.offset : image.offset + image.length] = [(image.hash, j) for j in range(image.length)]
    return items
