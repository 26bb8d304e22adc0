"""Where a decode step's time goes on a GPU: torch.profiler over ModelRunner.execute.

`python3 ops/gpu/step_profile.py [--layers 4] [--rows 64 256] [--steps 20] [--json]` writes a
Llama-3-8B-shaped checkpoint with its first `--layers` layers (random bf16 weights, tokenizer and
vocabulary as conveyor.tiny.generate's llama3-8b), prefills each row's 128-token prompt one row a
step, then profiles `--steps` decode steps of all rows, replayed from CUDA graphs (the default)
and eager (`--enforce-eager`). For each it prints the step's wall time (the host's, synchronised
by the sampled ids coming back), the device's busy time per step, and the device time by kernel
class (linears, attention, KV write, norms, rotary, activation, sampling, other) and by kernel,
per step. A step of all 32 layers is an ESTIMATE from these: each kernel launched at least once a
layer times 32 over `--layers`, the others (embedding, LM head, sampling) once. Without CUDA it refuses.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout without `pip install -e .`

from conveyor.engine_config import build_engine_config  # noqa: E402
from conveyor.gpu.step.runner import ModelRunner  # noqa: E402
from conveyor.tiny.checkpoint import make_checkpoint  # noqa: E402
from conveyor.tiny.generate import SHAPES  # noqa: E402
from conveyor.wire.messages import SamplingParams  # noqa: E402
from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan  # noqa: E402

BLOCK_SIZE, PROMPT_TOKENS = 16, 128
ACTIVITIES = [torch.profiler.ProfilerActivity.CUDA]
CLASSES = (  # (class, pattern of a kernel's name), first match wins
    ("sampling", r"softmax|argmax|sort|topk|multinomial|exponential|cumsum|gather|sampl"),
    ("attention", r"attn|attention|paged|flash|decode_kernel|_fwd"),
    ("kv write", r"kv|cache|reshape_and"),
    ("linears", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|splitk|linear"),
    ("norms", r"rms|norm"),
    ("rotary", r"rot|rope"),
    ("activation", r"silu|swiglu|act_and_mul|mul_kernel"),
)


def classify(kernel: str) -> str:
    for name, pattern in CLASSES:
        if re.search(pattern, kernel, re.IGNORECASE):
            return name
    return "other"


def profile(runner: ModelRunner, rows: int, steps: int, blocks_per_row: int, first_id: int, layers: int) -> dict:
    """One configuration's figures. The 32-layer ESTIMATE scales each kernel launched at least
    once a layer by 32 / `layers`."""
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    base = first_id * 1000
    for r in range(rows):  # one prompt a step: a prefill's rows are not what is profiled
        blocks = list(range(blocks_per_row * r, blocks_per_row * (r + 1)))
        prompt = [(100 + 7 * r + i) % 30000 + 100 for i in range(PROMPT_TOKENS)]
        new = NewSeq(base + r, prompt, greedy, len(prompt))
        runner.execute(StepPlan(base + r, [new], [ScheduledSeq(base + r, len(prompt), blocks)]))
    decode = iter(range(base + rows, base + 1000))

    def step() -> None:
        runner.execute(StepPlan(next(decode), [], [ScheduledSeq(base + r, 1, []) for r in range(rows)]))

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    walls = []
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            walls.append((time.perf_counter() - start) * 1e3)
    # A kernel's own device time (an op's row holds its kernels' as children, so only kernels have any).
    kernels = {a.key: (a.self_device_time_total, a.count) for a in prof.key_averages() if a.self_device_time_total > 0}
    runner.execute(StepPlan(next(decode), [], [], finished_seq_ids=[base + r for r in range(rows)]))
    by_kernel = sorted(((name, us / steps, n / steps) for name, (us, n) in kernels.items()), key=lambda k: -k[1])
    by_class: dict[str, float] = collections.defaultdict(float)
    for name, us, _ in by_kernel:
        by_class[classify(name)] += us
    walls.sort()
    scale = SHAPES["llama3-8b"]["num_hidden_layers"] / layers
    return {
        "estimate_32_layers_us": sum(us * (scale if calls >= layers else 1) for _, us, calls in by_kernel),
        "rows": rows,
        "wall_ms_p50": walls[len(walls) // 2],
        "device_us_per_step": sum(us for _, us, _ in by_kernel),
        "by_class_us": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "by_kernel": [{"kernel": n[:90], "us_per_step": us, "calls_per_step": c} for n, us, c in by_kernel[:25]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_profile.py: needs a CUDA device", file=sys.stderr)
        return 2
    shape = {**SHAPES["llama3-8b"], "num_hidden_layers": args.layers}
    total_layers = SHAPES["llama3-8b"]["num_hidden_layers"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "ckpt", "LlamaForCausalLM", seed=0, dtype="bfloat16", **shape)
        blocks_per_row = (PROMPT_TOKENS + 5 + args.steps + BLOCK_SIZE) // BLOCK_SIZE + 1
        num_blocks = blocks_per_row * max(args.rows)
        for eager in (False, True):
            options = dict(num_kv_blocks=num_blocks, enforce_eager=eager, max_num_seqs=max(args.rows))
            config = build_engine_config(str(path), device="cuda", dtype="bfloat16", **options)
            runner = ModelRunner(config)
            runner.initialize_cache(num_blocks)
            for i, rows in enumerate(args.rows):
                result = profile(runner, rows, args.steps, blocks_per_row, i + 1, args.layers)
                results.append({**result, "mode": "eager" if eager else "CUDA graphs"})
            del runner
            torch.cuda.empty_cache()
    shape = f"Llama-3-8B shape, {args.layers} of {total_layers} layers, bf16"
    print(f"device: {torch.cuda.get_device_name()}; {shape}, {args.steps} decode steps each")
    for r in results:
        busy = f"device busy {r['device_us_per_step']:.0f} us/step"
        print(f"\n## {r['rows']} rows, {r['mode']}: wall {r['wall_ms_p50']:.2f} ms/step (p50), {busy}")
        print(f"   32 layers, ESTIMATE (per-layer kernels x {total_layers / args.layers:g}): {r['estimate_32_layers_us']:.0f} us/step")
        print("   " + ", ".join(f"{c} {us:.0f}" for c, us in r["by_class_us"].items()))
        for k in r["by_kernel"][:12]:
            print(f"   {k['us_per_step']:8.1f} us {k['calls_per_step']:5.1f} calls  {k['kernel']}")
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "layers": args.layers, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
