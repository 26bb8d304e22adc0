"""GET /metrics: the prometheus text for every stage's metrics, served by the ingress.

Every stage process writes its metrics into the prometheus-client multiprocess directory
(PROMETHEUS_MULTIPROC_DIR); the ingress only collects and serves them. Without that directory
(a test, a single process) it serves its own default registry.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from conveyor.config.env import prometheus_multiproc_dir


def make_registry() -> CollectorRegistry:
    path = prometheus_multiproc_dir()
    if not path:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return registry


def metrics_handler(registry: CollectorRegistry):
    async def handle_metrics(request: web.Request) -> web.Response:
        # Reading many processes' files is blocking work; keep it off the event loop.
        body = await asyncio.to_thread(generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle_metrics
