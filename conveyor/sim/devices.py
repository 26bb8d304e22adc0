"""The GPUs conveyor can emulate (`conveyor serve --device emulated --emulate NAME`), one row each:
what a roofline (roofline.py) needs of a device. The simulator's H100 preset reads its row too.

    name      bf16 dense FLOP/s   memory bandwidth   memory (nvidia-smi)   launch floor   NVLink per direction
    h100      989e12              3.35e12 B/s        81559 MiB             0.4 ms         450e9 B/s
    h200      989e12              4.8e12 B/s         143771 MiB            0.4 ms         450e9 B/s
    a100-80g  312e12              2.039e12 B/s       81920 MiB             0.5 ms         300e9 B/s

FLOP/s, bandwidth and NVLink are the SXM datasheets'; the memory is what nvidia-smi reports
(H100 and H200 as read on this workplace's machines, docs of the device tool). The rest are
ASSUMPTIONS, one for every row, stated once here:
- a kernel achieves MFU = 60% of the peak FLOP/s and 80% of the memory bandwidth;
- a pass costs a launch floor beyond its arithmetic and bytes: ~32 layers x ~12 kernels at
  ~1 us of gap each, with CUDA graphs (0.5 ms on the A100's slower clocks);
- a tensor-parallel all-reduce of B bytes over N ranks takes 2 (N - 1) / N * B / NVLink
  (a ring) plus 8 us of latency.
Nothing here was measured on these devices by conveyor: figures derived from this table are
estimates (the simulator) or emulated (the emulated device), and say so.
"""

from __future__ import annotations

import dataclasses

MFU = 0.6  # achievable fraction of peak FLOP/s
BW_UTIL = 0.8  # achievable fraction of memory bandwidth
ALLREDUCE_LATENCY_S = 8e-6
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # bytes/s
    memory_bytes: int  # what the device reports as its total
    launch_s: float  # per pass, beyond arithmetic and memory traffic
    link_bw: float  # NVLink bytes/s per direction, for tensor-parallel all-reduces

    def allreduce_s(self, num_bytes: float, ranks: int) -> float:
        """One ring all-reduce of `num_bytes` over `ranks` devices (0 on one device)."""
        if ranks <= 1:
            return 0.0
        return ALLREDUCE_LATENCY_S + 2 * (ranks - 1) / ranks * num_bytes / self.link_bw


DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100", 989e12, 3.35e12, 81559 * MIB, 0.4e-3, 450e9),
        DeviceSpec("h200", 989e12, 4.8e12, 143771 * MIB, 0.4e-3, 450e9),
        DeviceSpec("a100-80g", 312e12, 2.039e12, 81920 * MIB, 0.5e-3, 300e9),
    )
}
DEVICE_NAMES = tuple(DEVICES)
