"""How an engine's worker ranks meet: `init_group(config, engine, rank)` -> TensorParallel.

The worker stage calls it at start-up, before the model is loaded. With tensor_parallel_size 1
nothing happens (SINGLE); otherwise every rank of the engine calls
torch.distributed.init_process_group (gloo on a CPU, NCCL on CUDA) and meets the others through
`CONVEYOR_DIST_INIT_METHOD` when it is set (`tcp://host:port`: the Ray placement hands out a
port on rank 0's node when the ranks run on several nodes), else through a file store in the
run directory (`_file_store`).

Invariants: nothing listens on the network for a local rendezvous (a 0700 run directory, gloo
over loopback); a restarted engine never meets its dead predecessor's store; a dead peer cannot
hang a rank: gloo fails a collective whose peer closed its connection, every collective has
COLLECTIVE_TIMEOUT, and a rank of a group dies at once on the launcher's STOP (`init_group`
says why it takes STOP's default action).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import time
from pathlib import Path

import torch.distributed as dist

from conveyor.config.engine import EngineConfig
from conveyor.config.env import dist_init_method_from_env
from conveyor.gpu.parallel.group import SINGLE, TensorParallel
from conveyor.wire.addresses import process_alive
from conveyor.wire.signals import STOP

log = logging.getLogger(__name__)

# Longer than any legitimate wait of one rank for another inside a step (the ranks compute in
# lockstep); a stalled peer is caught sooner by the launcher's --stage-timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
RENDEZVOUS_TIMEOUT_S = 120.0


def init_group(config: EngineConfig, engine: int, rank: int) -> TensorParallel:
    """Rank `rank` of engine `engine`'s tensor-parallel group, formed (blocks until every rank came)."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return SINGLE
    method = dist_init_method_from_env()
    if method is None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback only
        method = _file_store(Path(config.server.run_dir), engine, rank)
    backend = "nccl" if config.parallel.device == "cuda" else "gloo"  # an emulated device's ranks are host processes
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    # The launcher stops an engine's other ranks with its STOP signal when one dies (wire/signals.py).
    # A rank blocked in a collective never returns to the interpreter to run a Python handler, so
    # ranks of a group take STOP's default action (they die at once: a worker has nothing to save)
    # rather than the StageStopped a single worker raises.
    signal.signal(STOP, signal.SIG_DFL)
    log.info("tensor-parallel rank %d of %d (engine %d, %s)", rank, size, engine, backend)
    return TensorParallel(rank, size, dist.group.WORLD)


def _file_store(run_dir: Path, engine: int, rank: int) -> str:
    """The file:// init method of this incarnation of the engine's group: a store in the run
    directory (mode 0700), so nothing listens on the network for the rendezvous (and init_group
    keeps gloo's own connections on loopback: GLOO_SOCKET_IFNAME=lo unless the caller chose an
    interface). An engine that is restarted must not meet its dead predecessor's
    keys, so the store file is named after rank 0's pid, and rank 0 points the engine's link
    `tp-engine-{engine}` at it; the other ranks follow the link once the pid it names is alive
    (the launcher restarts an engine only after all of its old processes are gone)."""
    link = run_dir / f"tp-engine-{engine}"
    if rank == 0:
        for stale in run_dir.glob(f"tp-engine-{engine}-*.store"):  # a dead incarnation's
            stale.unlink(missing_ok=True)
        store = run_dir / f"tp-engine-{engine}-{os.getpid()}.store"
        tmp = run_dir / f"tp-engine-{engine}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(store.name, tmp)
        os.replace(tmp, link)  # atomic: a follower reads the old link or the new one
        return f"file://{store}"
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            target = os.readlink(link)
            if process_alive(int(target.removesuffix(".store").rsplit("-", 1)[1])):
                return f"file://{run_dir / target}"
        except (OSError, ValueError, IndexError):
            pass  # not made yet, or mid-replace
        time.sleep(0.05)
    raise TimeoutError(f"tensor-parallel rank 0 of engine {engine} never published its store in {run_dir}")
