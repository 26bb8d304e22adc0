"""`conveyor router --backends URL[,URL...] | --backends-dns HOST:PORT`: serve the replica router until SIGTERM or SIGINT.
On either, aiohttp stops accepting connections and lets requests in flight finish (up to
SHUTDOWN_TIMEOUT_S), so an orchestrator's stop grace period should be a little longer."""

from __future__ import annotations

import logging

from aiohttp import web

from conveyor.stages.replica_router.config import RouterConfig
from conveyor.stages.replica_router.proxy import make_app

SHUTDOWN_TIMEOUT_S = 30.0
log = logging.getLogger(__name__)


def serve(config: RouterConfig) -> int:
    replicas = f"the replicas {config.backends_dns} resolves to" if config.backends_dns else f"{len(config.backends)} replicas"
    log.info("routing to %s (%s) on http://%s:%d", replicas, config.routing_policy, config.host, config.port)
    web.run_app(make_app(config), host=config.host, port=config.port, access_log=None, print=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    return 0
