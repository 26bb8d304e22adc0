"""One decode-shaped quantized linear in each ISA variant of the C++ CPU kernels that this CPU runs
(gpu/backends/cpu/kernels/isa.py): what the same machine gives an older or another vendor's CPU's
code path, so that each ISA's speed is measured side by side on one machine (issue 52).

    python ops/bench/isa_variants.py [--rows 1] [--out 1536] [--in 576] [--kind u4] [--group 32]
                                     [--scales float16] [--rounds 7] [--calls 200] [--threads N]

The default shape is SmolLM2-135M's gate projection at one decode row, Q4_1-like (u4, groups of 32,
with mins, float16 scales as GGUF's; --scales float32 keeps them float32, the kernels' other form).
Prints per variant the median ms per call over `rounds` rounds of `calls` calls, the variants
interleaved in every round so the machine's drift falls on all alike; the weight bytes read per ms
as GB/s (a decode row reads every weight once); the largest difference from native's output,
relative to its largest output (the int8 paths' sums are exact integers, so the variants differ
only in float rounding); and the paths each runs.
Run it on a quiet machine: a shared one's neighbours move the figures more than an ISA does.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from conveyor.gpu.backends.cpu.kernels import isa
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups


def weight_bytes(w: QuantizedWeight) -> int:
    parts = [w.qweight, w.scales] + ([] if w.mins is None else [w.mins])
    return sum(t.numel() * t.element_size() for t in parts)


def main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels share torch's libgomp, so its pool too
    g = torch.Generator().manual_seed(0)
    w = quantize_groups(torch.randn(args.out, args.in_features, generator=g), args.kind, args.group)
    if args.scales == "float16":
        w.scales, w.mins = w.scales.half().float(), None if w.mins is None else w.mins.half().float()
        w.compact()  # float16 scales and mins, as a GGUF's
    x = torch.randn(args.rows, args.in_features, generator=g)
    kernels: dict[str, tuple[CpuQuantLinear, QuantizedWeight]] = {}
    for name in isa.runnable():
        lib = load_library("quant_linear", name)
        if lib is None:
            print(f"{name}: did not build (see the warning above)")
            continue
        kernel = CpuQuantLinear(lib)
        kernels[name] = (kernel, dataclasses.replace(w, prepared=kernel.prepare(w)))
    if not kernels:
        raise SystemExit("no variant of quant_linear built here")
    outputs = {name: kernel(x, prepared) for name, (kernel, prepared) in kernels.items()}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.rounds):
        for name, (kernel, prepared) in kernels.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                kernel(x, prepared)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    nbytes = weight_bytes(w)
    shape = f"x [{args.rows}, {args.in_features}] times {args.kind} W [{args.out}, {args.in_features}] G={args.group}"
    shape += f", {args.scales} scales"
    print(f"{isa.cpu_model()}, {torch.get_num_threads()} OpenMP threads; {shape} ({nbytes / 1e6:.2f} MB)")
    print(f"median of {args.rounds} rounds of {args.calls} calls")
    print("| variant | ms per call | GB/s | vs native | paths |\n|---|---:|---:|---:|---|")
    reference = outputs.get("native", next(iter(outputs.values())))
    for name in kernels:
        ms = statistics.median(times[name])
        diff = float((outputs[name] - reference).abs().max() / reference.abs().max())
        paths = isa.kernel_paths(isa.build_features(isa.VARIANTS[name]))
        print(f"| {name} | {ms:.4f} | {nbytes / ms / 1e6:.1f} | {diff:.1e} | {paths} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1, help="rows of x: 1 is one decode stream")
    p.add_argument("--out", type=int, default=1536, help="output features N")
    p.add_argument("--in", dest="in_features", type=int, default=576, help="input features K")
    p.add_argument("--kind", choices=("u4", "u8"), default="u4")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--scales", choices=("float16", "float32"), default="float16", help="how scales and mins are stored")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, help="OpenMP threads, torch's and the kernels' (one pool; default: torch's)")
    return p.parse_args()


if __name__ == "__main__":
    main(parse_args())
