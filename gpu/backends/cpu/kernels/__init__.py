"""CPU kernels in C++, compiled on first use with the machine's compiler and called via ctypes.

Only what torch does badly on a CPU lives here, float32 only:
- paged_attention.cpp: attention reading the KV cache in place through the block tables (the
  torch path gathers every context into a padded copy, each layer, each step);
- fused_ops.cpp: RMSNorm with the residual add, rotary embedding, SiLU * up, one pass each
  instead of a handful of dispatches and memory passes;
- small_linear.cpp: narrow linear layers, which stream their transposed weights once where
  torch's sgemm repacks them on every call (decode steps above all);
- quant_linear.cpp: linear layers of quantized weights (QuantizedWeight), read packed: int8
  activations against the codes for a few rows, float tiles decoded once per chunk of many;
- quant_argmax.cpp: the host loops of a quantized LM head's argmax from one plane of x
  (quant_argmax.py): each row's candidates, and its pick among them in three planes;
- lora.cpp: a projection's batched LoRA update, a token reading only its own adapter slot, one
  call a projection instead of torch's thirty-odd small ops.
onednn_linear.py is not C++: oneDNN's float32 products, through ops torch already ships, for
steps of many rows (prefill): on the weights as stored, and on the narrow layers' weights in
oneDNN's blocked layout.
`paged_attention_kernel()`, `cpu_fused_ops()`, `cpu_small_linear()`, `cpu_quant_linear()`, `cpu_quant_argmax()` and `cpu_lora()` return
None when their library is unavailable (no compiler, a failed build, CONVEYOR_CPU_KERNELS=0); the
cpu backend (gpu/backends/cpu), their only caller, then uses the torch backend's paths, which
compute the same functions.
"""

from conveyor.gpu.backends.cpu.kernels.fused_ops import CpuFusedOps, cpu_fused_ops
from conveyor.gpu.backends.cpu.kernels.lora import CpuLora, cpu_lora
from conveyor.gpu.backends.cpu.kernels.paged_attention import PagedAttentionKernel, paged_attention_kernel
from conveyor.gpu.backends.cpu.kernels.quant_argmax import QuantArgmax, cpu_quant_argmax
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear, cpu_quant_linear
from conveyor.gpu.backends.cpu.kernels.small_linear import CpuSmallLinear, cpu_small_linear

__all__ = [
    "CpuFusedOps",
    "CpuLora",
    "CpuQuantLinear",
    "QuantArgmax",
    "CpuSmallLinear",
    "PagedAttentionKernel",
    "cpu_fused_ops",
    "cpu_lora",
    "cpu_quant_argmax",
    "cpu_quant_linear",
    "cpu_small_linear",
    "paged_attention_kernel",
]
