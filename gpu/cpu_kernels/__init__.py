"""CPU kernels in C++, compiled on first use with the machine's compiler and called via ctypes.

Only what torch cannot do well on a CPU lives here: paged attention that reads the KV cache in
place (see paged_attention.cpp for why). `paged_attention_kernel()` returns None when the kernel
is unavailable (no compiler, a failed build, CONVEYOR_CPU_KERNELS=0), and callers then use the
torch reference path, which computes the same function.
"""

from conveyor.gpu.cpu_kernels.build import PagedAttentionKernel, paged_attention_kernel

__all__ = ["PagedAttentionKernel", "paged_attention_kernel"]
