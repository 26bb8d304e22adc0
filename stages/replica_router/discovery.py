"""Replicas found by DNS (`--backends-dns HOST:PORT`): every address HOST resolves to is a
replica at http://ADDRESS:PORT, asked again before each round of health checks.

On Kubernetes HOST is a headless Service (ops/k8s/conveyor.yaml): its name resolves to every
pod's address, so `kubectl scale` (or an autoscaler) adds and removes replicas without touching
the router. A lookup that fails keeps the replicas as they were: a DNS blip must not empty the
rotation (replicas that are really gone fail their health checks instead).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Resolve = Callable[[str], Awaitable["list[str] | None"]]


def parse_dns_name(text: str) -> str:
    """`--backends-dns`: HOST:PORT."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return f"{host}:{port}"


async def resolve(name: str) -> list[str] | None:
    """The base URLs of the replicas behind HOST:PORT, sorted; None when the lookup fails."""
    host, _, port = name.rpartition(":")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:  # socket.gaierror: no such name, or no answer
        log.warning("cannot resolve %s: %s; keeping the replicas as they are", host, e)
        return None
    return sorted({base_url(str(info[4][0]), int(port)) for info in infos})


def base_url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"
