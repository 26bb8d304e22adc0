"""N-gram speculation replayed offline: the greedy answers to the grounded prompts, made once in
process and kept in a JSON file, run through the engine's own n-gram proposer and draft-length
choice (gpu/spec/ngram.py, gpu/spec/draft_length.py) one verifying pass at a time, as the worker
would run them at one stream. Greedy output is the same with and without speculation, so the
answers say which drafts hold without running the model: a policy is judged in seconds, not in
a race of many minutes on a drifting machine.

Each pass costs cost(d) plain decode steps for its d drafts: --curve, the ratios
ops/bench/verify_cost.py measures (d = 1, 2, ...; past its end the last step repeats), else the
cost draft_length.py prices (1 + ROW_COST d). Per k of --ks, three policies:
- adaptive: what the engine does (draft_length.py's choice from the row's acceptance);
- fixed: every draft the proposer finds ("draft_length": "fixed");
- oracle: exactly the drafts that will hold, the ceiling no choice of length can pass.
Printed per policy: tokens a pass, drafts that held, and the decode speed against plain decoding
(tokens per unit of cost); with --ttft (the first token's time in plain steps) also the ratio of
whole requests, the first token included, which is what a client's output tok/s sees.

    python ops/bench/spec_replay.py ANSWERS.json [--make N] [--ks 4,8] [--curve 1.27,1.39,...] [--ttft 11]

--make N first writes ANSWERS.json: the first N grounded prompts as chat, greedy, up to 256
tokens each (ops/bench/spec_inprocess.py's workload), plain decoding (a few minutes). An answer
that ended at its end-of-sequence token is drafted past, as the engine, which cannot know it
comes, drafts past it: only max_tokens limits the drafts.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from spec_inprocess import MAX_TOKENS, grounded_prompts  # beside this script

from conveyor.config.speculative import SpeculativeConfig
from conveyor.gpu.spec.draft_length import ROW_COST, Acceptance
from conveyor.gpu.spec.ngram import NgramProposer


def make_answers(path: Path, num: int) -> None:
    from conveyor import LLM
    from conveyor.wire.messages import SamplingParams

    llm = LLM()
    ids = [llm.encoder.encode_chat([{"role": "user", "content": p}]) for p in grounded_prompts(num)]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    path.write_text(
        json.dumps([{"prompt": p, "output": list(o.outputs[0].token_ids), "max_tokens": MAX_TOKENS} for p, o in zip(ids, outs)])
    )


def held(drafts: list[int], answer: list[int], at: int) -> int:
    """How many of the drafts for answer[at:] hold: the longest matching prefix."""
    n = 0
    while n < len(drafts) and at + n < len(answer) and drafts[n] == answer[at + n]:
        n += 1
    return n


def replay(answers: list[dict], k: int, policy: str, cost: Callable[[int], float]) -> tuple[list[float], int, int, int]:
    """-> each answer's cost in plain steps after its first token, and the passes, drafts and
    held drafts over all."""
    proposer = NgramProposer(SpeculativeConfig("ngram", k))
    per_answer, passes, drafted, accepted = [], 0, 0, 0
    for row in answers:
        prompt, answer = row["prompt"], row["output"]
        record, at, spent = Acceptance(), 1, 0.0  # the prefill drew answer[0]
        while at < len(answer):
            left = row.get("max_tokens", MAX_TOKENS) - at - 1  # the speculator's limit: none past max_tokens
            limit = min(k if policy != "adaptive" else record.draft_length(k, ROW_COST["cpu"]), left)
            drafts = proposer.lookup([prompt + answer[:at]], [max(0, limit)])[0]
            hold = held(drafts, answer, at)
            if policy == "oracle":
                drafts = drafts[:hold]
            if drafts:
                record.record(len(drafts), hold)
            passes, drafted, accepted = passes + 1, drafted + len(drafts), accepted + hold
            spent += cost(len(drafts))
            at += hold + 1
        per_answer.append(spent)
    return per_answer, passes, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(prog="python ops/bench/spec_replay.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", type=Path, help="the answers' JSON file (written by --make)")
    parser.add_argument("--make", type=int, metavar="N", help="first write the answers to the first N grounded prompts")
    parser.add_argument("--ks", default="4,8", help="n-gram k values, comma-separated")
    parser.add_argument("--curve", help="cost of a pass with 1, 2, ... drafts in plain steps (verify_cost.py's line)")
    parser.add_argument("--ttft", type=float, help="the first token's time in plain decode steps")
    args = parser.parse_args()
    if args.make:
        make_answers(args.answers, args.make)
    answers = json.loads(args.answers.read_text())
    if args.curve:
        curve = [1.0, *map(float, args.curve.split(","))]

        def cost(d: int) -> float:
            return curve[d] if d < len(curve) else curve[-1] + (d - len(curve) + 1) * (curve[-1] - curve[-2])
    else:

        def cost(d: int) -> float:
            return 1 + ROW_COST["cpu"] * d

    plain = [len(row["output"]) - 1 for row in answers]  # one step a token after the first
    priced = "--curve" if args.curve else f"1 + {ROW_COST['cpu']} d"
    print(f"{len(answers)} answers, {sum(plain) + len(answers)} tokens; a pass of d drafts costs {priced} plain steps")
    for k in map(int, args.ks.split(",")):
        for policy in ("adaptive", "fixed", "oracle"):
            spent, passes, drafted, accepted = replay(answers, k, policy, cost)
            line = (
                f"k {k} {policy:8s}: {sum(plain) / passes:.2f} tokens a pass, held {accepted}/{drafted}, "
                f"decode {sum(plain) / sum(spent):.2f}x"
            )
            if args.ttft is not None:
                whole = (len(plain) * args.ttft + sum(plain)) / (len(plain) * args.ttft + sum(spent))
                line += f", whole requests {whole:.2f}x"
            print(line)


if __name__ == "__main__":
    main()
