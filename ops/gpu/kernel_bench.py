"""The quantized GEMM tournament (issues 29 and 48): the runbook's `kernels` step.

`python3 ops/gpu/kernel_bench.py [--json]` times one product per (layer, M, kind) on Llama-3-8B's
layer shapes at M = 1, 16, 64, 256 (gemm_picks.py's ROW_BUCKETS): bf16 F.linear (cuBLAS); W4A16
in groups of 128 through each kernel gemm_picks.py can pick ("tiles", today's quant_linear.py;
"words", quant_linear_words.py; "tinygemm", torch's _weight_int4pack_mm) and gemlite where it
imports (not a pick: for comparison); W8A16 "tiles"; FP8 W8A8 through _scaled_mm with the
activations quantized by fp8_quant_rows.py's one launch ("scaled_mm") and, for comparison, by
torch's five ("torch-quant"), and FP8 weight-only ("FP8 W8A16 tiles", the FP8 table's other
pick), where the device has FP8 tensor cores. Each product is timed twice, the L2 cache cleared
before every run (a 4096 x 4096 W4 weight, 9 MB, would otherwise stay in the H100's 50 MB L2):
replayed from a CUDA graph (`graph_us`, the device's time, as a served decode step pays it) and
called from Python (`time_us`, do_bench's median, launches included), beside
gemm_roofline.py's ideal estimate and the bandwidth the graph time achieves over the estimate's
bytes. Weights are random codes with random scales and mins: speed does not depend on their
values. Without CUDA (the runbook's rehearsal) it runs the same code under Triton's interpreter
on a shape cut to 1/64, timed by the wall clock: those times mean nothing. Prints a markdown
table, then the PICKS table the graph times choose (paste it into gemm_picks.py); --json adds
one JSON line last: the device, `gemms` ([{"layer", "n", "k", "m", "kind", "us"}], graph times;
the run record's list) and `picks`. On an H100 it should take well under 2 minutes, most of it
compiling (an ESTIMATE; the second H200 run's 48 products took 16 s).
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

from conveyor.gpu.backends.triton.fp8_linear import can_multiply_in_fp8, fp8_linear, fp8_weight, quantize_per_token  # noqa: E402
from conveyor.gpu.backends.triton.gemm_picks import PICKS, ROW_BUCKETS, makers  # noqa: E402
from conveyor.gpu.backends.triton.int4pack import Int4PackWeight, int4pack_linear  # noqa: E402
from conveyor.gpu.backends.triton.quant_linear import KernelWeight, kernel_weight, quant_linear  # noqa: E402
from conveyor.gpu.backends.triton.quant_linear_words import WordWeight, words_linear  # noqa: E402
from conveyor.gpu.emulated.devices import DEVICES  # noqa: E402
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups  # noqa: E402
from conveyor.sim.gemm_roofline import FORMATS, MODELS, estimate  # noqa: E402

LAYERS = ("qkv", "o", "gate_up", "down")
Product = Callable[[torch.Tensor], torch.Tensor]


def random_weight(kind: str, n: int, k: int, device: str) -> QuantizedWeight:
    codes = torch.randint(0, 256, (n, k // 2 if kind == "u4" else k), dtype=torch.uint8, device=device)
    scales = torch.rand(n, k // 128, device=device) * 0.01 + 0.001
    return QuantizedWeight(kind, 128, codes, scales, -8 * scales)


def product(form: object) -> Product:
    """x -> x @ W^T through the kernel that reads `form`."""
    if isinstance(form, WordWeight):
        return lambda x: words_linear(x, form)
    if isinstance(form, Int4PackWeight):
        return lambda x: int4pack_linear(x, form)
    if isinstance(form, KernelWeight):
        return lambda x: quant_linear(x, form)
    return lambda x: fp8_linear(x, form)  # type: ignore[arg-type]


def gemlite_product(weight: QuantizedWeight) -> Product | None:
    """gemlite's W4A16 (bf16, fma mode: q * s - z * s, z = 8 here) where it imports: it needs CUDA
    at import, and the GPU image lacks it unless the pack carries its wheel (ops/gpu/README.md)."""
    try:
        from gemlite import DType, GemLiteLinearTriton
    except Exception:
        return None
    n, k = weight.shape
    try:
        layer = GemLiteLinearTriton(4, 128, k, n, input_dtype=DType.BF16, output_dtype=DType.BF16)
        zeros = torch.full_like(weight.scales, 8.0)
        layer.pack(weight.codes().to(torch.uint8), weight.scales.to(torch.bfloat16), zeros.to(torch.bfloat16), None)
    except Exception as e:  # not ours: said, and the tournament goes on without it
        print(f"gemlite {n}x{k}: not packed ({str(e)[:300]})", file=sys.stderr)
        return None
    return lambda x: layer(x)


def paths(n: int, k: int, device: str) -> dict[str, Product]:
    """Kind -> fn(x) for one (N, K), its weights made and converted once. A W4A16 or FP8 kind is
    "FORMAT KERNEL", KERNEL one of gemm_picks.py's names (gemlite excepted)."""
    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    w4, w8 = (random_weight(kind, n, k, device) for kind in ("u4", "u8"))
    found: dict[str, Product] = {"bf16": lambda x: F.linear(x, dense)}
    for name, make in makers(w4, torch.bfloat16).items():
        found[f"W4A16 {name}"] = product(make())  # a conversion that fails stops the run: a bug to see
    gemlite = gemlite_product(w4) if device == "cuda" else None
    if gemlite is not None:
        found["W4A16 gemlite"] = gemlite
    found["W8A16 tiles"] = product(kernel_weight(w8, torch.bfloat16))
    fp8 = quantize_groups(dense, "e4m3", k)
    if can_multiply_in_fp8(fp8):
        for name, make in makers(fp8, torch.bfloat16).items():
            found[f"FP8 {'W8A8' if name == 'scaled_mm' else 'W8A16'} {name}"] = product(make())
        old = fp8_weight(fp8)

        def torch_quant(x: torch.Tensor) -> torch.Tensor:  # before issue 48: five launches to quantize x
            xq, scale = quantize_per_token(x)
            return torch._scaled_mm(xq, old.codes_t, scale_a=scale, scale_b=old.scale, out_dtype=x.dtype)

        found["FP8 W8A8 torch-quant"] = torch_quant
    return found


def roofline_format(kind: str) -> str:
    if kind.startswith("FP8 W8A8"):
        return "FP8 W8A8"
    return {"W4A16": "W4A16 g128", "W8A16": "W8A16 g128", "FP8": "W8A16 g128"}.get(kind.split()[0], "bf16")


PICKABLE = {"W4A16": ("tiles", "words", "tinygemm"), "FP8": ("scaled_mm", "tiles")}


def pick_of(kind: str) -> tuple[str, str] | None:
    """A kind's (format, kernel) in gemm_picks.py's terms; None: not a pick (bf16, W8A16, gemlite, torch-quant)."""
    fmt, name = kind.split()[0], kind.split()[-1]
    return (fmt, name) if name in PICKABLE.get(fmt, ()) else None


def proposed_picks(gemms: list[dict]) -> dict[str, tuple[str, ...]]:
    """For each format and row bucket, the kernel with the least graph time summed over the four
    layers; a kernel without a time at every layer is not proposed (then the table's own)."""
    picks = {}
    for fmt in PICKABLE:
        row = []
        for m in ROW_BUCKETS:
            times: dict[str, list[float]] = {}
            for g in gemms:
                if g["m"] == m and (found := pick_of(g["kind"])) and found[0] == fmt and g["us"] == g["us"]:  # not NaN
                    times.setdefault(found[1], []).append(g["us"])
            whole = {name: sum(us) for name, us in times.items() if len(us) == len(LAYERS)}
            row.append(min(whole, key=whole.__getitem__) if whole else PICKS[fmt][len(row)])
        picks[fmt] = tuple(row)
    return picks


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
    p = argparse.ArgumentParser(prog="ops/gpu/kernel_bench.py", description="Quantized GEMM tournament (issues 29 and 48).")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device, cut = ("cuda", 1) if on_gpu else ("cpu", 64)
    name = torch.cuda.get_device_name() if on_gpu else "no CUDA device: interpreter, 1/64 of the shapes, times mean nothing"
    spec = DEVICES["h200" if "H200" in name else "h100"]  # the roofline of the card it runs on
    shapes, _, _ = MODELS["Llama-3-8B"]
    gemms: list[dict] = []
    started = time.monotonic()
    print(f"{name}; estimates: {spec.name} roofline (conveyor/sim/gemm_roofline.py)\n")
    print("| layer (N x K) | M | kind | graph us | eager us | estimate us | GB/s (graph) over the estimate's bytes | / bf16 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for layer, (n, k) in zip(LAYERS, shapes):
        n, k = n // cut, max(128, k // cut // 128 * 128)
        for kind, fn in paths(n, k, device).items():
            for m in ROW_BUCKETS:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                try:
                    eager = time_us(fn, x)
                    us = graph_us(fn, x) if on_gpu else eager
                except Exception as e:  # a compile error or a bad shape: said, and the rest still timed
                    print(f"{layer} M={m} {kind}: failed ({str(e)[:300]})", file=sys.stderr)
                    eager = us = float("nan")
                gemms.append({"layer": layer, "n": n, "k": k, "m": m, "kind": kind, "us": round(us, 2)})
                base = next(g["us"] for g in gemms if g["layer"] == layer and g["m"] == m and g["kind"] == "bf16")
                est = estimate(spec, FORMATS[roofline_format(kind)], m, n, k)
                cells = (
                    f"{us:.1f}",
                    f"{eager:.1f}",
                    f"{est.seconds * 1e6:.1f}",
                    f"{est.num_bytes / us / 1e3:.0f}",
                    f"{us / base:.2f}",
                )
                print(f"| {layer} ({n} x {k}) | {m} | {kind} | " + " | ".join(cells) + " |")
    picks = proposed_picks(gemms)
    print(f"\n{time.monotonic() - started:.0f} s. The table these graph times choose (gpu/backends/triton/gemm_picks.py):")
    print("PICKS = {" + ", ".join(f"{fmt!r}: {row!r}" for fmt, row in picks.items()) + "}")
    if args.json:
        print(json.dumps({"device": name, "gemms": gemms, "picks": picks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
