"""oneDNN's packed weights at row counts that are not a multiple of 64: x padded with zero rows
(onednn_linear.packed_linear) against small_linear, which took those steps before.

1. SmolLM2's narrow products (q/k/v, o, gate/up: the layers small_linear takes), random weights,
   at 600, 1000 and 2000 rows: small_linear, packed with x padded, packed at the next multiple of
   64 (the padding's cost);
2. whole prefill steps of CHECKPOINT (a float model: a quantized one's layers take quant_linear)
   at 2000 rows (15 x 128 + 80), one 1000-token prompt and 2048 rows (16 x 128, a multiple of 64:
   the control), with `use_packed` switched between the old rule (multiples of 64 only) and the
   new one in one process, interleaved ROUNDS times.

    python ops/bench/packed_rows.py CHECKPOINT [ROUNDS]

Figures: docs/benchmarks/cpu-isa.md ("Prefill steps of any row count").
"""

from __future__ import annotations

import statistics
import sys

import torch
from prefill_roofline import timed  # the sibling script's (this folder is on sys.path when run)

from conveyor.bench.forward import StepDriver
from conveyor.gpu.backends.cpu.kernels import onednn_linear as onednn
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.small_linear import CpuSmallLinear
from conveyor.gpu.step.host_memory import keep_freed_memory

NARROW = [(960, 576), (576, 576), (3072, 576)]  # (N, K)
STEPS = {"2000 rows (15 x 128 + 80)": [128] * 15 + [80], "one 1000-token prompt": [1000], "2048 rows (16 x 128)": [128] * 16}


def products() -> None:
    small = CpuSmallLinear(load_library("small_linear"))
    for rows in (600, 1000, 2000):
        whole = -(-rows // onednn.PACKED_ROW_MULTIPLE) * onednn.PACKED_ROW_MULTIPLE
        ms = {"small_linear": 0.0, "packed, x padded": 0.0, f"packed at {whole} rows": 0.0}
        for n, k in NARROW:
            w = torch.randn(n, k)
            weight_t, packed = w.t().contiguous(), onednn.pack_linear_weight(w)
            x, x_whole = torch.randn(rows, k), torch.randn(whole, k)
            forms = (
                lambda x=x, weight_t=weight_t: small(x, weight_t),
                lambda x=x, packed=packed: onednn.packed_linear(x, packed, None),
                lambda x=x_whole, packed=packed: onednn.packed_linear(x, packed, None),
            )
            for label, fn in zip(ms, forms):
                ms[label] += timed(fn, reps=9) * 1e3
        print(f"{rows} rows, the narrow products, ms: " + "  ".join(f"{label} {v:.1f}" for label, v in ms.items()))


def steps(checkpoint: str, rounds: int) -> None:
    driver = StepDriver("cpu", num_blocks=600, model=checkpoint)
    rules = {"old": lambda rows: rows >= onednn.PACKED_MIN_ROWS and rows % 64 == 0, "new": onednn.use_packed}
    times: dict[tuple[str, str], list[float]] = {(s, r): [] for s in STEPS for r in rules}
    for r in range(rounds):
        for shape, lengths in STEPS.items():
            for rule in list(rules) if r % 2 == 0 else list(rules)[::-1]:
                onednn.use_packed = rules[rule]  # ops.py reads it per call
                times[(shape, rule)].append(driver.prompts_and_drop(lengths))
    onednn.use_packed = rules["new"]
    for shape in STEPS:
        old, new = (statistics.median(times[(shape, rule)]) for rule in rules)
        print(f"{shape:26s} old rule {old * 1e3:6.0f} ms  new {new * 1e3:6.0f} ms  new / old {new / old:.2f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    keep_freed_memory()  # as a worker runs
    products()
    steps(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
