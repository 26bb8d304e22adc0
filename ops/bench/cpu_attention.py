"""The CPU paged attention kernel alone (gpu/backends/cpu/kernels/paged_attention.cpp), one layer of
SmolLM2's heads (9 query heads on 3 kv heads, head_dim 64, blocks of 16), on random float32 KV:
decode steps (ROWS tokens of CONTEXT keys each) and prompt chunks (PROMPTS fresh prompts of LEN
tokens), at 1 and 2 threads. Prints the median ms a call of ROUNDS x 15 calls. Run it from two
trees (git archives) in turn to set a change against the one before.

    python ops/bench/cpu_attention.py [--decode 1x128,1x1024,16x256] [--prefill 16x128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.gpu.backends.cpu.kernels import paged_attention_kernel

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16


def case(rows: int, q_len: int, context: int) -> tuple:
    """rows sequences of `context` keys each, the last q_len of them this step's queries."""
    blocks = -(-context // BLOCK)
    cache = torch.randn(2, rows * blocks, KV_HEADS, BLOCK * HEAD_DIM)
    tables = torch.randperm(rows * blocks).to(torch.int32).view(rows, blocks)  # scattered, as served
    starts = torch.arange(0, rows * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((rows,), context, dtype=torch.int32)
    q = torch.randn(rows * q_len, KV_HEADS * GROUP, HEAD_DIM)
    return q, cache, tables, starts, lens


def main() -> None:
    parser = argparse.ArgumentParser(prog="python ops/bench/cpu_attention.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode", default="1x128,1x1024,16x256", help="ROWSxCONTEXT, comma-separated")
    parser.add_argument("--prefill", default="16x128", help="PROMPTSxLEN, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernel = paged_attention_kernel()
    if kernel is None:
        raise SystemExit("cpu_attention: the CPU kernel did not build here")
    cases = {}
    for spec in filter(None, args.decode.split(",")):
        rows, context = map(int, spec.split("x"))
        cases[f"decode {rows} rows x {context} keys"] = case(rows, 1, context)
    for spec in filter(None, args.prefill.split(",")):
        prompts, length = map(int, spec.split("x"))
        cases[f"prefill {prompts} prompts x {length} tokens"] = case(prompts, length, length)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for label, (q, cache, tables, starts, lens) in cases.items():
                kernel(q, cache, tables, starts, lens, None, HEAD_DIM**-0.5)  # warm
                for _ in range(15):
                    start = time.perf_counter()
                    kernel(q, cache, tables, starts, lens, None, HEAD_DIM**-0.5)
                    times.setdefault((label, threads), []).append(time.perf_counter() - start)
    print(f"one layer, {KV_HEADS * GROUP} query heads on {KV_HEADS} kv heads, head_dim {HEAD_DIM}; ms a call, medians")
    for label in cases:
        cells = "  ".join(f"{t} thread{'s' if t > 1 else ''} {statistics.median(times[(label, t)]) * 1e3:8.3f}" for t in (1, 2))
        print(f"{label:34s} {cells}")


if __name__ == "__main__":
    main()
