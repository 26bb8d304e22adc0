"""Where the quantized linears' dequantize path (W decoded into a float scratch, then oneDNN's
GEMM) pays in served decode steps: SmolLM2 Q4_1 decoding ROWS rows at a context of 128, in one
process, the threshold (quant_linear.py's DEQUANTIZE_MIN_ROWS, read per call) switched between
steps, interleaved ROUNDS times; a step past 32 rows is eager (no recorded program), so nothing
else changes between the settings. Prints the median step ms per setting.

    python ops/bench/dequantize_rows.py ROWS [THRESHOLDS] [ROUNDS] [FLOAT32_MATMUL_PRECISION]
    CONVEYOR_CPU_ISA=x86-64-v3 python ops/bench/dequantize_rows.py 48 33,1000 4   # dequantize / direct
    python ops/bench/dequantize_rows.py 48 48,1000 3 medium   # DEQUANTIZE_MIN_ROWS_BF16, on AMX
"""

from __future__ import annotations

import statistics
import sys

import torch

from conveyor.bench.roofline_round import Rig, Settings
from conveyor.gpu.backends.cpu.kernels import quant_linear as qlm

STEPS = 3  # timed steps a setting a round (their median), after one untimed


def main(rows: int, thresholds: list[int], rounds: int) -> None:
    if rows <= 32:
        raise SystemExit("steps of up to 32 rows replay recorded programs, whose paths are fixed: use more rows")
    decodes = 3 + rounds * len(thresholds) * (STEPS + 1)  # the warm-up's, then each setting's
    rig = Rig(
        Settings(
            model=None,
            quantization=None,
            rows=rows,
            context=128,
            steps=decodes // 3 + 1,  # a Rig holds tokens for 3 * steps decodes past the context
            warmup=0,
            array_bytes=0,
            repeats=0,
            threads=None,
        )
    )
    ids = rig.start_rows()
    for _ in range(3):
        rig.decode(ids)
    times: dict[int, list[float]] = {t: [] for t in thresholds}
    for r in range(rounds):
        for t in thresholds if r % 2 == 0 else thresholds[::-1]:
            qlm.DEQUANTIZE_MIN_ROWS = qlm.DEQUANTIZE_MIN_ROWS_BF16 = t  # the bfloat16 one too, at medium
            rig.decode(ids)
            times[t].append(statistics.median(rig.decode(ids) for _ in range(STEPS)) * 1e3)
    for t, ms in times.items():
        path = "dequantize" if rows >= t else "direct"
        print(f"{rows} rows, DEQUANTIZE_MIN_ROWS {t} ({path}): {statistics.median(ms):.1f} ms  {[round(m, 1) for m in ms]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    if len(args) > 3:
        torch.set_float32_matmul_precision(args[3])  # as --float32-matmul-precision sets it in a worker
    main(int(args[0]), [int(t) for t in (args[1] if len(args) > 1 else "33,1000").split(",")], int(args[2]) if len(args) > 2 else 4)
