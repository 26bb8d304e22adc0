"""What the LM head's argmax from one plane saves: SmolLM2's packed head (u8 [49152, 576]) over real
decode rows (hidden states caught at compute_logits while the first N grounded prompts decode,
greedy), M rows at a time for M of --rows: the full three-plane product and its argmax against
QuantArgmax (gpu/backends/cpu/kernels/quant_argmax.py), and the one-plane product alone, median
ms over the row windows (each the minimum of REPEATS calls, the three interleaved). Every window's
ids are checked equal, and the candidates a row keeps are counted.

    python ops/bench/head_argmax.py [N] [--rows 1,2,4,9,16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from spec_inprocess import grounded_prompts  # beside this script

from conveyor import LLM, SamplingParams
from conveyor.gpu.backends.cpu.kernels import quant_argmax


def best_ms(repeats: int, call, *args, **kwargs) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def product_argmax(kernel, x: torch.Tensor, head) -> torch.Tensor:
    return kernel(x, head).argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python ops/bench/head_argmax.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("num", type=int, nargs="?", default=8, help="prompts, the first of ops/bench/grounded/prompts.json")
    parser.add_argument("--rows", default="1,2,4,9,16", help="rows a call, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM()
    model = llm.runner.model
    argmax, head, table = model.lm_head.ops.argmax, model.lm_head.quantized, model.lm_head.prepared
    if not isinstance(table, quant_argmax.ArgmaxTable) or argmax is None:
        raise SystemExit("the head's one-plane argmax is not in use here (no C++ kernels, or not a quantized head)")
    caught: list[torch.Tensor] = []
    logits = model.compute_logits
    model.compute_logits = lambda hidden, upcast=True: caught.append(hidden.clone()) or logits(hidden, upcast)
    model.compute_greedy = lambda hidden: None  # every pass through compute_logits, to catch its rows
    chats = [llm.encoder.encode_chat([{"role": "user", "content": p}]) for p in grounded_prompts(args.num)]
    llm.generate(chats, SamplingParams(temperature=0, max_tokens=64))
    rows = torch.cat(caught)
    print(f"{len(rows)} rows caught; head {head.kind} {tuple(head.shape)}")
    kernel = argmax.kernel
    for m in map(int, args.rows.split(",")):
        full, ours, one, kept = [], [], [], []
        for at in range(0, len(rows) - m + 1, max(m, 7)):
            x = rows[at : at + m].contiguous()
            ids, valid = argmax(x, head, table) or (None, None)
            assert ids is not None and valid is not None and valid.all() and torch.equal(ids, kernel(x, head).argmax(-1)), at
            y1, amax = kernel(x, head, path="int8"), x.view(m, -1, quant_argmax.BLOCK).abs().amax(-1)
            bound = amax @ table.table.T
            kept += (y1 + bound >= (y1 - bound).amax(-1, keepdim=True)).sum(-1).tolist()
            full.append(best_ms(args.repeats, product_argmax, kernel, x, head))
            ours.append(best_ms(args.repeats, argmax, x, head, table))
            one.append(best_ms(args.repeats, kernel, x, head, path="int8"))
        print(
            f"{m} rows: product + argmax {statistics.median(full):.3f} ms, one-plane argmax {statistics.median(ours):.3f} ms "
            f"({statistics.median(full) / statistics.median(ours):.2f}x), one plane alone {statistics.median(one):.3f} ms; "
            f"candidates a row: median {statistics.median(kept):.0f}, max {max(kept)}"
        )


if __name__ == "__main__":
    main()
