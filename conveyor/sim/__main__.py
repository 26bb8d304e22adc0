"""`python -m conveyor.sim`: run one workload under each scheduling policy and print a comparison.

    python -m conveyor.sim --workload sharegpt --path sharegpt.json \\
        --policies splitfuse,prefill_first,orca --rate 4 --num-requests 500 --cost cpu-tiny \\
        [--budget 2048 --num-kv-blocks N --max-num-seqs 256] [--json out.json] \\
        [--num-scheduler-steps 1,8] [--no-async-scheduling] [--host-ms 4 --host-row-us 35]

Every policy (and every multi-step K) sees the same requests with the same arrival times (one
seed); one column per (policy, K). Every figure is an estimate from the cost models.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from conveyor.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from conveyor.sim.hostcost import HostCost
from conveyor.sim.presets import HOST_COSTS, PRESETS, cost_model
from conveyor.sim.report import comparison_table
from conveyor.sim.run_metrics import compute
from conveyor.sim.simulator import SimConfig, simulate
from conveyor.sim.workloads import WorkloadConfig, make_requests

POLICIES = tuple(p.value for p in SchedulingPolicy)
DEFAULT = SimConfig()  # the engine flags' defaults: the configs' own, and the simulator's fixed pool


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m conveyor.sim", description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        default="sharegpt",
        help="sharegpt, fixed, random, normal, fastgen-PROMPT-OUTPUT (e.g. fastgen-2600-60), prefill-heavy, decode-heavy",
    )
    w.add_argument("--path", help="ShareGPT JSON (for --workload sharegpt)")
    w.add_argument(
        "--tokens",
        choices=("tokenizer", "whitespace"),
        default="tokenizer",
        help="ShareGPT token counts: a tokenizer's (--tokenizer), or 4/3 tokens per word",
    )
    w.add_argument(
        "--tokenizer", metavar="DIR", help="checkpoint whose tokenizer.json counts ShareGPT tokens (default: the tiny model's)"
    )
    w.add_argument("--num-requests", type=int, default=500)
    w.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals per second (default: all at once)")
    w.add_argument("--clients", type=int, default=None, help="closed loop: this many requests in flight")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-len", type=int, default=512, help="fixed/random/normal workloads")
    w.add_argument("--output-len", type=int, default=128, help="fixed/random/normal workloads")
    e = p.add_argument_group("engine")
    e.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    e.add_argument("--cost", default="cpu-tiny", help=f"cost model: {', '.join(PRESETS)}")
    e.add_argument(
        "--budget",
        default=str(DEFAULT.scheduler.max_num_batched_tokens),
        help="max_num_batched_tokens: one number, or per policy (splitfuse=512,orca=8192)",
    )
    e.add_argument("--max-num-seqs", type=int, default=DEFAULT.scheduler.max_num_seqs)
    e.add_argument("--num-kv-blocks", type=int, default=DEFAULT.cache.num_kv_blocks)
    e.add_argument("--block-size", type=int, default=DEFAULT.cache.block_size)
    e.add_argument("--max-model-len", type=int, default=DEFAULT.max_model_len)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT.scheduler.async_scheduling,
        help="plan step n+1 while step n computes",
    )
    e.add_argument(
        "--num-scheduler-steps",
        default=str(DEFAULT.scheduler.num_scheduler_steps),
        help="decode passes per plan (multi-step): one K, or several (1,8,16), one column each",
    )
    e.add_argument("--host-ms", type=float, default=None, help="host work per plan in ms (default: the cost preset's)")
    e.add_argument("--host-row-us", type=float, default=None, help="host work per row of a plan in us (default: the preset's)")
    p.add_argument("--json", help="also write every metric here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        sys.exit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    budgets = _budgets(args.budget, policies)
    steps = [int(k) for k in args.num_scheduler_steps.split(",")]
    if min(steps) < 1:
        sys.exit("--num-scheduler-steps must be at least 1")
    cost = cost_model(args.cost)
    host = _host(args, cost.name)
    workload = WorkloadConfig(
        kind=args.workload,
        num_requests=args.num_requests,
        rate=args.rate,
        seed=args.seed,
        path=args.path,
        token_counts=args.tokens,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        tokenizer_path=None if args.tokenizer is None else str(Path(args.tokenizer) / "tokenizer.json"),
    )
    requests = make_requests(workload)
    cache = CacheConfig(num_kv_blocks=args.num_kv_blocks, block_size=args.block_size)
    results = {}
    for policy in policies:
        for k in steps:
            scheduler = SchedulerConfig(
                policy=SchedulingPolicy(policy),
                max_num_batched_tokens=budgets[policy],
                max_num_seqs=args.max_num_seqs,
                enable_prefix_caching=not args.no_prefix_caching,
                async_scheduling=args.async_scheduling,
                num_scheduler_steps=k,
            )
            config = SimConfig(scheduler, cache, max_model_len=args.max_model_len, num_clients=args.clients, host=host)
            label = " ".join([policy] * (len(policies) > 1) + [f"K={k}"] * (len(steps) > 1)) or policy
            results[label] = compute(simulate(requests, config, cost))

    print(_header(args, requests, budgets, cost.name, host))
    print(comparison_table(results))
    if args.json:
        report = {
            "args": {**vars(args), "rate": None if math.isinf(args.rate) else args.rate},
            "estimate": True,  # from cost models, not a measurement
            "host": {"per_plan_s": host.per_plan_s, "per_row_s": host.per_row_s},
            "results": {label: m.as_dict() for label, m in results.items()},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _host(args: argparse.Namespace, cost: str) -> HostCost:
    """The preset's host cost, with --host-ms / --host-row-us replacing its parts."""
    preset = HOST_COSTS.get(cost, HostCost())
    if args.host_ms is None and args.host_row_us is None:
        return preset
    plan = preset.per_plan_s if args.host_ms is None else args.host_ms * 1e-3
    row = preset.per_row_s if args.host_row_us is None else args.host_row_us * 1e-6
    return HostCost(plan, row, name="custom")


def _header(args: argparse.Namespace, requests: list, budgets: dict[str, int], cost: str, host: HostCost) -> str:
    if args.clients:
        arrivals = f"{args.clients} closed-loop clients"
    else:
        arrivals = "all at t=0" if math.isinf(args.rate) else f"Poisson {args.rate:g} req/s"
    prompt = sum(r.num_prompt_tokens for r in requests) / len(requests)
    output = sum(r.max_tokens for r in requests) / len(requests)
    distinct = set(budgets.values())
    budget = str(distinct.pop()) if len(distinct) == 1 else " / ".join(f"{p} {b}" for p, b in budgets.items())
    return (
        f"workload {args.workload}: {len(requests)} requests, mean prompt {prompt:.0f} / output {output:.0f} "
        f"tokens, {arrivals}, seed {args.seed}\n"
        f"cost model {cost}; budget {budget} tokens, {args.max_num_seqs} seqs, "
        f"{args.num_kv_blocks} x {args.block_size}-token KV blocks\n"
        f"host {host.per_plan_s * 1e3:g} ms per plan + {host.per_row_s * 1e6:g} us per row; "
        f"async scheduling {'on' if args.async_scheduling else 'off'}; multi-step K = {args.num_scheduler_steps}\n"
        "ESTIMATE: every figure below comes from the simulator's cost models, not from a measurement\n"
    )


def _budgets(spec: str, policies: list[str]) -> dict[str, int]:
    """ "2048" for every policy, or "splitfuse=512,orca=8192" (unnamed policies keep 2048)."""
    if "=" not in spec:
        return dict.fromkeys(policies, int(spec))
    named = {k.strip(): int(v) for k, v in (item.split("=", 1) for item in spec.split(","))}
    return {p: named.get(p, DEFAULT.scheduler.max_num_batched_tokens) for p in policies}


if __name__ == "__main__":
    sys.exit(main())
