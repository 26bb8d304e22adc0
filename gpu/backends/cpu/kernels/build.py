"""Build and load the C++ CPU kernels.

Each .cpp here is compiled once per (source and the headers beside it, flags, compiler, CPU) into
the conveyor cache directory, keyed by a hash of all of them, written under a temporary name and renamed into place, so
processes that start together (a tensor-parallel group, a test suite) never load a half-written
file. The target flags are an ISA variant's (isa.py; CONVEYOR_CPU_ISA, default -march=native),
and a variant this CPU lacks a feature of is refused before the compiler runs. -march=native is
why the CPU's flags are in the key: a cache directory shared with another machine must not hand
it instructions it lacks. The libraries link against libgomp, which torch has already loaded
(torch/lib/libgomp.so.1, same soname), so kernels and torch share one OpenMP pool instead of two
pools spinning against each other on the same cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from conveyor.config import env
from conveyor.gpu.backends.cpu.kernels import isa

log = logging.getLogger(__name__)

# Compiled and linked in two steps: -ffast-math (vectorised exp, reassociated sums) is for the
# compile only. Linked with it, gcc adds crtfastmath.o, whose constructor sets flush-to-zero for
# the whole process when the library loads, silently changing torch's float results too. The
# target flags (-march=...) are the ISA variant's.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120


@functools.cache
def load_library(name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """The compiled `name`.cpp of this package, built for the ISA variant `variant` (isa.py;
    None: CONVEYOR_CPU_ISA's), or None (logged once per name and variant) where it cannot be had:
    CONVEYOR_CPU_KERNELS=0, an unknown variant or one this CPU lacks a feature of, no compiler, a
    failed build. Callers then use torch. The tests build every variant this CPU can run."""
    if not env.cpu_kernels_enabled():
        return None
    variant = variant or env.cpu_isa()
    try:
        target = isa.variant(variant)
        isa.check_runs_here(target)
        return ctypes.CDLL(str(_build(Path(__file__).with_name(f"{name}.cpp"), target.flags)))
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:
        log.warning("CPU kernels %s (%s) unavailable, using the torch path: %s", name, variant, exc)
        return None


def _build(source: Path, target_flags: tuple[str, ...]) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    flags = " ".join(COMPILE_FLAGS + target_flags + LINK_FLAGS)
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
    for part in (source.read_bytes(), *headers, flags.encode(), version.encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = env.cache_dir() / "kernels"
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{source.stem}-") as tmp:
        obj, lib = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
        for command in ([compiler, *COMPILE_FLAGS, *target_flags, str(source), "-o", obj], [compiler, *LINK_FLAGS, obj, "-o", lib]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)
    log.info("built %s", target)
    return target


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), or the torch build's view of the CPU elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()
