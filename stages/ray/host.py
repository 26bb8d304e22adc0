"""The Ray actor that hosts an engine's stage processes on its node (one per placement bundle).

Each remote stage is `python -m conveyor.stages STAGE INDEX CONFIG`, started here as a child of
the actor, exactly as the launcher starts a local one: the launcher supervises it through this
actor's poll/signal methods (processes.py), and the stage asks the kernel for SIGHUP when the
actor dies, so a dead actor or node takes its stages with it.

The node has its own private run directory (0700, made and swept as the launcher's is): the config JSON the
launcher hands over is written there with `server.run_dir` pointing at it, so the stage's
metrics, its torch.distributed file store and its clean-up stay on its node. The environment a
stage gets is the node's own (PATH, CUDA_VISIBLE_DEVICES that Ray assigned) plus the run's
CONVEYOR_* variables (the CurveZMQ keys among them), which reach the actor as call arguments
over Ray's control channel and are never written to disk.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys

from conveyor.config import config_from_json, config_to_json
from conveyor.wire.addresses import make_run_dir, sweep_stale_run_dirs

# Variables of the launcher's environment that a remote stage needs; the rest (PATH, HOME, the
# launcher's PROMETHEUS_MULTIPROC_DIR) belong to the launcher's machine.
FORWARDED_PREFIXES = ("CONVEYOR_", "HF_", "TRANSFORMERS_", "TRITON_", "OMP_", "PYTHONUNBUFFERED")
NETWORK_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class StageHost:
    """Decorated with ray.remote by placement.py (this module imports no ray)."""

    def __init__(self) -> None:
        # Like the launcher's, named after this actor's pid: a host killed with its node (Ray
        # kills a dead worker's children too, so no stage cleans up) is swept at the next start.
        sweep_stale_run_dirs()
        self.run_dir = make_run_dir()
        self.metrics_dir = os.path.join(self.run_dir, "metrics")
        os.mkdir(self.metrics_dir, 0o700)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def where(self) -> tuple[str, str]:
        """(Ray node id, this node's IP): where the launcher's endpoints for this host point."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_ports(self, count: int) -> list[int]:
        import ray

        return free_ports(ray.util.get_node_ip_address(), count)

    def start(self, name: str, argv: list[str], config_json: bytes, env: dict[str, str]) -> int:
        """Start stage `name` (`STAGE INDEX _ RESTARTS`, the config path replaced by this node's
        copy); its pid on this node."""
        config = config_from_json(config_json)
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, run_dir=self.run_dir))
        if config.parallel.device == "cuda":
            # Ray shows this actor (and so its stages) only the GPU of its bundle, as cuda:0:
            # not cuda:rank, which a rank picks when it sees all of its machine's GPUs.
            config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, device="cuda:0"))
        path = os.path.join(self.run_dir, "config.json")
        with open(path, "wb") as f:
            f.write(config_to_json(config))
        child_env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        child_env.update({k: v for k, v in env.items() if k.startswith(FORWARDED_PREFIXES)})
        interface = _interface_of(self.where()[1])
        if interface is not None:  # torch.distributed's sockets on the node's address, unless the node says
            for variable in NETWORK_VARIABLES:
                child_env.setdefault(variable, interface)
        stage, index, restarts = argv[0], argv[1], argv[3]
        cmd = [sys.executable, "-m", "conveyor.stages", stage, index, path, restarts]
        self.processes[name] = subprocess.Popen(cmd, env=child_env)
        return self.processes[name].pid

    def poll(self, name: str) -> int | None:
        return self.processes[name].poll()

    def send_signal(self, name: str, sig: int) -> None:
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(signal.Signals(sig))

    def close(self) -> None:
        """Kill what is left and remove this node's run directory."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def free_ports(ip: str, count: int) -> list[int]:
    """Ports free on `ip` now, held open together so they differ. The stage that binds one later
    may race another program for it: it then fails to start, and the launcher's supervision sees
    an exited process."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((ip, 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` (gloo and NCCL otherwise pick one by hostname)."""
    import psutil  # type: ignore[import-untyped]  # a dependency of ray

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None
