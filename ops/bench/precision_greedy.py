"""Greedy tokens at each float32 matmul precision against the reference backend's.

ShareGPT's first turns of 400-2000 characters (100-500 tokens, so the prompts' steps take
the many-row products that --float32-matmul-precision can change), greedy, on a checkpoint: the
torch backend (the reference: dequantize + F.linear, at float32's own precision) and the cpu
backend at each precision given. Prints, per precision, how many tokens of each prompt equal the
reference's before the first difference ("=": all of them).

    python ops/bench/precision_greedy.py CHECKPOINT [--prompts 24 --tokens 128 --precisions highest,medium]

Figures: docs/benchmarks/cpu-isa.md ("Prefill on AMX").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from conveyor import LLM, SamplingParams
from conveyor.sim.sharegpt import sharegpt_pairs

WORKLOAD = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "sharegpt_sample.json"


def prompts(path: Path, count: int) -> list[str]:
    return [prompt for prompt, _ in sharegpt_pairs(str(path)) if 400 < len(prompt) < 2000][:count]


def first_difference(got: list[int], want: list[int]) -> int | str:
    """The index of the first token that differs ("=": none; a shorter run that agrees: its length)."""
    if got == want:
        return "="
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--precisions", default="highest,medium")
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    args = parser.parse_args()
    texts, greedy = prompts(args.workload, args.prompts), SamplingParams(max_tokens=args.tokens, temperature=0)
    torch.set_float32_matmul_precision("highest")
    reference = [o.outputs[0].token_ids for o in LLM(args.checkpoint, attention_backend="torch").generate(texts, greedy)]
    for precision in args.precisions.split(","):
        llm = LLM(args.checkpoint, attention_backend="cpu", float32_matmul_precision=precision)
        got = [o.outputs[0].token_ids for o in llm.generate(texts, greedy)]
        marks = [first_difference(g, w) for g, w in zip(got, reference, strict=True)]
        print(f"{precision}: {marks.count('=')} of {len(marks)} prompts equal the reference's; first differences {marks}")


if __name__ == "__main__":
    main()
