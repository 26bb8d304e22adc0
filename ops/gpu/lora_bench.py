"""The batched LoRA microbenchmark (issue 32): what adapters add to a projection on a GPU.

`python3 ops/gpu/lora_bench.py [--json]` times, on Llama-3-8B's seven projections (q, k, v, o,
gate, up, down; one rank, bf16), the base product (F.linear, cuBLAS) alone and with the LoRA
update of `--max-loras 4` rank-16 slots added, through each backend's `lora_add`: the Triton
kernels (gpu/backends/triton/lora.py: one program per token, BGMV), the Triton SGMV kernels
(lora_sgmv_shrink.py, lora_sgmv_expand.py: tiles of one slot's tokens on the tensor cores, over
the tokens grouped once a pass by lora_groups.py, which is timed alone: its cost is shared by every
layer's projections) and the torch default (gpu/backends/ops.py: one [T, S R] product over every
slot, then each token's own), each with B stored as its backend's `lora_b` stores it, and SGMV
again with B stored as the default does ([S, R, out], outputs innermost). Rows:
- decode steps of M = 1, 16, 64, 256 rows spread over the 4 adapters (row t: slot t mod 4), and 64
  rows of which half are base rows (slot -1), as a mixed graph-replayed step has them;
- a 512-token prompt chunk of one adapter.
Each time is the device's: the call replayed from a CUDA graph, the median of 50 replays, the L2
cleared before each (kernel_bench.py's `graph_us`). The sum over the seven projections is one
layer's; its ratio to the base is what a step's linears pay for the adapters. Without CUDA it runs
under Triton's interpreter on shapes cut to 1/64, timed by the wall clock: those times mean nothing.
Prints a markdown table, then the `KERNEL_BY_ROWS` table (gpu/backends/triton/lora_groups.py) the
figures choose: per case, the faster Triton path over the layer; --json adds the figures as one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout without `pip install -e .`
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.nn.functional as F  # noqa: E402
from kernel_bench import graph_us  # noqa: E402

from conveyor.gpu.backends.torch import TorchOps  # noqa: E402
from conveyor.gpu.backends.triton.backend import TritonOps  # noqa: E402
from conveyor.gpu.backends.triton.lora_groups import lora_groups  # noqa: E402

PROJECTIONS = {  # name -> (out, in)
    **{"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096)},
    **{"gate": (14336, 4096), "up": (14336, 4096), "down": (4096, 14336)},
}
SLOTS, RANK = 4, 16
CASES = {  # name -> (rows, each row's slot)
    "decode M=1": (1, lambda m: torch.arange(m) % SLOTS),
    "decode M=16": (16, lambda m: torch.arange(m) % SLOTS),
    "decode M=64": (64, lambda m: torch.arange(m) % SLOTS),
    "decode M=64, half base": (64, lambda m: torch.where(torch.arange(m) % 2 == 0, torch.arange(m) // 2 % SLOTS, -1)),
    "decode M=256": (256, lambda m: torch.arange(m) % SLOTS),
    "prompt chunk 512, one adapter": (512, lambda m: torch.zeros(m, dtype=torch.long)),
}
SGMV = TritonOps(lora_kernels=((1, "sgmv"),))
# name -> (ops, the B storage of which ops): Ops.lora_b of the second, filled with random values.
VARIANTS = {
    **{"triton": (TritonOps(lora_kernels=((1, "bgmv"),)), TritonOps()), "sgmv": (SGMV, TritonOps())},
    **{"sgmv_b_sro": (SGMV, TorchOps()), "torch": (TorchOps(), TorchOps())},
}
HEADS = {"triton": "triton BGMV", "sgmv": "triton SGMV", "sgmv_b_sro": "SGMV, B [S, R, out]", "torch": "torch"}


def wall_us(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return (time.perf_counter() - start) * 1e6


def choose(figures: list[dict]) -> tuple[tuple[int, str], ...]:
    """lora_groups.py's table from the layer rows: at each case's row count (the all-adapter cases),
    the faster of BGMV and SGMV (with its grouping, once a pass, left out), runs of one merged."""
    wins = []
    for case, (rows, _) in CASES.items():
        layer = next(r for r in figures if r["case"] == case and r["projection"] == "layer (7)")
        if "half base" not in case:
            wins.append((rows, "sgmv" if layer["sgmv_us"] < layer["triton_us"] else "bgmv"))
    table: list[tuple[int, str]] = []
    for rows, kernel in sorted(wins):
        if not table or table[-1][1] != kernel:
            table.append((1 if not table else rows, kernel))
    return tuple(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="the figures as one JSON line last")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device, cut, timer = ("cuda", 1, graph_us) if on_gpu else ("cpu", 64, wall_us)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    name = torch.cuda.get_device_name() if on_gpu else "no CUDA device: interpreter, 1/64 of the shapes, times mean nothing"
    torch.manual_seed(0)
    scales = torch.full((SLOTS,), 2.0, device=device)
    figures, grouping = [], {}
    for case, (rows, slot_of) in CASES.items():
        slots = slot_of(rows).to(device)
        grouping[case] = timer(lambda s: lora_groups(s, SLOTS), slots)  # once a pass, for every layer
        totals = {"base": 0.0, **{v: 0.0 for v in VARIANTS}}
        for proj, (out, fan_in) in PROJECTIONS.items():
            out, fan_in = max(out // cut, 16), max(fan_in // cut, 16)
            w = torch.randn(out, fan_in, device=device, dtype=dtype) / fan_in**0.5
            a = torch.randn(SLOTS, RANK, fan_in, device=device, dtype=dtype) / fan_in**0.5
            x = torch.randn(rows, fan_in, device=device, dtype=dtype)
            row = {"case": case, "projection": proj, "base_us": timer(lambda x, w=w: F.linear(x, w), x)}
            for variant, (ops, storage) in VARIANTS.items():
                b = storage.lora_b(SLOTS, out, RANK, dtype, torch.device(device))  # [S, out, R]
                b.copy_(torch.randn(b.shape, device=device, dtype=dtype))

                groups = ops.lora_groups(slots, SLOTS)  # the pass's, made before the layers

                def with_lora(x, ops=ops, w=w, a=a, b=b, slots=slots, groups=groups):
                    return ops.lora_add(x, F.linear(x, w), a, b, scales, slots, groups)

                row[f"{variant}_us"] = timer(with_lora, x)
            figures.append(row)
            for name in totals:
                totals[name] += row[f"{name}_us"]
        layer = {f"{v}_us": totals[v] for v in VARIANTS}
        figures.append({"case": case, "projection": "layer (7)", "base_us": totals["base"], **layer})
    print(f"device: {name}; {SLOTS} slots of rank {RANK}, {dtype}; times in us ({'CUDA graph replay' if on_gpu else 'wall clock'})\n")
    print("| case | projection | base us | " + " | ".join(f"+ LoRA, {HEADS[v]} us (/ base)" for v in VARIANTS) + " |")
    print("|---|---|---:|" + "---:|" * len(VARIANTS))
    for r in figures:
        times = " | ".join(f"{r[f'{v}_us']:.1f} ({r[f'{v}_us'] / r['base_us']:.2f}x)" for v in VARIANTS)
        print(f"| {r['case']} | {r['projection']} | {r['base_us']:.1f} | {times} |")
    print("\n| case | grouping the tokens by slot, once a pass, us |\n|---|---:|")
    for case, us in grouping.items():
        print(f"| {case} | {us:.1f} |")
    print(f"\nchoose: KERNEL_BY_ROWS = {choose(figures)!r}")
    if args.json:
        print(json.dumps({"device": name, "rows": figures, "grouping_us": grouping, "choose": choose(figures)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
