"""CPU kernels in C++, compiled on first use with the machine's compiler and called via ctypes.

Only what torch does badly on a CPU lives here, float32 only:
- paged_attention.cpp: attention reading the KV cache in place through the block tables (the
  torch path gathers every context into a padded copy, each layer, each step);
- fused_ops.cpp: RMSNorm with the residual add, rotary embedding, SiLU * up, one pass each
  instead of a handful of dispatches and memory passes.
`paged_attention_kernel()` and `cpu_fused_ops()` return None when their library is unavailable
(no compiler, a failed build, CONVEYOR_CPU_KERNELS=0); callers then use the torch reference
paths, which compute the same functions.
"""

from conveyor.gpu.cpu_kernels.fused_ops import CpuFusedOps, cpu_fused_ops
from conveyor.gpu.cpu_kernels.paged_attention import PagedAttentionKernel, paged_attention_kernel

__all__ = ["CpuFusedOps", "PagedAttentionKernel", "cpu_fused_ops", "paged_attention_kernel"]
