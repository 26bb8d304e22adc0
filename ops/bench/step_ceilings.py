"""What bounds the one-row decode step of the default model on this machine: the step beside a
bare read of its bytes at the same moment, and the quantized linears' arithmetic with no memory
to wait on.

1. The step as served (Rig: the recorded kernel program and the argmax head) on fresh rows of 128
   tokens each round, each step followed by a two-thread read of as many bytes as the step moves
   (op_meter's count from one eager step) from an array of its own (torch's sum, which the
   roofline bench's `read` is). Each runs right after the other, so both see the same machine
   and the same caches (the read's array is as large as the step's bytes; an L3 holding both
   would serve both): their ratio holds still where each alone swings with the other tenants.
2. SmolLM2's 30 layers of u4 products (q/k/v, o, gate/up, down; random weights, their scales and
   mins float16 as the served Q4_1 model's: 2.2 MB a layer) at one row, recorded and replayed
   with no Python between the calls: "hot" the same layer 30 times (it stays in the two cores'
   L2), "cold" 30 layers of their own (66 MB, past the L2; an L3 may keep part). Hot is the
   kernel's arithmetic ceiling in GB/s of weights; cold adds the reads. "hot x1" is hot with x in
   one int8 plane instead of INT8_PLANES = 3 (llama.cpp's precision, which exactness refuses:
   quant_linear.py): what the planes' arithmetic costs.

    python ops/bench/step_ceilings.py [ROUNDS]

Figures: docs/benchmarks/cpu-isa.md, "The Intel guest a fourth time".
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from quant_paths import SHAPES  # the sibling script's SmolLM2 layer (this folder is on sys.path when run)

from conveyor.bench import op_meter
from conveyor.bench.roofline_round import Rig, Settings
from conveyor.gpu.backends.cpu.kernels import program
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear
from conveyor.gpu.quant.weight import quantize_groups

LAYERS = 30
STEPS, WARMUP = 40, 8  # per round


def step_bytes(rig: Rig, ids: list[int]) -> int:
    """The bytes one eager step moves, as op_meter counts them (the roofline bench's figure)."""
    with rig.eager():
        meter = op_meter.install(rig.runner)
        try:
            rig.decode(ids)
            meter.settle()
        finally:
            meter.remove()
    return sum(t.total for t in meter.traffic.values())


def step_against_read(rounds: int) -> None:
    rig = Rig(
        Settings(model=None, quantization=None, rows=1, context=128, steps=WARMUP + STEPS + 1, warmup=0, array_bytes=0, repeats=0)
    )
    nbytes, array = 0, torch.empty(0)
    for r in range(rounds):
        ids = rig.start_rows()  # fresh rows each round: every round decodes contexts 128 to 177
        if r == 0:
            nbytes = step_bytes(rig, ids)
            array = torch.ones(nbytes // 4)
            print(f"1. the one-row step as served against a bare read of its {nbytes / 1e6:.1f} MB, ms (medians of {STEPS})")
        for _ in range(WARMUP):
            rig.decode(ids)
        steps, reads = [], []
        for _ in range(STEPS):
            steps.append(rig.decode(ids))
            start = time.perf_counter()
            array.sum()
            reads.append(time.perf_counter() - start)
        rig.finish(ids)
        step, read = statistics.median(steps), statistics.median(reads)
        gbps = nbytes / read / 1e9
        print(f"   round {r}: step {step * 1e3:.2f}, read {read * 1e3:.2f} ({gbps:.1f} GB/s); step / read {step / read:.2f}")


def linears_hot_and_cold(rounds: int) -> None:
    lib = load_library("quant_linear")
    kernel, one_plane = CpuQuantLinear(lib), CpuQuantLinear(lib, planes=1)
    g = torch.Generator().manual_seed(0)

    def layer() -> list:
        weights = [quantize_groups(torch.randn(n, k, generator=g), "u4", 32) for n, k in SHAPES]
        for w in weights:  # scales and mins rounded to float16 first, so compact keeps them so, as a GGUF's
            w.scales, w.mins = w.scales.half().float(), w.mins.half().float()
            w.compact()
            w.prepared = kernel.prepare(w)
        return weights

    layers = [layer() for _ in range(LAYERS)]
    layer_bytes = sum(t.numel() * t.element_size() for w in layers[0] for t in (w.qweight, w.scales, w.mins))
    xs = [torch.randn(1, k) for _, k in SHAPES]
    arena = program.Arena()

    def record(weights: list[list], by: CpuQuantLinear) -> program.Program:
        with program.record(arena) as found:
            for products in weights:
                for w, x in zip(products, xs):
                    by(x, w)
        return found[0]

    programs = {
        "hot": record([layers[0]] * LAYERS, kernel),
        "cold": record(layers, kernel),
        "hot x1": record([layers[0]] * LAYERS, one_plane),
    }
    print(f"2. {LAYERS} layers x 4 u4 products at one row, replayed, ms (medians of 20)")
    for r in range(rounds):
        cells = []
        for name, replay in programs.items():
            replay.replay()
            times = []
            for _ in range(20):
                start = time.perf_counter()
                replay.replay()
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            cells.append(f"{name} {ms:.2f} ({LAYERS * layer_bytes / ms / 1e6:.1f} GB/s)")
        print(f"   round {r}: " + ", ".join(cells))


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    step_against_read(n)
    linears_hot_and_cold(n)
