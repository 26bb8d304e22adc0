"""What a verifying pass of one stream costs by its number of drafts, on SmolLM2 (Q4_1 kept
packed), in process: for each d of --drafts, an engine whose n-gram proposer is replaced by a
stub that drafts exactly d tokens every pass (all but never accepted: the cost, not the worth, is
measured), "draft_length": "fixed"; the configurations take turns prompt by prompt (the first N
grounded prompts, each prefilled untimed first, then 48 tokens timed), so the machine's drift
falls on all alike. Prints each d's median pass time (ModelRunner.execute) and its ratio to a
plain decode step (d = 0), then the ratios as one line: the curve ops/bench/spec_replay.py takes.

    python ops/bench/verify_cost.py [N] [--drafts 0,1,2,4,8]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from spec_inprocess import grounded_prompts  # beside this script

from conveyor import LLM
from conveyor.gpu.spec.ngram import NgramProposer
from conveyor.gpu.step import runner as runner_module
from conveyor.wire.messages import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(prog="python ops/bench/verify_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("num", type=int, nargs="?", default=8, help="prompts, the first of ops/bench/grounded/prompts.json")
    parser.add_argument("--drafts", default="0,1,2,3,4,5,6,7,8", help="draft counts to time, comma-separated (0 first: the base)")
    args = parser.parse_args()
    counts = [int(d) for d in args.drafts.split(",")]
    if counts[0] != 0:
        parser.error("--drafts must start with 0, the plain decode step the others are measured against")
    NgramProposer.lookup = lambda self, histories, limits: [[h[-1]] * n for h, n in zip(histories, limits)]  # the stub
    fixed = {"method": "ngram", "draft_length": "fixed"}
    llms = {d: LLM(speculative_config={**fixed, "num_speculative_tokens": d}) if d else LLM() for d in counts}
    prompts = grounded_prompts(args.num)
    timing: list[int | None] = [None]  # the configuration being timed; None: untimed
    times: dict[int, list[float]] = collections.defaultdict(list)
    execute = runner_module.ModelRunner.execute

    def timed(runner, plan):
        start = time.perf_counter()
        try:
            return execute(runner, plan)
        finally:
            if timing[0] is not None:
                times[timing[0]].append(time.perf_counter() - start)

    runner_module.ModelRunner.execute = timed
    for prompt in prompts:
        for d, llm in llms.items():
            ids = llm.encoder.encode_chat([{"role": "user", "content": prompt}])
            timing[0] = None
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))  # the prefill, cached after
            timing[0] = d
            llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=48))
    base = statistics.median(times[0])
    for d in counts:
        median = statistics.median(times[d])
        print(f"{d} drafts: {len(times[d])} passes, median {median * 1e3:.2f} ms, {median / base:.3f}x a plain step")
    print("curve:", ",".join(f"{statistics.median(times[d]) / base:.3f}" for d in counts[1:]))


if __name__ == "__main__":
    main()
