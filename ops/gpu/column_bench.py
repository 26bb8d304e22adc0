"""q/k/v and gate/up apart or stacked (issue 48): what gpu/backends/column_groups.py saves on a GPU.

`python3 ops/gpu/column_bench.py [--json]` times Llama-3-8B's two groups of sibling projections
(q, k, v: 4096, 1024, 1024 outputs; gate, up: 14336 each; 4096 inputs, one rank) through
`TritonOps.linears`, as the model calls it: apart (each layer its own product, as before the
stacks) and stacked (TritonOps.prepare's one weight per group, each layer's a view of its rows),
for bf16 (cuBLAS), W4A16 and W8A16 in groups of 128 (quant_linear.py) and FP8 W8A8 per channel
(fp8_linear.py, where the device has FP8 tensor cores), at M = 1, 16, 64 rows. Each time is the
device's: the group's call replayed from a CUDA graph, the median of 50 replays, the L2 cleared
before each (kernel_bench.py's `graph_us`); beside it the eager call's (`time_us`, launches
included). Both forms' outputs are checked against each other first. A decode step of all 32
layers saves 32 x (apart - stacked) per group. Without CUDA it runs the same code under Triton's
interpreter on shapes cut to 1/64, timed by the wall clock: those times mean nothing. Prints a
markdown table; --json adds the figures as one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout without `pip install -e .`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import graph_us, random_weight, time_us  # noqa: E402
from torch import nn  # noqa: E402

from conveyor.gpu.backends.triton.backend import TritonOps  # noqa: E402
from conveyor.gpu.backends.triton.fp8_linear import can_multiply_in_fp8  # noqa: E402
from conveyor.gpu.models.layers import Linear  # noqa: E402
from conveyor.gpu.quant.weight import quantize_groups  # noqa: E402
from conveyor.sim.gemm_roofline import ROWS  # noqa: E402

GROUPS = {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}  # Llama-3-8B's outputs, 4096 inputs
HIDDEN = 4096
PATHS = ("bf16", "W4A16 g128", "W8A16 g128", "FP8 W8A8")


class Siblings(nn.Module):
    """One group's layers, declared as a model's attention declares q/k/v (or not: apart)."""

    def __init__(self, layers: list[Linear], stacked: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.stacked = stacked
        self.config = types.SimpleNamespace(dtype="bfloat16")  # what TritonOps.prepare reads

    def sibling_projections(self) -> tuple[tuple[nn.Module, ...], ...]:
        return (tuple(self.layers),) if self.stacked else ()


def make_layers(path: str, sizes: tuple[int, ...], k: int, ops: TritonOps, device: str) -> list[Linear] | None:
    """One layer per output size in `path`'s form, random weights; None where the path cannot run here."""
    layers = []
    for n in sizes:
        with torch.device(device):
            layer = Linear(k, n, False, ops).to(torch.bfloat16).requires_grad_(False)
        if path != "bf16":
            layer.register_parameter("weight", None)  # as gpu/quant/load.py leaves a quantized layer
            if path == "FP8 W8A8":
                layer.quantized = quantize_groups(torch.randn(n, k, device=device) * 0.02, "e4m3", k)
                if not can_multiply_in_fp8(layer.quantized):
                    return None
            else:
                layer.quantized = random_weight("u4" if path.startswith("W4") else "u8", n, k, device)
        layers.append(layer)
    return layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ops/gpu/column_bench.py", description="q/k/v and gate/up apart or stacked (issue 48).")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device, cut = ("cuda", 1) if on_gpu else ("cpu", 64)
    name = torch.cuda.get_device_name() if on_gpu else "no CUDA device: interpreter, 1/64 of the shapes, times mean nothing"
    k = max(128, HIDDEN // cut // 128 * 128)
    figures: dict[str, str] = {"device": name}
    print(f"{name}\n")
    print("| group (outputs x K) | M | path | apart us | stacked us | apart / stacked | eager apart us | eager stacked us |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for group, full in GROUPS.items():
        sizes = tuple(n // cut for n in full)
        for path in PATHS:
            forms = {}
            for stacked in (False, True):
                ops = TritonOps()
                torch.manual_seed(0)  # both forms hold the same weights
                layers = make_layers(path, sizes, k, ops, device)
                if layers is None:
                    break
                ops.prepare(Siblings(layers, stacked))
                assert (ops.columns.get(tuple(layers)) is not None) == stacked
                forms[stacked] = lambda x, ops=ops, layers=tuple(layers): ops.linears(x, layers)
            if len(forms) < 2:
                print(f"{group} {path}: not on this device", file=sys.stderr)
                continue
            for m in ROWS:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                for apart, stacked_out in zip(forms[False](x), forms[True](x)):  # bf16 sums in another order: 1%
                    assert (apart - stacked_out).abs().max() <= 1e-2 * apart.abs().max(), (group, path, m)
                graph, eager = {}, {}
                for stacked, fn in forms.items():
                    eager[stacked] = time_us(fn, x)
                    graph[stacked] = graph_us(fn, x) if on_gpu else eager[stacked]
                ratio = graph[False] / graph[True]
                row = (
                    f"apart {graph[False]:.1f} us, stacked {graph[True]:.1f} us ({ratio:.2f}x); "
                    f"eager {eager[False]:.1f}, {eager[True]:.1f} us"
                )
                figures[f"{group} {sum(sizes)}x{k} M={m} {path}"] = row
                cells = (f"{graph[False]:.1f}", f"{graph[True]:.1f}", f"{ratio:.2f}x", f"{eager[False]:.1f}", f"{eager[True]:.1f}")
                print(f"| {group} ({sum(sizes)} x {k}) | {m} | {path} | " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
