"""The GPUs conveyor can emulate (`conveyor serve --device emulated --emulate NAME`), one row each
in DEVICES: what a roofline (roofline.py) needs of a device. The simulator's H100 preset
(presets.py) and the emulated device (gpu/emulated/) read the same rows.

Invariants: a row's peak FLOP/s, bandwidth, link and memory are the datasheet's or nvidia-smi's
(sources beside DEVICES); what a pass achieves of them is an ASSUMPTION (MFU, BW_UTIL, the launch
floor, the all-reduce's latency), stated once here for every row. Nothing here was measured on
these devices by conveyor: figures derived from this table are estimates (the simulator) or
emulated (the emulated device), and say so.
"""

from __future__ import annotations

import dataclasses

# ASSUMPTIONS, one for every row.
MFU = 0.6  # achievable fraction of peak FLOP/s
BW_UTIL = 0.8  # achievable fraction of memory bandwidth
ALLREDUCE_LATENCY_S = 8e-6  # a tensor-parallel all-reduce: a ring (allreduce_s) plus this
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # bytes/s
    memory_bytes: int  # what the device reports as its total
    # ASSUMED, per pass beyond arithmetic and memory traffic: ~32 layers x ~12 kernels at ~1 us
    # of gap each, with CUDA graphs (0.4 ms; 0.5 ms on the A100's slower clocks).
    launch_s: float
    link_bw: float  # NVLink bytes/s per direction, for tensor-parallel all-reduces
    peak_fp8_flops: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores); gemm_roofline.py's W8A8
    # Host <-> device bytes/s per direction, achievable: PCIe 5.0 x16 (64 GB/s) or 4.0 x16 (32 GB/s)
    # times HOST_LINK_UTIL (ASSUMED, as BW_UTIL is for memory). The KV host tier's copies (gpu/emulated/host_link.py).
    host_bw: float = 64e9 * 0.8

    def allreduce_s(self, num_bytes: float, ranks: int) -> float:
        """One ring all-reduce of `num_bytes` over `ranks` devices (0 on one device)."""
        if ranks <= 1:
            return 0.0
        return ALLREDUCE_LATENCY_S + 2 * (ranks - 1) / ranks * num_bytes / self.link_bw


# FLOP/s, bandwidth and NVLink are the SXM datasheets'; the memory is what nvidia-smi reports (the
# H100's and H200's as read on this workplace's machines, docs of the device tool).
DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100", 989e12, 3.35e12, 81559 * MIB, 0.4e-3, 450e9, 1979e12),
        DeviceSpec("h200", 989e12, 4.8e12, 143771 * MIB, 0.4e-3, 450e9, 1979e12),
        DeviceSpec("a100-80g", 312e12, 2.039e12, 81920 * MIB, 0.5e-3, 300e9, host_bw=32e9 * 0.8),
    )
}
DEVICE_NAMES = tuple(DEVICES)
