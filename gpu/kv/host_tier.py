"""The KV host tier's pool (--kv-offloading-size): `num_slots` blocks in host memory and the
copies between them and the device pool. The scheduler decides which block goes to which slot;
this moves the bytes.

The device pool is one tensor per layer, [2, num_blocks, ...] (gpu/backends/base.py: every
backend's block dim is 1; the layout inside a block is the backend's and is copied as bytes). A
slot is one block of every layer, keys and values, laid out slot-major as bytes,
    pool [num_slots, bytes_per_slot] uint8: slot s = layer 0's [2, block] bytes, then layer 1's, ...
so that `block_bytes(slot)` is one contiguous buffer for the disk tier (disk_tier.py) to write or
read into. Each layer is copied for a whole batch at once (index_select / index_copy_), never in a
Python loop over blocks.

On CUDA the pool is pinned (registered exactly: torch's pinned allocator would round 40 GiB up to
64) and the copies run on a side stream through a device staging buffer of a few MiB, chunk by
chunk: device blocks <-> staging per layer, staging <-> pool one copy per run of consecutive slots
(all layers at once). `save` and `load` return a `KVTransfer`, which the caller polls (`ready`) or
orders the compute stream after (`wait_on_stream`, a device-side wait). On a CPU they are done on
return. Who may touch what while a transfer is in flight:
- save(blocks, slots): the blocks must not be rewritten, and the slots not read, until it is done:
  the side stream reads the blocks after the passes queued before the call;
- load(slots, blocks): the blocks must not be read (wait_on_stream before the pass that needs
  them), and the slots not rewritten, until done; the blocks are written only after the passes
  queued before the call, so a block being freed by one of them may be the destination;
- fill(slot, ...) and block_bytes(slot): only for a slot no transfer in flight touches.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

GIB = 1024**3
STAGING_BYTES = 64 * 2**20  # the CUDA staging buffer: a chunk of ~1 ms of PCIe 5.0


class Transfer(Protocol):
    """A batch of copies in flight (KVTransfer here; the emulated device's link has its own)."""

    def ready(self) -> bool: ...

    def wait(self) -> None: ...

    def wait_on_stream(self) -> None: ...

    def seconds(self) -> float | None: ...


class KVCopies(Protocol):
    """What the KV host tier's step feature moves bytes with: HostTier, or a platform's stand-in."""

    def save(self, blocks: Sequence[int], slots: Sequence[int]) -> Transfer: ...

    def load(self, slots: Sequence[int], blocks: Sequence[int]) -> Transfer: ...

    def block_bytes(self, slot: int) -> memoryview: ...


def num_host_slots(gib: float, bytes_per_block: int) -> int:
    """Slots of `bytes_per_block` (the backend's bytes_per_block: all layers) in `gib` GiB."""
    return int(gib * GIB // bytes_per_block)


class KVTransfer:
    """A batch of block copies between the device pool and the host pool. `done` is None where
    they completed on issue (a CPU: `host_seconds` is how long they took); on CUDA `issued` marks
    the compute stream's point they waited for."""

    def __init__(
        self, done: torch.cuda.Event | None = None, issued: torch.cuda.Event | None = None, host_seconds: float = 0.0
    ) -> None:
        self.done, self.issued, self.host_seconds = done, issued, host_seconds

    def seconds(self) -> float | None:
        """How long the copies took from when they could start (None while in flight)."""
        if self.done is None or self.issued is None:
            return self.host_seconds
        return self.issued.elapsed_time(self.done) / 1000 if self.done.query() else None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        """Block the host until the copies are done."""
        if self.done is not None:
            self.done.synchronize()

    def wait_on_stream(self) -> None:
        """Make the current stream's later work wait for the copies, on the device."""
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)


class HostTier:
    """`num_slots` host blocks shaped after `kv_caches` (allocate_kv_caches' tensors)."""

    def __init__(
        self, kv_caches: list[torch.Tensor], num_slots: int, *, pool: torch.Tensor | None = None, staging_bytes: int = STAGING_BYTES
    ) -> None:
        """`pool`: the slots' memory, [num_slots, bytes_per_slot] uint8 on the host, when it was
        filled before the device pool existed (blocks read from disk at start-up)."""
        if num_slots < 1:
            raise ValueError("the host tier needs at least one slot")
        num_blocks = kv_caches[0].shape[1]
        for cache in kv_caches:
            if cache.shape[:2] != (2, num_blocks) or not cache.is_contiguous():
                raise ValueError(f"a KV cache of shape {tuple(cache.shape)}: expected contiguous [2, {num_blocks}, ...]")
        self.device = kv_caches[0].device
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        # Each layer as rows of bytes, [num_blocks, 2, bytes of one block's keys] (a view).
        self._device_rows = [c.view(torch.uint8).view(2, num_blocks, -1).transpose(0, 1) for c in kv_caches]
        layer_bytes = [rows[0].numel() for rows in self._device_rows]
        self.bytes_per_slot = sum(layer_bytes)
        self._cuda = self.device.type == "cuda"
        self._unpin: Callable[[], object] = lambda: None
        self.pool = self._allocate_pool(pool)  # [num_slots, bytes_per_slot] uint8, on the host
        self._pool_rows = _layer_rows(self.pool, layer_bytes)
        self._stream: torch.cuda.Stream | None = None
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            num_staged = max(1, min(num_slots, staging_bytes // self.bytes_per_slot))
            self._staging = torch.empty((num_staged, self.bytes_per_slot), dtype=torch.uint8, device=self.device)
            self._staging_rows = _layer_rows(self._staging, layer_bytes)

    def save(self, blocks: Sequence[int], slots: Sequence[int]) -> KVTransfer:
        """Copy device block blocks[i] into host slot slots[i], every layer (slots distinct)."""
        self._check(blocks, slots, dst_is_slot=True)
        if not blocks:
            return KVTransfer()
        if not self._cuda:
            blocks_t, slots_t = _indices(blocks), _indices(slots)
            for dev, host in zip(self._device_rows, self._pool_rows):
                host.index_copy_(0, slots_t, dev.index_select(0, blocks_t))
            return KVTransfer()
        return self._on_side_stream(blocks, slots, to_host=True)

    def load(self, slots: Sequence[int], blocks: Sequence[int]) -> KVTransfer:
        """Copy host slot slots[i] into device block blocks[i], every layer (blocks distinct)."""
        self._check(blocks, slots, dst_is_slot=False)
        if not blocks:
            return KVTransfer()
        if not self._cuda:
            started = time.perf_counter()
            blocks_t, slots_t = _indices(blocks), _indices(slots)
            for dev, host in zip(self._device_rows, self._pool_rows):
                dev.index_copy_(0, blocks_t, host.index_select(0, slots_t))
            return KVTransfer(host_seconds=time.perf_counter() - started)
        return self._on_side_stream(blocks, slots, to_host=False)

    def block_bytes(self, slot: int) -> memoryview:
        """Slot `slot`'s bytes, bytes_per_slot of them, writable: what the disk tier writes, or
        reads a block into."""
        return self.pool[slot].numpy().data

    def fill(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Slot `slot` := data (bytes_per_slot bytes: a block read from disk)."""
        self.block_bytes(slot)[:] = memoryview(data).cast("B")

    def close(self) -> None:
        """Wait for the transfers in flight and unpin the pool (CUDA); unusable after."""
        if self._stream is not None:
            self._stream.synchronize()
        self._unpin()

    def _allocate_pool(self, pool: torch.Tensor | None) -> torch.Tensor:
        shape = (self.num_slots, self.bytes_per_slot)
        if pool is not None and (tuple(pool.shape) != shape or pool.dtype != torch.uint8 or not pool.is_contiguous()):
            raise ValueError(f"a pool of {tuple(pool.shape)} {pool.dtype}: expected contiguous {shape} uint8")
        if not self._cuda:
            return pool if pool is not None else torch.empty(shape, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        if not hasattr(cudart, "cudaHostRegister"):  # an older torch: pinned, rounded up to a power of two
            return pool.pin_memory() if pool is not None else torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        # Page-locked, so that copies run asynchronously at full PCIe speed; unpinned before the
        # memory goes back (close, or when the tier is collected).
        pool = pool if pool is not None else torch.empty(shape, dtype=torch.uint8)
        torch.cuda.check_error(cudart.cudaHostRegister(pool.data_ptr(), pool.numel(), 0))
        self._unpin = weakref.finalize(self, _unregister, pool.data_ptr())
        self._unpin.atexit = False  # at exit the process's pinned pages go with it
        return pool

    def _on_side_stream(self, blocks: Sequence[int], slots: Sequence[int], *, to_host: bool) -> KVTransfer:
        """The CUDA copies, on the side stream after the work queued so far on the current one,
        in chunks of the staging buffer's size, each sorted by slot so that consecutive slots are
        one copy."""
        assert self._stream is not None
        issued = torch.cuda.Event(enable_timing=True)
        issued.record()  # on the compute stream: after the passes queued so far
        pairs = sorted(zip(slots, blocks))
        chunk = self._staging.shape[0]
        with torch.cuda.stream(self._stream):
            if to_host:
                self._stream.wait_event(issued)
            for start in range(0, len(pairs), chunk):
                part = pairs[start : start + chunk]
                n = len(part)
                blocks_t = _indices([b for _, b in part]).pin_memory().to(self.device, non_blocking=True)
                if to_host:  # blocks -> staging rows 0..n (each layer), then staging -> slots
                    for dev, staged in zip(self._device_rows, self._staging_rows):
                        staged[:n].copy_(dev.index_select(0, blocks_t))
                    for i, j, slot in _runs([s for s, _ in part]):
                        self.pool[slot : slot + j - i].copy_(self._staging[i:j], non_blocking=True)
                else:  # slots -> staging (H2D overlaps the passes before), then staging -> blocks
                    for i, j, slot in _runs([s for s, _ in part]):
                        self._staging[i:j].copy_(self.pool[slot : slot + j - i], non_blocking=True)
                    if start == 0:
                        self._stream.wait_event(issued)
                    for dev, staged in zip(self._device_rows, self._staging_rows):
                        dev.index_copy_(0, blocks_t, staged[:n])
            done = torch.cuda.Event(enable_timing=True)
            done.record(self._stream)
        return KVTransfer(done, issued)

    def _check(self, blocks: Sequence[int], slots: Sequence[int], *, dst_is_slot: bool) -> None:
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} blocks and {len(slots)} slots")
        if any(not 0 <= b < self.num_blocks for b in blocks) or any(not 0 <= s < self.num_slots for s in slots):
            raise ValueError(f"blocks {list(blocks)} or slots {list(slots)} outside [0, {self.num_blocks}), [0, {self.num_slots})")
        dst = slots if dst_is_slot else blocks
        if len(set(dst)) != len(dst):
            raise ValueError(f"a transfer writes a {'slot' if dst_is_slot else 'block'} twice: {list(dst)}")


def _unregister(pointer: int) -> None:
    torch.cuda.synchronize()  # no copy may still be reading or writing the pages
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(pointer))


def _indices(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def _layer_rows(flat: torch.Tensor, layer_bytes: list[int]) -> list[torch.Tensor]:
    """[rows, bytes_per_slot] uint8 -> one view per layer, [rows, 2, bytes of keys]."""
    views, offset = [], 0
    for n in layer_bytes:
        views.append(flat[:, offset : offset + n].unflatten(1, (2, n // 2)))
        offset += n
    return views


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted slots -> (i, j, slots[i]) for each run slots[i:j] of consecutive slots."""
    runs, i = [], 0
    for j in range(1, len(slots) + 1):
        if j == len(slots) or slots[j] != slots[j - 1] + 1:
            runs.append((i, j, slots[i]))
            i = j
    return runs
