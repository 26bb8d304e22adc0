"""Speculative decoding in process on SmolLM2 (Q4_1 kept packed): the first N prompts of
ops/bench/grounded/prompts.json as chat, greedy, up to 256 tokens, S at a time (one batch,
--streams; default one stream), each configuration in turn per group of prompts (so drift in the
machine's speed falls on all alike); per configuration the output tokens/s and its ratio to none,
tokens per step, and drafts accepted over drafts verified. Configurations: none, n-gram at each k
of --ks (default 4), and each DRAFT.

    python ops/bench/spec_inprocess.py N [DRAFT ...] [--streams S] [--ks 4,8] [--logits-too]

DRAFT is a checkpoint directory for {"method": "draft_model"} (e.g. one from
`python -m conveyor.tiny.truncate`), or an EAGLE-3 head's for {"method": "eagle3"} (e.g. a random
one from `python -m conveyor.tiny.eagle3`); a trailing "!" makes every row take all k = 4 drafts
(`"draft_length": "fixed"`) instead of what gpu/spec/draft_length.py judges worth it, to read the
draft's acceptance as such. --logits-too adds, for each k, the same n-gram engine with the
head's argmax from one plane turned off (gpu/backends/cpu/kernels/quant_argmax.py): every pass
computes the full logits, as before that shortcut.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from conveyor import LLM
from conveyor.gpu.step import runner as runner_module
from conveyor.wire.messages import SamplingParams

PROMPTS = Path(__file__).with_name("grounded") / "prompts.json"
MAX_TOKENS = 256


def grounded_prompts(num: int) -> list[str]:
    """The first num prompts of the grounded workload, as the user's text (ops/bench/verify_cost.py
    and spec_replay.py take them from here too)."""
    return [d["conversations"][0]["value"] for d in json.loads(PROMPTS.read_text())[:num]]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python ops/bench/spec_inprocess.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("num", type=int, help="prompts, the first of ops/bench/grounded/prompts.json")
    parser.add_argument("drafts", nargs="*", help="draft model or EAGLE-3 head directories (a trailing ! : every draft verified)")
    parser.add_argument("--streams", type=int, default=1, help="prompts generated together, as one batch")
    parser.add_argument("--ks", default="4", help="n-gram k values to run, comma-separated")
    parser.add_argument("--logits-too", action="store_true", help="each k also with the head's one-plane argmax off")
    args = parser.parse_args()
    prompts = grounded_prompts(args.num)
    configs: dict[str, dict | None] = {"none": None}
    for k in map(int, args.ks.split(",")):
        configs[f"ngram-k{k}"] = {"method": "ngram", "num_speculative_tokens": k}
        if args.logits_too:
            configs[f"ngram-k{k} logits"] = configs[f"ngram-k{k}"]
    for draft in args.drafts:
        path = Path(draft.rstrip("!"))
        method = "eagle3" if "Eagle3" in str(json.loads((path / "config.json").read_text()).get("architectures")) else "draft_model"
        length = "fixed" if draft.endswith("!") else "adaptive"
        configs[f"{method} {draft}"] = {"method": method, "model": str(path), "num_speculative_tokens": 4, "draft_length": length}
    llms = {name: LLM(**({"speculative_config": c} if c else {})) for name, c in configs.items()}
    for name, llm in llms.items():
        if name.endswith(" logits"):
            llm.runner.model.lm_head.ops.argmax = None  # the cpu ops' QuantArgmax: every pass takes the logits
    spec_rows: list[tuple[int, int, int]] = []  # every result's (seq, drafted, accepted), as the scheduler counts them
    real = runner_module.pass_result

    def counting(launched, eos):
        result = real(launched, eos)
        spec_rows.extend(result.spec_rows)
        return result

    runner_module.pass_result = counting
    totals = {name: [0, 0.0, 0, 0, 0] for name in configs}  # tokens, seconds, steps, drafted, accepted
    outputs: dict[str, set] = {}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for at in range(0, len(prompts), args.streams):
        group = prompts[at : at + args.streams]
        for name, llm in llms.items():
            ids = [llm.encoder.encode_chat([{"role": "user", "content": prompt}]) for prompt in group]
            steps, spec_rows[:] = llm.core.scheduler.num_steps, []
            start = time.perf_counter()
            outs = [out.outputs[0] for out in llm.generate(ids, params)]
            total = totals[name]
            total[0] += sum(len(out.token_ids) for out in outs)
            total[1] += time.perf_counter() - start
            total[2] += llm.core.scheduler.num_steps - steps
            total[3] += sum(d for _, d, _ in spec_rows)
            total[4] += sum(a for _, _, a in spec_rows)
            for prompt, out in zip(group, outs):
                outputs.setdefault(prompt, set()).add(tuple(out.token_ids))
    none = totals["none"][0] / totals["none"][1]
    for name, (tokens, seconds, steps, drafted, accepted) in totals.items():
        rate = f"{accepted}/{drafted} = {accepted / drafted:.3f}" if drafted else "-"
        print(
            f"{name}: {tokens} tokens {seconds:.1f} s {tokens / seconds:.1f} tok/s ({tokens / seconds / none:.2f}x none), "
            f"{tokens / steps:.2f} tokens a step, accepted {rate}"
        )
    print("every configuration's output identical:", all(len(v) == 1 for v in outputs.values()))


if __name__ == "__main__":
    main()
