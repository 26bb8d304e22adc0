"""The decode step as served (the recorded kernel program, greedy) at each row count, in one
process: SmolLM2 Q4_1 (the default model) at a context of 128, the median of 30 steps after 8
untimed. A kernel change that cannot be switched inside a process (a recorded program fixes its
paths) is timed by running this from each tree, A B A B; CONVEYOR_CPU_ISA picks the build.

    CONVEYOR_CPU_ISA=x86-64-v3 python ops/bench/served_steps.py 2,3,4,5

Figures: docs/benchmarks/cpu-isa.md (the int8 path's row limit without VNNI).
"""

from __future__ import annotations

import statistics
import sys

from conveyor.bench.roofline_round import Rig, Settings

WARMUP, TIMED = 8, 30


def step_ms(rows: int) -> float:
    rig = Rig(
        Settings(model=None, quantization=None, rows=rows, context=128, steps=WARMUP + TIMED, warmup=0, array_bytes=0, repeats=0)
    )
    ids = rig.start_rows()
    for _ in range(WARMUP):
        rig.decode(ids)
    return statistics.median(rig.decode(ids) for _ in range(TIMED)) * 1e3


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("  ".join(f"{rows} rows {step_ms(rows):.2f} ms" for rows in (int(r) for r in sys.argv[1].split(","))))
