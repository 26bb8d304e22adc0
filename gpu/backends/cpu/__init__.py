"""The cpu backend: the C++ kernels of gpu/backends/cpu/kernels and oneDNN, for float32 models on a CPU.

`cpu_backend(model, device)` puts together what this machine can run: the paged attention
kernel (cpu/attention.py), the fused elementwise ops and, where it pays on this CPU
(`pays_on_this_cpu`: AVX-512, or AVX2 for steps of up to 128 rows), the narrow-linear kernel with
oneDNN's packed weights where they pay (AVX-512), and the quantized-linear kernel
(cpu/ops.py). A piece whose library cannot be built is replaced by torch's; with none of them,
or on another device or dtype, it raises BackendUnavailable with the reason, and `select` falls
back to the torch backend with a warning. Once built, it logs the CPU's model and the kernels'
ISA variant (CONVEYOR_CPU_ISA) with the paths that variant runs, and warns where OpenMP threads
are bound (they would share one core).
"""

from __future__ import annotations

import logging
import os

import torch

from conveyor.config.model import ModelConfig
from conveyor.gpu.backends.base import AttentionBackend, Backend, BackendUnavailable
from conveyor.gpu.backends.cpu.attention import CpuAttention
from conveyor.gpu.backends.cpu.kernels import (
    cpu_fused_ops,
    cpu_lora,
    cpu_quant_argmax,
    cpu_quant_linear,
    cpu_small_linear,
    isa,
    paged_attention_kernel,
)
from conveyor.gpu.backends.cpu.kernels.small_linear import CpuSmallLinear, pays_on_this_cpu
from conveyor.gpu.backends.cpu.ops import CpuOps
from conveyor.gpu.backends.torch import TorchAttention

log = logging.getLogger(__name__)


def cpu_backend(model: ModelConfig, device: torch.device, kv_dtype: str | None = None) -> Backend:
    """The cpu Backend for `model` on `device`, its KV cache in `kv_dtype` (None: float32, the
    model's; or float8_e4m3fn); BackendUnavailable where it cannot run."""
    if device.type != "cpu":
        raise BackendUnavailable(f"the C++ kernels run on the CPU, not {device.type}")
    if model.dtype != "float32":
        raise BackendUnavailable(f"the C++ kernels take float32, the model is {model.dtype}")
    kernel, fused = paged_attention_kernel(), cpu_fused_ops()
    small_linear = cpu_small_linear() if pays_on_this_cpu() else None
    if kernel is None and fused is None and small_linear is None:
        reasons = "no compiler, a failed build, a CONVEYOR_CPU_ISA this CPU cannot run, or CONVEYOR_CPU_KERNELS=0"
        raise BackendUnavailable(f"no C++ kernel could be built ({reasons})")
    log.info("CPU %s", isa.describe_in_use())
    _warn_if_threads_bound()
    attn: AttentionBackend = (
        CpuAttention(model, device, kernel, kv_dtype) if kernel is not None else TorchAttention(model, device, kv_dtype)
    )
    parts = [
        "C++ paged attention" if kernel is not None else "torch attention",
        "fused ops" if fused is not None else "torch elementwise ops",
        _linears(small_linear),
    ]
    quant = cpu_quant_linear()
    parts.append("C++ quantized linears" if quant is not None else "reference quantized linears")
    lora = cpu_lora()
    parts.append("C++ LoRA" if lora is not None else "torch LoRA")
    argmax = cpu_quant_argmax() if quant is not None else None
    if argmax is not None:
        parts.append("the head's argmax from one plane")
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":  # --float32-matmul-precision: bfloat16 inputs on AMX at medium
        parts.append(f"GEMMs at float32 matmul precision {precision}")
    ops = CpuOps(fused, small_linear, quant, lora, argmax)
    return Backend(name="cpu", attn=attn, ops=ops, description=f"cpu ({', '.join(parts)})")


def _warn_if_threads_bound() -> None:
    """Binding OpenMP threads (OMP_PROC_BIND, OMP_PLACES) made the worker slower on the machine
    measured: the process starts bound to the first place (its affinity one CPU), two threads then
    streamed one core's bandwidth, and a one-row decode step took 1.9x as long, with the places as
    cores or as explicit CPUs (docs/benchmarks/cpu-isa.md). The worker does not pin; a user who set
    these hears why not."""
    bound = {k: v for k in ("OMP_PROC_BIND", "OMP_PLACES") if (v := os.environ.get(k)) and v.lower() != "false"}
    if bound:
        settings = ", ".join(f"{k}={v}" for k, v in bound.items())
        log.warning("%s binds OpenMP threads: measured 1.9x slower decode steps (docs/benchmarks/cpu-isa.md); unset it", settings)


def _linears(small: CpuSmallLinear | None) -> str:
    if small is None:
        return "torch linears (small_linear does not pay here)"
    return f"small_linear up to {small.max_rows} rows" + (" + oneDNN packed linears" if small.packs else ", sgemm beyond")


__all__ = ["CpuAttention", "CpuOps", "cpu_backend"]
