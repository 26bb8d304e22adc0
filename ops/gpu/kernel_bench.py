"""The quantized GEMM microbenchmark (issue 29): the runbook's `kernels` step.

`python3 ops/gpu/kernel_bench.py [--json]` times one product per (layer, M, path) on Llama-3-8B's
layer shapes at M = 1, 16, 64 (conveyor/sim/gemm_roofline.py's MODELS and ROWS): bf16 F.linear
(cuBLAS), W4A16 and W8A16 in groups of 128 through gpu/backends/triton/quant_linear.py, and FP8
W8A8 through fp8_linear.py where the device has FP8 tensor cores. Each product is timed twice,
the L2 cache cleared before every run (a 4096 x 4096 W4 weight, 9 MB, would otherwise stay in
the H100's 50 MB L2): replayed from a CUDA graph (`graph_us`, the device's time, as a served
decode step pays it) and called from Python (`time_us`, do_bench's median, launches included),
beside gemm_roofline.py's ideal estimate and the bandwidth the graph time achieves over the
estimate's bytes. Weights are random codes
with random scales and mins: speed does not depend on their values. Without CUDA (the runbook's
rehearsal) it runs the same code under Triton's interpreter on a shape cut to 1/64, timed by the
wall clock: those times mean nothing. Prints a markdown table; --json adds the figures as one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout without `pip install -e .`

import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

from conveyor.gpu.backends.triton.fp8_linear import can_multiply_in_fp8, fp8_linear, fp8_weight  # noqa: E402
from conveyor.gpu.backends.triton.quant_linear import kernel_weight, quant_linear  # noqa: E402
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups  # noqa: E402
from conveyor.sim.devices import DEVICES  # noqa: E402
from conveyor.sim.gemm_roofline import FORMATS, MODELS, ROWS, estimate  # noqa: E402

LAYERS = ("qkv", "o", "gate_up", "down")


def random_weight(kind: str, n: int, k: int, device: str) -> QuantizedWeight:
    codes = torch.randint(0, 256, (n, k // 2 if kind == "u4" else k), dtype=torch.uint8, device=device)
    scales = torch.rand(n, k // 128, device=device) * 0.01 + 0.001
    return QuantizedWeight(kind, 128, codes, scales, -8 * scales)


def paths(n: int, k: int, device: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Format name -> fn(x) for one (N, K), its weight made once."""
    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    w4, w8 = (kernel_weight(random_weight(kind, n, k, device), torch.bfloat16) for kind in ("u4", "u8"))
    found: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "bf16": lambda x: F.linear(x, dense),
        "W4A16 g128": lambda x: quant_linear(x, w4),
        "W8A16 g128": lambda x: quant_linear(x, w8),
    }
    fp8 = quantize_groups(dense, "e4m3", k)
    if can_multiply_in_fp8(fp8):
        prepared = fp8_weight(fp8)
        found["FP8 W8A8"] = lambda x: fp8_linear(x, prepared)
    return found


def time_us(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """Eager: the median of do_bench, the call as Python makes it. On the H200 these were 2-4x the
    device's time for the Triton paths: the GPU waited for the host's launches (the wrapper's
    checks, one or two Triton launches), which a served decode step, replayed from a CUDA graph,
    does not pay."""
    if x.is_cuda:
        return triton.testing.do_bench(lambda: fn(x), warmup=10, rep=40, return_mode="median") * 1e3
    start = time.perf_counter()
    fn(x)
    return (time.perf_counter() - start) * 1e6


def graph_us(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int = 50) -> float:
    """The device's time: fn captured in a CUDA graph, the median of `reps` replays, each timed by
    CUDA events after clearing the L2 (the host enqueues the next replay while the 256 MB clear
    runs, so no launch shows in the time)."""
    fn(x)  # compile and autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=x.device)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ops/gpu/kernel_bench.py", description="Quantized GEMM microbenchmark (issue 29).")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device, cut = ("cuda", 1) if on_gpu else ("cpu", 64)
    name = torch.cuda.get_device_name() if on_gpu else "no CUDA device: interpreter, 1/64 of the shapes, times mean nothing"
    spec = DEVICES["h200" if "H200" in name else "h100"]  # the roofline of the card it runs on
    shapes, _, _ = MODELS["Llama-3-8B"]
    figures: dict[str, str] = {"device": name}
    print(f"{name}; estimates: {spec.name} roofline (conveyor/sim/gemm_roofline.py)\n")
    print("| layer (N x K) | M | path | graph us | eager us | estimate us | GB/s (graph) over the estimate's bytes |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for layer, (n, k) in zip(LAYERS, shapes):
        n, k = n // cut, max(128, k // cut // 128 * 128)
        for path, fn in paths(n, k, device).items():
            for m in ROWS:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                eager = time_us(fn, x)
                try:
                    us = graph_us(fn, x) if on_gpu else eager
                except RuntimeError as e:  # a path that cannot be captured: said, and the rest still timed
                    print(f"{layer} M={m} {path}: no CUDA graph ({e})", file=sys.stderr)
                    us = float("nan")
                est = estimate(spec, FORMATS[path], m, n, k)
                row = f"{us:.1f} us ({est.num_bytes / us / 1e3:.0f} GB/s; eager {eager:.1f} us; estimate {est.seconds * 1e6:.1f} us)"
                figures[f"{layer} {n}x{k} M={m} {path}"] = row
                cells = (f"{us:.1f}", f"{eager:.1f}", f"{est.seconds * 1e6:.1f}", f"{est.num_bytes / us / 1e3:.0f}")
                print(f"| {layer} ({n} x {k}) | {m} | {path} | " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
