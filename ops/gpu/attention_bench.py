"""Paged attention against its bandwidth roofline (issue 48), every candidate in one command.

`python3 ops/gpu/attention_bench.py [--json] [--dry-run]` times one attention call (one layer)
of Llama-3-8B's heads (32 query heads, 8 KV heads, head 128; bf16 KV in blocks of 16, each
row's blocks scattered over the pool) on eight steps: decode steps of 64 and 256 rows, and mixed
steps of those rows plus one fresh 512-token prompt chunk, each at contexts of 512 and 2048
tokens. Candidates: attention_candidates.py (conveyor's Triton kernels as picked and each
variant forced, torch SDPA as a sanity reference, FlashInfer's wrappers when importable).
Each time is the device's: the call replayed from a CUDA graph, the median of 50 replays with
the L2 cleared before each (kernel_bench.py's `graph_us`). Beside it, the roofline: the bytes
the call must move (each row's K and V once, q read, out written, its pages' table entries) at
the bandwidth of the card's row of gpu/emulated/devices.py, or its FLOPs at the bf16 peak where
those take longer (the chunk); `x` is time / roofline (issue 48 asks for <= 1.5 at 64 and 256
rows). Each output is checked against the float32 torch reference (`max_err`).
--dry-run (or no CUDA device): the same code under Triton's interpreter on shapes cut to a few
rows, 2 + 2 heads of 32 and short contexts, float32, wall-clock times that mean nothing; it
exits 1 if any candidate's output is wrong. Prints a markdown table; --json adds the figures as
one JSON line last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

DRY_RUN = "--dry-run" in sys.argv or not torch.cuda.is_available()
if DRY_RUN:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout without `pip install -e .`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_candidates import Step, candidates  # noqa: E402
from kernel_bench import graph_us  # noqa: E402

from conveyor.gpu.backends.triton.paged_attention_reference import reference_paged_attention  # noqa: E402
from conveyor.gpu.emulated.devices import DEVICES, DeviceSpec  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and step sizes: Llama-3-8B's on a GPU, a few tiny ones for the dry run."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    rows: tuple[int, ...] = (64, 256)
    contexts: tuple[int, ...] = (512, 2048)
    chunk: int = 512
    dtype: torch.dtype = torch.bfloat16


GPU_SHAPE = Shape()
DRY_SHAPE = Shape(num_heads=4, num_kv_heads=2, head_dim=32, rows=(2, 3), contexts=(20, 40), chunk=12, dtype=torch.float32)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # tests/kernels/test_triton_attention.py's


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "mixed" (the decode rows plus one fresh prompt chunk)
    rows: int  # decode rows
    context: int  # each decode row's seq_len after the step

    def lens(self, shape: Shape) -> tuple[list[int], list[int]]:
        """-> (query_lens, seq_lens) per row."""
        chunk = [shape.chunk] if self.kind == "mixed" else []
        return [1] * self.rows + chunk, [self.context] * self.rows + chunk


def make_step(case: Case, shape: Shape, pool: torch.Tensor, gen: torch.Generator) -> Step:
    """Rows' blocks drawn from a random permutation of `pool` (the shared [2, N, bs, Hkv, D] cache)."""
    query_lens, seq_lens = case.lens(shape)
    pages = [-(-s // shape.block_size) for s in seq_lens]
    order = torch.randperm(pool.shape[1], generator=gen)[: sum(pages)].to(torch.int32)
    tables = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    used = 0
    for row, n in enumerate(pages):
        tables[row, :n] = order[used : used + n]
        used += n
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim, generator=gen).to(pool.device, shape.dtype)
    return Step(
        q,
        pool,
        tables.to(pool.device),
        starts.to(pool.device),
        torch.tensor(seq_lens, dtype=torch.int32, device=pool.device),
        query_lens,
        seq_lens,
        shape.head_dim**-0.5,
    )


def roofline(step: Step, shape: Shape, spec: DeviceSpec) -> dict:
    """The bytes and FLOPs the call cannot avoid, and the time they take on `spec` at 100%."""
    elt = torch.finfo(shape.dtype).bits // 8
    keys = sum(step.host_seq_lens)
    num_bytes = keys * 2 * shape.num_kv_heads * shape.head_dim * elt  # K and V, once each
    num_bytes += 2 * step.q.numel() * elt  # q in, out back
    num_bytes += sum(-(-s // shape.block_size) for s in step.host_seq_lens) * 4  # the pages' table entries
    # QK^T and PV: 4 * Hq * D FLOPs per (query, visible key); a chunk of n sees n (n + 1) / 2 pairs.
    pairs = sum(s if q == 1 else q * (q + 1) // 2 + q * (s - q) for q, s in zip(step.query_lens, step.host_seq_lens))
    flops = 4 * shape.num_heads * shape.head_dim * pairs
    seconds = max(num_bytes / spec.mem_bw, flops / spec.peak_flops)
    return {
        "bytes": num_bytes,
        "flops": flops,
        "roofline_us": seconds * 1e6,
        "bound": "bytes" if num_bytes / spec.mem_bw >= flops / spec.peak_flops else "flops",
    }


def wall_us(fn, q: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(q)
    return (time.perf_counter() - start) * 1e6


def load_flashinfer(on_gpu: bool):
    """The module, or why not (the device tool's machines have no FlashInfer unless carried:
    ops/gpu/flashinfer_pack.sh)."""
    if not on_gpu:
        return "no CUDA device"
    try:
        import flashinfer  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken install's own error: said, not fatal
        return f"not importable: {type(e).__name__}: {e}"
    return flashinfer


def run_case(case: Case, shape: Shape, pool: torch.Tensor, spec: DeviceSpec, flashinfer, gen: torch.Generator) -> dict:
    step = make_step(case, shape, pool, gen)
    roof = roofline(step, shape, spec)
    want = reference_paged_attention(step.q, *step.args()).float()
    found, first_calls = candidates(step, flashinfer)
    timer = wall_us if DRY_RUN else graph_us
    results = []
    for name, fn in found.items():
        if isinstance(fn, str):
            results.append({"candidate": name, "skipped": fn})
            continue
        try:
            us = timer(fn, step.q)
            err = (fn(step.q).float() - want).abs().max().item()
        except Exception as e:  # one candidate's failure is recorded; the others still run
            results.append({"candidate": name, "skipped": f"failed: {type(e).__name__}: {str(e)[:300]}"})
            continue
        row = {"candidate": name, "us": us, "x": us / roof["roofline_us"], "tb_s": roof["bytes"] / us / 1e6, "max_err": err}
        row["ok"] = err <= TOLERANCE[shape.dtype]
        if name in first_calls:
            row["first_call_s"] = first_calls[name]
        results.append(row)
    return {**dataclasses.asdict(case), "tokens": step.q.shape[0], **roof, "candidates": results}


def fits(cases: list[dict]) -> list[dict]:
    """Per (step kind, rows, candidate), the line through its two contexts' times: the fixed cost
    (launch, setup, tail: the time at zero keys) and the marginal bandwidth (the extra bytes of the
    longer context over its extra time), which separate a slow start from a slow stream."""
    lines = []
    for kind, rows in sorted({(c["kind"], c["rows"]) for c in cases}):
        pair = sorted((c for c in cases if (c["kind"], c["rows"]) == (kind, rows)), key=lambda c: c["context"])
        short, long = pair[0], pair[-1]
        times = {r["candidate"]: r["us"] for r in short["candidates"] if "us" in r}
        for r in long["candidates"]:
            if "us" in r and r["candidate"] in times and r["us"] > times[r["candidate"]]:
                slope = (r["us"] - times[r["candidate"]]) / (long["bytes"] - short["bytes"])  # us per byte
                fixed = times[r["candidate"]] - slope * short["bytes"]
                lines.append(
                    {"kind": kind, "rows": rows, "candidate": r["candidate"], "fixed_us": fixed, "marginal_tb_s": 1e-6 / slope}
                )
    return lines


def print_table(cases: list[dict]) -> None:
    print("| step | rows | context | roofline us | candidate | us | x roofline | TB/s | max err |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for c in cases:
        for r in c["candidates"]:
            head = f"| {c['kind']} | {c['rows']} | {c['context']} | {c['roofline_us']:.1f} | {r['candidate']} |"
            if "skipped" in r:
                print(f"{head} skipped: {r['skipped'][:80]} | | | |")
            else:
                flag = "" if r["ok"] else " WRONG"
                print(f"{head} {r['us']:.1f} | {r['x']:.2f} | {r['tb_s']:.2f} | {r['max_err']:.1e}{flag} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops/gpu/attention_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="the figures as one JSON line last")
    parser.add_argument("--dry-run", action="store_true", help="the interpreter on tiny shapes (also without CUDA)")
    args = parser.parse_args(argv)
    shape = DRY_SHAPE if DRY_RUN else GPU_SHAPE
    device = "cpu" if DRY_RUN else "cuda"
    name = "interpreter, tiny shapes, times mean nothing" if DRY_RUN else torch.cuda.get_device_name()
    spec = DEVICES["h200" if "H200" in name else "h100"]
    cases = [Case(kind, rows, context) for kind in ("decode", "mixed") for rows in shape.rows for context in shape.contexts]
    gen = torch.Generator().manual_seed(0)
    # One pool for every step, as large as the largest step needs (2.2 GB at the GPU shapes).
    num_blocks = max(shape.rows) * -(-max(shape.contexts) // shape.block_size) + -(-shape.chunk // shape.block_size)
    pool = torch.randn(2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, device=device).to(shape.dtype)
    flashinfer = load_flashinfer(not DRY_RUN)
    versions = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    if not isinstance(flashinfer, str):
        versions["flashinfer"] = flashinfer.__version__
    started = time.perf_counter()
    figures = [run_case(case, shape, pool, spec, flashinfer, gen) for case in cases]
    print(f"device: {name}; roofline: {spec.name} ({spec.mem_bw / 1e12:.2f} TB/s, {spec.peak_flops / 1e12:.0f} TFLOP/s); {versions}\n")
    print_table(figures)
    wrong = [
        f"{c['kind']} {c['rows']}x{c['context']} {r['candidate']}" for c in figures for r in c["candidates"] if r.get("ok") is False
    ]
    if wrong:
        print(f"\nWRONG outputs: {wrong}", file=sys.stderr)
    if args.json:
        summary = {"device": name, "roofline_device": spec.name, "versions": versions, "seconds": time.perf_counter() - started}
        print(json.dumps({**summary, "cases": figures, "fits": fits(figures)}))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
