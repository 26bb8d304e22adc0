"""What a row costs the CPU's int8 products: SmolLM2's packed weights of one layer (gate, down,
q: u4) and its LM head (u8) multiplied by M rows of x, for M from 1 to 8 and x in 1, 2 or 3
int8 planes (gpu/backends/cpu/kernels/quant_linear.py). A verifying pass of one sequence with d
drafts is M = 1 + d rows, so this is the price of a draft position in the products.

    python ops/bench/quant_rows.py [REPEATS]

Prints the median ms of the four products per (planes, rows), the configurations interleaved
REPEATS times (default 9) so the machine's drift falls on all alike.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from conveyor import LLM
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear

ROWS = (1, 2, 3, 4, 5, 6, 8)


def main(repeats: int) -> None:
    model = LLM(num_kv_blocks=64).runner.model
    layer = model.model.layers[0]
    layers = [layer.mlp.gate_proj, layer.mlp.down_proj, layer.self_attn.q_proj, model.lm_head]
    lib = load_library("quant_linear")
    kernels = {planes: CpuQuantLinear(lib, planes=planes) for planes in (1, 2, 3)}
    times: dict[tuple[int, int], list[float]] = {(p, m): [] for p in kernels for m in ROWS}
    for _ in range(repeats):
        for planes, rows in times:
            xs = [torch.randn(rows, w.in_features) for w in layers]
            start = time.perf_counter()
            for _ in range(10):
                for w, x in zip(layers, xs):
                    kernels[planes](x, w.quantized)
            times[(planes, rows)].append((time.perf_counter() - start) / 10 * 1000)
    print("shapes:", ", ".join(f"{w.quantized.kind} {tuple(w.quantized.shape)}" for w in layers))
    for planes in kernels:
        ms = {m: statistics.median(times[(planes, m)]) for m in ROWS}
        cells = [f"{m} rows {ms[m]:.2f} ms ({ms[m] / ms[1]:.2f}x)" for m in ROWS]
        print(f"{planes} plane(s): " + ", ".join(cells))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
