"""Sampling's cost before and after issue 48, one decode step's draws at logits [S, V]: the old path
(the head's logits copied to float32, a log_softmax over every row for the sampled logprob, the
filters by a sort of the whole row) against the new one (logits in their own dtype, the argmax for
greedy rows, logprobs only where asked, top_k by torch.topk and top_p by top_p.py's radix select).
Both draw with the same uniforms; the old path is rebuilt here from gpu/sampling/sorted_filters.py.

    python ops/bench/sampling_paths.py [--device cuda] [--rows 64,256] [--vocab 128256] [--dtypes bfloat16,float32]

Prints one markdown table of median ms per call (CUDA: synchronised around each call). On a CPU
this is a proxy only: the passes over [S, V] weigh differently there than in HBM.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from conveyor.gpu.sampling import sample
from conveyor.gpu.sampling.argmax import argmax_rows
from conveyor.gpu.sampling.sorted_filters import sorted_top_k_top_p
from conveyor.wire.messages import SamplingParams

CASES = {  # name -> the params of every row
    "greedy": SamplingParams(temperature=0.0),
    "top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k 50 + top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}


def old_path(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The draws as before: float32 copy, log_softmax of every row, sort-based filters."""
    x = logits.float()
    num_rows = x.shape[0]
    if params.greedy:
        ids = x.max(dim=-1).indices
    else:
        scaled = x / params.temperature
        k = torch.full((num_rows,), params.top_k, dtype=torch.int64, device=x.device)
        p = torch.full((num_rows,), params.top_p, device=x.device)
        if params.top_k or params.top_p < 1.0:
            scaled = sorted_top_k_top_p(scaled, k, p)
        cdf = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_().cumsum_(-1)
        u = torch.rand(num_rows, 1, device=x.device) * cdf[:, -1:]
        ids = torch.searchsorted(cdf, u, right=True).squeeze(1)
    logprobs = torch.log_softmax(x, dim=-1).gather(1, ids.clamp(max=x.shape[-1] - 1)[:, None])
    return ids + logprobs.isnan().squeeze(1)  # keep the logprob alive


def new_path(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.greedy:
        return argmax_rows(logits)[0]
    return sample(logits, [params] * logits.shape[0], [0] * logits.shape[0])[0]


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{name}, torch {torch.__version__}, V = {args.vocab}; median ms per step's draws")
    print("| rows | dtype | case | old | new | old / new |\n|---:|---|---|---:|---:|---:|")
    for num_rows in (int(r) for r in args.rows.split(",")):
        for dtype in args.dtypes.split(","):
            g = torch.Generator().manual_seed(0)
            logits = (torch.randn(num_rows, args.vocab, generator=g) * 3).to(device, getattr(torch, dtype))
            for case, params in CASES.items():
                old = median_ms(lambda: old_path(logits, params), device, args.repeats)  # noqa: B023 (called at once)
                new = median_ms(lambda: new_path(logits, params), device, args.repeats)  # noqa: B023
                print(f"| {num_rows} | {dtype} | {case} | {old:.2f} | {new:.2f} | {old / new:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
