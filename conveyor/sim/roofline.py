"""A forward pass on one GPU from a roofline: the pass is as slow as the slower of reading its
bytes and doing its arithmetic, plus a fixed floor for launching its kernels.

    latency = launch_s + max(memory_s, compute_s)
    memory_s  = (params * weight_bytes_per_param + kv_bytes_per_token * C) / (mem_bw * bw_util)
    compute_s = (2 * params * T + pair_flops * P) / (peak_flops * mfu)

T, C and P are StepShape's tokens, KV entries read and query-key pairs. A decode pass (T small)
sits on the memory side: every weight is read once per pass whatever the batch, and each row
reads its whole KV. A long prompt sits on the compute side. Unlike costmodel.CostModel (a sum of
terms fitted to measurements), nothing here is fitted: presets.py states every number.
"""

from __future__ import annotations

import dataclasses

from conveyor.sim.costmodel import StepShape


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

    def memory_s(self, shape: StepShape) -> float:
        num_bytes = self.params * self.weight_bytes_per_param + self.kv_bytes_per_token * shape.context_tokens
        return num_bytes / (self.mem_bw * self.bw_util)

    def compute_s(self, shape: StepShape) -> float:
        flops = 2.0 * self.params * shape.num_tokens + self.pair_flops * shape.attention_pairs
        return flops / (self.peak_flops * self.mfu)

    def latency(self, shape: StepShape) -> float:
        """Seconds for one pass; an empty pass costs nothing."""
        if shape.num_tokens == 0:
            return 0.0
        return self.launch_s + max(self.memory_s(shape), self.compute_s(shape))
