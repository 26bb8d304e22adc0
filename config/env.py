"""Every environment variable conveyor reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated checkpoints (the embedded default model) are kept."""
    root = os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor"
    )
    return Path(root)


def log_level() -> str:
    return os.environ.get("CONVEYOR_LOG_LEVEL", "info")


def prometheus_multiproc_dir() -> str | None:
    """prometheus-client's own variable: the launcher sets it for every stage process."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def cpu_kernels_enabled() -> bool:
    """CONVEYOR_CPU_KERNELS=0 keeps the worker on the torch reference paths on CPU (no compiler
    is called); the default builds and uses the C++ kernels of gpu/backends/cpu/kernels."""
    return os.environ.get("CONVEYOR_CPU_KERNELS", "1") != "0"


def cpu_isa() -> str:
    """CONVEYOR_CPU_ISA: the instruction-set variant the C++ CPU kernels are built in, one of
    gpu/backends/cpu/kernels/isa.py's VARIANTS (x86-64-v3, x86-64-v4-vnni-bf16, ...): what an older
    or another vendor's CPU runs, measured on this one. The default builds for this CPU."""
    return os.environ.get("CONVEYOR_CPU_ISA") or "native"


API_KEY_VARIABLE = "CONVEYOR_API_KEY"


def api_key_from_env() -> str | None:
    """The API key, when given in the environment. The launcher also hands a key given by flag or
    file to its stages this way, so the key is never written into the run directory."""
    return os.environ.get(API_KEY_VARIABLE) or None


CURVE_KEYS_VARIABLE = "CONVEYOR_CURVE_KEYS"


def curve_keys_from_env() -> str | None:
    """The run's CurveZMQ keys (wire/curve.py), which the launcher makes at start and hands only
    to its stage processes, like the API key: never in the run directory or the config file."""
    return os.environ.get(CURVE_KEYS_VARIABLE) or None


DIST_INIT_METHOD_VARIABLE = "CONVEYOR_DIST_INIT_METHOD"


def dist_init_method_from_env() -> str | None:
    """Where an engine's tensor-parallel ranks meet (torch.distributed's init_method,
    `tcp://ip:port`): set by the Ray placement (stages/ray/) to a port on rank 0's node; unset,
    the ranks of one machine meet through a file store in the run directory."""
    return os.environ.get(DIST_INIT_METHOD_VARIABLE) or None
