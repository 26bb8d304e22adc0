"""Where the CPU's quantized-linear paths cross, per ISA build: a SmolLM2-shaped layer's four
products (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536; u4 in groups of 32
with mins, as Q4_1; random weights) through each of quant_linear.py's paths (int8x3, direct,
dequantize) at each row count, forced (`path=`), for every ISA variant named.

    python ops/bench/quant_paths.py [ISAS] [ROWS] [ROUNDS]
    python ops/bench/quant_paths.py native,x86-64-v3,x86-64-v3-vnni,x86-64-v4 1,2,16,32,40 5

Prints the median ms of the four products per (ISA, rows, path); the configurations are
interleaved ROUNDS times so that the machine's drift falls on all alike. The figures:
quant_linear.py's INT8_MAX_ROWS and DEQUANTIZE_MIN_ROWS, docs/benchmarks/cpu-isa.md.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear
from conveyor.gpu.quant.weight import quantize_groups

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one SmolLM2 layer, stacked as served
PATHS = ("int8x3", "direct", "dequantize")


def main(isas: list[str], rows_list: list[int], rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    weights = [quantize_groups(torch.randn(n, k, generator=g), "u4", 32) for n, k in SHAPES]
    for w in weights:
        w.compact()  # float16 scales where exact, as the cpu ops serve them
    kernels = {}
    for isa in isas:
        lib = load_library("quant_linear", isa)
        if lib is None:
            raise SystemExit(f"quant_linear.cpp did not build or run for {isa}")
        kernels[isa] = CpuQuantLinear(lib)
    times: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(rounds):
        for isa, kernel in kernels.items():
            for rows in rows_list:
                xs = [torch.randn(rows, w.shape[1]) for w in weights]
                for path in PATHS:
                    for w, x in zip(weights, xs):  # warm: caches, oneDNN's primitive for this shape
                        kernel(x, w, path=path)
                    start = time.perf_counter()
                    for _ in range(5):
                        for w, x in zip(weights, xs):
                            kernel(x, w, path=path)
                    times.setdefault((isa, rows, path), []).append((time.perf_counter() - start) / 5 * 1e3)
    print(f"ms per layer (4 products), medians of {rounds}; threads {torch.get_num_threads()}")
    for isa in isas:
        for rows in rows_list:
            cells = "  ".join(f"{path} {statistics.median(times[(isa, rows, path)]):.3f}" for path in PATHS)
            print(f"{isa:20s} {rows:4d} rows  {cells}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        (args[0] if args else "native").split(","),
        [int(r) for r in (args[1] if len(args) > 1 else "1,2,16,32,40").split(",")],
        int(args[2]) if len(args) > 2 else 5,
    )
