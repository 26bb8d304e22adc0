"""A forward pass on one GPU from a roofline: the pass is as slow as the slower of reading its
bytes and doing its arithmetic, plus a fixed floor for launching its kernels.

    latency = launch_s + comm(T) + max(memory_s, compute_s)
    memory_s  = (params * weight_bytes_per_param + kv_bytes_per_token * C) / (mem_bw * bw_util)
    compute_s = (2 * active_params * T + pair_flops * P) / (peak_flops * mfu)
    comm(T)   = comm_s + comm_s_per_token * T   (tensor parallelism's all-reduces; 0 on one GPU)

T, C and P are StepShape's tokens, KV entries read and query-key pairs. A decode pass (T small)
sits on the memory side: every weight is read once per pass whatever the batch, and each row
reads its whole KV. A long prompt sits on the compute side. Unlike costmodel.CostModel (a sum of
terms fitted to measurements), nothing here is fitted: `on` takes a device's row of devices.py
and a model's numbers, and every figure derived from it is an estimate.
"""

from __future__ import annotations

import dataclasses

from conveyor.gpu.emulated.costmodel import StepShape
from conveyor.gpu.emulated.devices import BW_UTIL, MFU, DeviceSpec


@dataclasses.dataclass(frozen=True)
class RooflineCost:
    params: float  # parameters read once per pass
    kv_bytes_per_token: float  # K and V over all layers for one cached token
    pair_flops: float  # attention FLOPs per query-key pair (QK^T and PV over all layers and heads)
    peak_flops: float  # FLOP/s, dense, in the weights' dtype
    mfu: float  # the achievable fraction of peak_flops
    mem_bw: float  # bytes/s
    bw_util: float  # the achievable fraction of mem_bw
    launch_s: float  # kernel launches and gaps per pass
    name: str
    weight_bytes_per_param: float = 2.0
    active_params: float | None = None  # parameters each token computes with (MoE: the routed few); None: params
    comm_s: float = 0.0  # per pass: the all-reduces' latency (tensor parallelism)
    comm_s_per_token: float = 0.0  # per token in the pass: the all-reduces' bytes over the link

    @classmethod
    def on(
        cls,
        device: DeviceSpec,
        *,
        params: float,
        kv_bytes_per_token: float,
        pair_flops: float,
        name: str,
        weight_bytes_per_param: float = 2.0,
        active_params: float | None = None,
        ranks: int = 1,
        allreduces_per_pass: int = 0,
        allreduce_bytes_per_token: float = 0.0,
    ) -> RooflineCost:
        """A model on `device` (devices.py's efficiencies), split over `ranks` GPUs by tensor
        parallelism: each rank holds and computes 1/ranks of the weights, the KV and the
        attention, and every pass makes `allreduces_per_pass` all-reduces of
        allreduce_bytes_per_token x T bytes between them."""
        per_token = device.allreduce_s(allreduce_bytes_per_token, ranks) - device.allreduce_s(0.0, ranks)
        return cls(
            params=params / ranks,
            kv_bytes_per_token=kv_bytes_per_token / ranks,
            pair_flops=pair_flops / ranks,
            peak_flops=device.peak_flops,
            mfu=MFU,
            mem_bw=device.mem_bw,
            bw_util=BW_UTIL,
            launch_s=device.launch_s,
            name=name,
            weight_bytes_per_param=weight_bytes_per_param,
            active_params=None if active_params is None else active_params / ranks,
            comm_s=allreduces_per_pass * device.allreduce_s(0.0, ranks),
            comm_s_per_token=allreduces_per_pass * per_token,
        )

    def memory_s(self, shape: StepShape) -> float:
        num_bytes = self.params * self.weight_bytes_per_param + self.kv_bytes_per_token * shape.context_tokens
        return num_bytes / (self.mem_bw * self.bw_util)

    def compute_s(self, shape: StepShape) -> float:
        active = self.params if self.active_params is None else self.active_params
        flops = 2.0 * active * shape.num_tokens + self.pair_flops * shape.attention_pairs
        return flops / (self.peak_flops * self.mfu)

    def latency(self, shape: StepShape) -> float:
        """Seconds for one pass; an empty pass costs nothing."""
        if shape.num_tokens == 0:
            return 0.0
        comm = self.comm_s + self.comm_s_per_token * shape.num_tokens
        return self.launch_s + comm + max(self.memory_s(shape), self.compute_s(shape))
