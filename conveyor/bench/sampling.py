"""`conveyor bench sampling`: the sampler's draw (inverting the CDF, one uniform per draw) against
the draws that materialise a noise tensor over the whole vocabulary for every row.

Each variant takes logits [S, V] float32 at temperature 1 to one token id per row:
- inverse-cdf: gpu/sampling's `sample`, as the worker runs it (temperature, softmax, cumsum, one
  uniform per row, searchsorted);
- inverse-cdf seeded: the same with a seed on every row (u from the host hash of (seed, index));
- exp-race: softmax, then argmax(probs / E) with E ~ Exp(1) [S, V] (vLLM's and SGLang's draw);
- exp-race seeded: the same with E drawn row by row from each request's own generator (how the
  race honours per-request seeds; the generators exist before the clock starts);
- gumbel-max: argmax(logits + G) with G = -log(-log(U)) [S, V].
Variants run in interleaved rounds, so a noisy machine slows all of them alike; the table gives
each one's median over rounds of its per-round median time per call.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch

from conveyor.gpu.sampling import sample
from conveyor.wire.messages import SamplingParams

VARIANTS = ("inverse-cdf", "inverse-cdf seeded", "exp-race", "exp-race seeded", "gumbel-max")


def variants(num_rows: int, device: torch.device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    plain, seeded = [SamplingParams(temperature=1.0)] * num_rows, [SamplingParams(temperature=1.0, seed=s) for s in range(num_rows)]
    indices = list(range(num_rows))
    generators = [torch.Generator(device=device).manual_seed(s) for s in range(num_rows)]

    def exp_race(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)

    def exp_race_seeded(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for row, generator in zip(noise, generators, strict=True):
            row.exponential_(generator=generator)
        return probs.div_(noise).argmax(dim=-1)

    def gumbel_max(logits: torch.Tensor) -> torch.Tensor:
        return (logits - torch.rand_like(logits).log_().neg_().log_()).argmax(dim=-1)

    return {
        "inverse-cdf": lambda logits: sample(logits, plain, indices)[0],
        "inverse-cdf seeded": lambda logits: sample(logits, seeded, indices)[0],
        "exp-race": exp_race,
        "exp-race seeded": exp_race_seeded,
        "gumbel-max": gumbel_max,
    }


def time_shape(num_rows: int, vocab: int, device: torch.device, rounds: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each variant at logits [num_rows, vocab]."""
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
    fns = variants(num_rows, device)
    per_round: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for name in order:
            fns[name](logits)  # warm
            times = []
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                fns[name](logits)
                _sync(device)
                times.append(time.perf_counter() - start)
            per_round[name].append(statistics.median(times))
    return {name: statistics.median(values) for name, values in per_round.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (median)")
    print("| S | V | " + " | ".join(VARIANTS) + " |")
    print("|---:|---:|" + "---:|" * len(VARIANTS))
    for num_rows, vocab in itertools.product(args.rows, args.vocab):
        times = time_shape(num_rows, vocab, device, args.rounds, args.repeats)
        print(f"| {num_rows} | {vocab} | " + " | ".join(f"{times[name] * 1e3:.3f}" for name in VARIANTS) + " |", flush=True)
    return 0
