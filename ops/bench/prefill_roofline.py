"""The CPU's prefill against its compute roofline, and what that bounds a burst's TTFT to.

A prefill step is GEMMs: each prompt token costs 2 FLOPs per weight of the decoder's linears,
plus causal attention (2 x 2 x heads x head_dim per earlier token, per layer) and, once per
prompt, the LM head. So the machine's float32 GEMM rate bounds it. This measures:
1. the GEMM rate at one layer's shapes (q/k/v, o, gate/up, down), at ROWS x LEN rows:
   torch's F.linear (MKL, or whatever BLAS torch was built with), oneDNN on the weight as stored,
   and oneDNN on its packed copy (gpu/backends/cpu/kernels/onednn_linear.py);
2. a prefill step of ROWS fresh prompts of LEN tokens on the cpu backend as served (the worker's
   ModelRunner.execute, `conveyor bench forward`'s driver), for each checkpoint given;
3. the bound: a burst of BURST prompts of LEN tokens, all at once, cannot have half its first
   tokens before half its prompts' FLOPs are done at the best GEMM rate (any order: the prompts
   are alike), nor, at the step's own rate, before half its tokens went through such steps;
4. with --ops, the step's time per op (conveyor/bench/op_meter.py's timers, over as many more
   steps): what of it is the GEMMs and what the rest.

    python ops/bench/prefill_roofline.py CHECKPOINT... [--rows 16 --len 128 --burst 200] [--float32-matmul-precision medium] [--ops]

Figures: docs/benchmarks/cpu-isa.md (issue 52's burst TTFT).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from conveyor.bench import op_meter
from conveyor.bench.forward import StepDriver
from conveyor.config.engine import FLOAT32_MATMUL_PRECISIONS
from conveyor.gpu.backends.cpu.kernels import onednn_linear as onednn


def timed(fn, reps: int = 7) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt_gflop(config, length: int) -> float:
    """FLOPs of one prompt's prefill, in GFLOP: the linears for every token, causal attention,
    the LM head for the last token."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    linear = h * (q + 2 * kv) + q * h + 3 * h * inter  # weights a token multiplies, per layer
    attention = 2 * config.num_attention_heads * d * length * (length + 1) // 2  # QK^T and PV, summed over positions
    return 2 * (layers * (linear * length + attention) + h * config.vocab_size) / 1e9


def gemm_rates(config, rows: int) -> tuple[dict[str, dict[str, float]], float]:
    """GFLOP/s per layer shape and form; the best rate of a whole layer's products."""
    h, inter = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    shapes = {
        "q/k/v": ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, h),
        "o": (h, config.num_attention_heads * d),
        "gate/up": (2 * inter, h),
        "down": (h, inter),
    }
    rates: dict[str, dict[str, float]] = {}
    layer_seconds = {"torch": 0.0, "onednn": 0.0, "onednn packed": 0.0}
    for name, (n, k) in shapes.items():
        x, w = torch.randn(rows, k), torch.randn(n, k)
        forms = {"torch": lambda x=x, w=w: F.linear(x, w)}
        if onednn.onednn_available():
            packed = onednn.pack_linear_weight(w)
            forms["onednn"] = lambda x=x, w=w: onednn.linear(x, w, None)
            forms["onednn packed"] = lambda x=x, p=packed: onednn.packed_linear(x, p, None)
        rates[name] = {}
        for form, fn in forms.items():
            seconds = timed(fn)
            rates[name][form] = 2 * rows * n * k / seconds / 1e9
            layer_seconds[form] += seconds
    flop = 2 * rows * sum(n * k for n, k in shapes.values())
    best = max(flop / s / 1e9 for s in layer_seconds.values() if s > 0)
    return rates, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--rows", type=int, default=16, help="prompts in a prefill step")
    parser.add_argument("--len", type=int, default=128, help="tokens a prompt")
    parser.add_argument("--burst", type=int, default=200, help="prompts in the burst the bound is for")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--float32-matmul-precision",
        choices=FLOAT32_MATMUL_PRECISIONS,
        help="torch's setting for every product here (as the option)",
    )
    parser.add_argument("--ops", action="store_true", help="also time each op of the step (op_meter's timers)")
    args = parser.parse_args()
    if args.float32_matmul_precision:
        torch.set_float32_matmul_precision(args.float32_matmul_precision)
    config = AutoConfig.from_pretrained(args.checkpoints[0])
    rows = args.rows * args.len
    print(f"threads {torch.get_num_threads()}; GEMM GFLOP/s at {rows} rows:")
    rates, best = gemm_rates(config, rows)
    for name, forms in rates.items():
        print(f"  {name:8s} " + "  ".join(f"{form} {rate:.0f}" for form, rate in forms.items()))
    per_prompt = prompt_gflop(config, args.len)
    half = args.burst / 2 * per_prompt
    print(f"a layer's products at the best form: {best:.0f} GFLOP/s; a {args.len}-token prompt {per_prompt:.2f} GFLOP")
    print(f"bound on a {args.burst}-prompt burst's TTFT p50: {half / best:.2f} s (half its prompts at {best:.0f} GFLOP/s)")
    for path in args.checkpoints:
        driver = StepDriver("cpu", num_blocks=-(-rows // 16) * 2 + 64, model=path)
        seconds = [driver.prefill_and_drop(args.rows, args.len) for _ in range(args.steps + 1)][1:]
        step = statistics.median(seconds)
        gflop = args.rows * per_prompt
        print(
            f"{path}: a {args.rows} x {args.len} prefill step {step * 1e3:.0f} ms (median of {args.steps}), "
            f"{gflop / step:.0f} GFLOP/s, {step / (gflop / best):.2f}x the roofline; "
            f"half the burst at this rate: {args.burst / 2 / args.rows * step:.2f} s"
        )
        if args.ops:
            print_op_shares(driver, args)


def print_op_shares(driver: StepDriver, args: argparse.Namespace) -> None:
    """The step's time per op label, over args.steps steps with the timers on; the timers add
    their own cost to the step, so the shares, not the sum, are the figure."""
    meter = op_meter.install(driver.runner)
    total = 0.0
    try:
        for _ in range(args.steps):
            total += driver.prefill_and_drop(args.rows, args.len)
            meter.settle()
    finally:
        meter.remove()
    for label, seconds in sorted(meter.seconds.items(), key=lambda item: -item[1]):
        print(f"  {label:20s} {seconds / args.steps * 1e3:8.1f} ms a step  {seconds / total:6.1%}")
    outside = total - sum(meter.seconds.values())
    print(f"  {'outside the ops':20s} {outside / args.steps * 1e3:8.1f} ms a step  {outside / total:6.1%}")


if __name__ == "__main__":
    main()
