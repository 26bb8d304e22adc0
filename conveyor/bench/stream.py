"""The machine's memory bandwidth, measured as STREAM does: `conveyor bench roofline`'s denominator.

Three kernels over float32 arrays of `array_bytes` each, by torch ops (multi-threaded by torch's
OpenMP pool, the pool the cpu backend's C++ kernels share; numpy's one thread reached no more
here):
  copy   b = a                 (b.copy_(a))                  2 arrays: 1 read, 1 written
  triad  a = b + s * c         (torch.add(b, c, alpha=s))    3 arrays: 2 read, 1 written
  read   sum(a)                (a.sum())                     1 array read: not STREAM's; a decode
                                                             step mostly reads (its weights)
Bytes are counted as STREAM counts them: each array once per pass. Write-allocate traffic (the
line a store first reads into the cache) is NOT counted, STREAM's convention; a copy whose stores
bypass the cache (glibc's memcpy does for large buffers) has none, a triad's stores do, so the
bus moves up to 4/3 of triad's count. Arrays should be well past the last-level cache (the
default: 4x the L3, `last_level_cache_bytes`), else the figure is the cache's.

Each measurement is one untimed pass (the pages touched, the pool awake), then `repeats` timed
passes; STREAM reports the best, and a shared machine makes the median worth a look too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ARRAYS = {"copy": 2, "triad": 3, "read": 1}  # kernel -> arrays each pass reads or writes once
TRIAD_SCALAR = 3.0


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    kind: str  # one of ARRAYS
    threads: int
    bytes_per_pass: int  # ARRAYS[kind] x one array's bytes
    seconds: tuple[float, ...]  # each timed pass

    @property
    def best_gbps(self) -> float:
        return self.bytes_per_pass / min(self.seconds) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.bytes_per_pass / statistics.median(self.seconds) / 1e9


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's (and so the C++ kernels') OpenMP threads set to `threads` inside, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(kind: str, array_bytes: int, threads: int, repeats: int) -> Bandwidth:
    """One STREAM kernel over arrays of about `array_bytes` (whole float32 elements), timed
    `repeats` times on `threads` threads."""
    import torch

    if kind not in ARRAYS:
        raise ValueError(f"bandwidth kernel {kind!r}: one of {', '.join(ARRAYS)}")
    if repeats < 1 or array_bytes < 4:
        raise ValueError("need at least one repeat and one element")
    n = array_bytes // 4
    a = torch.full((n,), 1.0)
    b = torch.full((n,), 2.0) if ARRAYS[kind] > 1 else a
    c = torch.full((n,), 0.5) if ARRAYS[kind] > 2 else a
    passes: dict[str, Callable[[], object]] = {
        "copy": lambda: b.copy_(a),
        "triad": lambda: torch.add(b, c, alpha=TRIAD_SCALAR, out=a),
        "read": lambda: a.sum(),
    }
    run = passes[kind]
    seconds = []
    with torch_threads(threads):
        run()
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
    return Bandwidth(kind, threads, ARRAYS[kind] * n * 4, tuple(seconds))


def last_level_cache_bytes() -> int | None:
    """The L3's bytes summed over its instances (as lscpu's "L3 cache" line), from sysfs; None
    where sysfs does not say (no L3, not Linux)."""
    instances: dict[str, int] = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()  # "32768K"
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        instances[shared] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return sum(instances.values()) or None
