"""Compile Triton kernels for an H100 (sm_90) down to a cubin with Triton's bundled ptxas, on a
machine without a GPU: it catches what the interpreter lets through (a loop-carried value that
changes type, register spills). Run in a fresh interpreter without TRITON_INTERPRET, which would
replace the kernels with the interpreter's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def compile_for_sm90(script: str, timeout_s: float) -> None:
    """Run `script` (which calls triton.compile for target cuda 90) and assert it succeeded; skip
    where this triton build bundles no ptxas."""
    ptxas = os.path.join(os.path.dirname(pytest.importorskip("triton").__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton build bundles no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-4000:]
