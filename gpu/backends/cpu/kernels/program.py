"""Recorded kernel programs: a forward's C kernel calls, recorded once, replayed from one C call.

A decode step of a small model on the CPU is hundreds of kernel calls of microseconds each, and
the Python around them (the model's modules, the ctypes faces' checks, the calls themselves) cost
as much as the kernels (docs/benchmarks/cpu-isa.md: 1.6 ms of a 7.2 ms one-row step outside the
ops, and ~5 us a call for the small ones). This is the CPU's counterpart of a CUDA graph: run the
forward once under `record()`; each `Kernel` called meanwhile is kept as its packed entry and its
arguments as 64-bit words; `Program.replay()` then makes the same calls, with the same pointers,
in order, from C (program.cpp), with no Python between them.

Invariants, which make a replay the forward it recorded:
- only Kernel calls compute during a recording: a torch op other than a view of a tensor that
  exists or a fresh allocation raises NotRecordable (`_KernelsOnly`), as does a Kernel whose
  result steers Python (`replayable=False`); the caller then runs that forward eagerly;
- the tensors a recording allocates come from an Arena, each region free again once its
  tensor (and every view of it) dies, as in the recorded forward, and then reused by later
  allocations of that recording or of another one on the same arena (a CUDA graph pool's rule:
  programs of one arena never run at once, and a program's output is valid until the next replay
  of any of them); the arena's memory is never handed back, so the addresses a program holds
  stay its own, and what is live when the recording ends (its output) is kept by the Program;
- what changes between replays lives in tensors the caller refills in place (the decode graphs'
  static buffers, gpu/step/cuda_graphs.py); what an ops read on the host while recording (row
  counts, shapes, the path a call took) is fixed with the recording, as a CUDA graph's grids are;
- one recording at a time, in the thread that runs the forward (a worker runs one step at a time).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import functools
import struct
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.ops import NotRecordable

# Ops that make no data: views of their input (checked: the output must share its storage) and
# allocations. Anything else computes, and a replay would skip it.
_VIEWS = frozenset(
    """view _unsafe_view reshape reshape_as view_as slice select narrow unsqueeze squeeze permute transpose t
    expand as_strided alias detach split split_with_sizes unbind unflatten flatten contiguous resolve_conj
    resolve_neg""".split()
)
_ALLOCATIONS = frozenset("empty empty_like empty_strided new_empty".split())


class Kernel:
    """One C entry of a kernel library through ctypes: called as the ctypes function, and
    recorded while a recording is open. The library exports `<name>_packed` beside it
    (packed_call.h) unless replayable is False: a kernel whose result the caller reads on the host
    (a count, a status that steers Python), which a replay could not give back."""

    def __init__(self, lib: ctypes.CDLL, name: str, argtypes: Sequence[Any], restype: Any = None, replayable: bool = True) -> None:
        self.name = name
        self.fn = getattr(lib, name)
        self.fn.argtypes = list(argtypes)
        self.fn.restype = restype
        self.entry = ctypes.cast(getattr(lib, f"{name}_packed"), ctypes.c_void_p).value if replayable else None
        self._floats = frozenset(i for i, t in enumerate(argtypes) if t is ctypes.c_float)

    def __call__(self, *args: Any) -> Any:
        if _recording is not None:
            _recording.add(self, args)
        return self.fn(*args)

    def words(self, args: tuple[Any, ...]) -> list[int]:
        """The call's arguments as packed_call.h reads them: an address or integer as is (None: 0),
        a float's bits in the low 32."""
        words = []
        for i, arg in enumerate(args):
            if i in self._floats:
                words.append(struct.unpack("<I", struct.pack("<f", arg))[0])
            elif arg is None or isinstance(arg, int):
                words.append(arg or 0)
            else:
                raise NotRecordable(f"{self.name}: argument {i} is a {type(arg).__name__}, not an address or integer")
        return words


@dataclasses.dataclass(frozen=True)
class Program:
    """A recording: `words` [entry, n, word 0 .. n - 1] per call (program.cpp), its arena, and
    the tensors it keeps alive (`keeping`: the output its caller reads)."""

    words: torch.Tensor  # int64
    num_calls: int
    arena: Arena
    kept: tuple[torch.Tensor, ...] = ()

    @property
    def num_bytes(self) -> int:
        """Its arena's memory (shared with the arena's other programs)."""
        return self.arena.num_bytes

    def keeping(self, *tensors: torch.Tensor) -> Program:
        return dataclasses.replace(self, kept=self.kept + tensors)

    def replay(self) -> None:
        """The recorded calls again, in order, on whatever the recorded tensors hold now."""
        _replayer()(self.words.data_ptr(), self.words.numel())


class _Recording:
    def __init__(self) -> None:
        self.words: list[int] = []
        self.num_calls = 0

    def add(self, kernel: Kernel, args: tuple[Any, ...]) -> None:
        if kernel.entry is None:
            raise NotRecordable(f"{kernel.name}'s result steers the host: a replay could not give it back")
        words = kernel.words(args)
        self.words += [kernel.entry, len(words), *words]
        self.num_calls += 1


class Arena:
    """Host memory for the tensors recordings allocate: chunks that never move or shrink, each
    with its free regions, a region free again when the storage made on it dies (see the module
    docstring). First fit, 64-byte aligned; a request no chunk can take opens a chunk."""

    CHUNK_BYTES = 8 << 20
    ALIGN = 64

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []  # uint8
        self.free: list[list[tuple[int, int]]] = []  # per chunk, (start, end) byte offsets, sorted, coalesced

    @property
    def num_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor of `like`'s dtype, shape and strides on arena memory (its storage its own)."""
        nbytes = -(-max(like.untyped_storage().nbytes(), 1) // self.ALIGN) * self.ALIGN
        chunk, start = self._take(nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(self.chunks[chunk].data_ptr() + start)
        weakref.finalize(buffer, self._release, chunk, start, start + nbytes)  # when the storage dies
        return torch.frombuffer(buffer, dtype=torch.uint8).view(like.dtype).as_strided(like.shape, like.stride())

    def _take(self, nbytes: int) -> tuple[int, int]:
        for chunk, regions in enumerate(self.free):
            for i, (start, end) in enumerate(regions):
                if end - start >= nbytes:
                    regions[i : i + 1] = [(start + nbytes, end)] if end - start > nbytes else []
                    return chunk, start
        self.chunks.append(torch.empty(max(self.CHUNK_BYTES, nbytes), dtype=torch.uint8))
        self.free.append([(nbytes, self.chunks[-1].numel())] if self.chunks[-1].numel() > nbytes else [])
        return len(self.chunks) - 1, 0

    def _release(self, chunk: int, start: int, end: int) -> None:
        regions = self.free[chunk]
        i = bisect.bisect(regions, (start, end))
        if i < len(regions) and regions[i][0] == end:  # merge with the next
            end = regions.pop(i)[1]
        if i > 0 and regions[i - 1][1] == start:  # and the previous
            start = regions.pop(i - 1)[0]
            i -= 1
        regions.insert(i, (start, end))


class _KernelsOnly(TorchDispatchMode):
    """Serves allocations from the arena and lets views through; any other torch op raises."""

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if name in _ALLOCATIONS:
            return self.arena.allocate(out)
        if name in _VIEWS:
            storages = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
            if any(t.untyped_storage().data_ptr() not in storages for t in outputs):
                raise NotRecordable(f"{func} copied its input: a replay would skip the copy")
            return out
        raise NotRecordable(f"{func} computes in torch: a replay would skip it")


_recording: _Recording | None = None


def available() -> bool:
    """Whether programs can be replayed here (program.cpp built)."""
    return _replayer() is not None


@contextlib.contextmanager
def record(arena: Arena) -> Iterator[list[Program]]:
    """Record the Kernel calls of the block (run for real meanwhile), its tensors allocated on
    `arena`, into a Program found in the yielded list once the block ends (keep its output alive
    with it: `keeping`); NotRecordable from the block where it did other work."""
    global _recording
    if _recording is not None:
        raise RuntimeError("recordings do not nest")
    recording, guard = _Recording(), _KernelsOnly(arena)
    found: list[Program] = []
    _recording = recording
    try:
        with guard:
            yield found
    finally:
        _recording = None
    words = torch.tensor(recording.words, dtype=torch.int64)
    found.append(Program(words, recording.num_calls, arena))


@functools.cache
def _replayer() -> Any:
    lib = load_library("program")
    if lib is None:
        return None
    fn = lib.conveyor_replay
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64], None
    return fn
