"""The emulated device's host link: the KV host tier's copies (gpu/kv/host_tier.py's interface)
as time on a copy engine beside the compute stream, at the device's host-link bandwidth
(DeviceSpec.host_bw: PCIe 5.0 x16 on an H100 or H200). No bytes move: the emulated device keeps
no KV.

A batch of copies starts when the copy engine is free and, like HostTier's side stream, not
before the compute work queued ahead of it (a save reads blocks those passes write; a load may
fill a block they free); it takes its bytes over the link's bandwidth. `wait_on_stream` makes the
compute stream's later work wait for it, as a CUDA stream waiting on an event does.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.gpu.emulated.stream import VirtualStream


class LinkTransfer:
    """A batch of copies on the emulated link, from `start` to `end` on the stream's clock."""

    def __init__(self, compute: VirtualStream, start: float, end: float) -> None:
        self.compute, self.start, self.end = compute, start, end

    def ready(self) -> bool:
        return self.compute.clock() >= self.end

    def wait(self) -> None:
        self.compute.wait_until(self.end, spins=self.compute.spin_waits)

    def wait_on_stream(self) -> None:
        self.compute.tail = max(self.compute.tail, self.end)

    def seconds(self) -> float | None:
        return self.end - self.start if self.ready() else None


class EmulatedHostLink:
    """Stands in for HostTier on the emulated device: `num_slots` slots of `bytes_per_slot`."""

    def __init__(self, compute: VirtualStream, num_slots: int, bytes_per_slot: int, bandwidth: float) -> None:
        self.compute, self.num_slots, self.bytes_per_slot, self.bandwidth = compute, num_slots, bytes_per_slot, bandwidth
        self.free_at = compute.clock()  # when the copy engine is done with what it was given
        self.busy_s = 0.0  # the link's modelled time, both ways

    def save(self, blocks: Sequence[int], slots: Sequence[int]) -> LinkTransfer:
        return self._copy(len(blocks))

    def load(self, slots: Sequence[int], blocks: Sequence[int]) -> LinkTransfer:
        return self._copy(len(blocks))

    def block_bytes(self, slot: int) -> memoryview:
        return memoryview(bytearray(self.bytes_per_slot))  # nothing held: what the disk tier would write

    def _copy(self, num_blocks: int) -> LinkTransfer:
        seconds = num_blocks * self.bytes_per_slot / self.bandwidth
        start = max(self.free_at, self.compute.tail, self.compute.clock())
        self.free_at = start + seconds
        self.busy_s += seconds
        return LinkTransfer(self.compute, start, self.free_at)
