"""Tell glibc's malloc to keep freed memory, so a CPU step's activations reuse warm pages.

torch's CPU allocator hands every tensor to malloc and frees it when the tensor dies. glibc
serves a request above M_MMAP_THRESHOLD (128 KiB at first, adapting up to 32 MiB) with a fresh
mmap and unmaps it on free, and gives the top of the heap back to the kernel once more than
M_TRIM_THRESHOLD is free there. A CPU forward pass allocates and frees megabytes per op (a
2048-token step's MLP activations are 5.6 MiB each), so each op page-faulted fresh memory the
kernel had to zero first: a quarter of a prefill step on the tiny model. With both thresholds
at 1 GiB, freed activations stay in the heap and the next op reuses them. vLLM's CPU backend
gets the same effect by preloading tcmalloc.

Process-wide, and only sensible in a process that does little else: the worker stage, or a
CPU ModelRunner in the Python API.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds; False (and nothing changed) without glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
    if not done:
        log.warning("glibc refused the malloc thresholds; CPU steps will page-fault their activations")
    return done
