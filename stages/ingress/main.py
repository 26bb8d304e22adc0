"""The ingress stage process: HTTP in, TokenizeRequest out; TextDelta batches in, SSE/JSON out.

Binds `ingress-<index>` and takes IngressInbound (RequestAccepted, RequestRejected, DeltaBatch,
EngineStatus, StageFailed); sends TokenizeRequest to a tokenizer of the pool (engine_client.py
picks it), AbortRequest to the scheduler (the router, with several engines), and to the launcher StageReady once the HTTP site
listens, a Heartbeat every so often from the event loop (stages/liveness.py) and Drained when a
drain has no request left. Several ingress processes share the port (SO_REUSEPORT); request ids
carry the index, so replies come back here.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.app import build_app
from conveyor.stages.ingress.engine_client import EngineClient
from conveyor.stages.ingress.listener import BoundedSite
from conveyor.stages.liveness import Pulse
from conveyor.stages.runtime import run_async, settle
from conveyor.wire.channel import AsyncReceiver
from conveyor.wire.messages import Drained, IngressInbound, StageReady
from conveyor.wire.topology import INGRESS, LAUNCHER, TOKENIZER, admission, async_receiver, sender, senders

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 2.0  # how long open HTTP connections get to finish when the stage stops


def run(config: EngineConfig, index: int) -> None:
    """The stage's entry (wire/topology.py): serve on uvloop until stopped."""
    run_async(serve(config, index))


async def serve(config: EngineConfig, index: int) -> None:
    """Run until cancelled; then close the HTTP site and the sockets."""
    ctx = zmq.asyncio.Context()
    sync_ctx: zmq.Context = zmq.Context.shadow(ctx)  # senders never wait: unbounded PUSH queues
    receiver = async_receiver(ctx, config, INGRESS, index)
    tokenizers = senders(sync_ctx, config, TOKENIZER)
    scheduler = admission(sync_ctx, config)  # the scheduler, or the router with several engines
    launcher = sender(sync_ctx, config, LAUNCHER)
    engine = EngineClient(
        index,
        tokenizers,
        scheduler,
        on_drained=lambda: launcher.send(Drained(index)),
        num_engines=config.parallel.data_parallel_size,
    )
    pump = asyncio.create_task(_receive(receiver, engine), name=f"ingress-{index}-receive")
    pulse = Pulse(sync_ctx, config, INGRESS, index)  # the launcher heeds beats once we are ready
    beating = asyncio.create_task(pulse.run(), name=f"ingress-{index}-heartbeat")

    runner = web.AppRunner(
        build_app(config, engine),
        handler_cancellation=True,  # a client that goes away cancels its handler: we abort
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        access_log=None,
        keepalive_timeout=config.server.keepalive_timeout_s,  # the other HTTP limits: listener.py
    )
    try:
        await runner.setup()
        site = BoundedSite(runner, config.server)  # SO_REUSEPORT, max_connections, HTTP timeouts
        await site.start()
        log.info("ingress %d listening on http://%s:%d", index, config.server.host, config.server.port)
        launcher.send(StageReady(stage=INGRESS.name, index=index))
        settle()
        await pump  # runs until cancelled
    finally:
        for task in (pump, beating):
            task.cancel()
        await asyncio.gather(pump, beating, return_exceptions=True)
        engine.fail_all()  # open streams end with an error event instead of being cut
        await runner.cleanup()
        receiver.close()
        for tokenizer in tokenizers:
            tokenizer.close()
        scheduler.close()
        launcher.close()
        pulse.close()
        ctx.term()


async def _receive(receiver: AsyncReceiver[IngressInbound], engine: EngineClient) -> None:
    while True:
        msg = await receiver.recv()
        if msg is not None:
            engine.dispatch(msg)
