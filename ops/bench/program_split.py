"""A recorded one-row decode program of the default model split by kernel, each part replayed alone.

The decode step's forward, as the CPU serves it, is one recorded kernel program
(gpu/backends/cpu/kernels/program.py). This records bucket `--rows` the way the worker does (an
eager step, then a recorded one) over a context of --context tokens, then replays, interleaved
over --rounds rounds of --reps replays each: the whole program, and the subprograms of its
quantized linears alone, its attention alone, and everything else (norms, rotary, the KV write,
SiLU * up, the embedding). Each part reads what it reads in the whole (the linears stream the
weights from memory: the model is larger than the L3), so the parts' times add up to about the
whole's, but for one: replayed without the linears, SiLU * up runs again and again on its own
output (every layer's call on the same buffer), whose values run off to both ends (after 30
calls, 1e33 at most, subnormals and zeros; after 330, 85 of 1536 not finite), where its exp
takes libmvec's slow path: 10-35 us a call against 1-1.5 on live values. So "the rest" alone
overstates its share (0.4-0.7 ms where its kernels take about 0.1); the whole less the linears
and attention is printed beside it. Prints ms per replay (median of rounds of medians)
and the linears' GB/s.

    python ops/bench/program_split.py [--rows 1] [--context 128] [--rounds 5] [--reps 20]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import time

import torch

from conveyor.bench.roofline_round import Rig, Settings
from conveyor.gpu.backends.cpu.kernels import program
from conveyor.gpu.backends.cpu.kernels.build import load_library

KERNELS = {  # library: the entries a decode forward calls
    "fused_ops": (
        "conveyor_rms_norm_f32",
        "conveyor_rotary_f32",
        "conveyor_silu_mul_f32",
        "conveyor_copy_columns_f32",
        "conveyor_embedding_f32",
    ),
    "quant_linear": ("conveyor_quant_linear_f32", "conveyor_quant_rows_f32"),
    "paged_attention": ("conveyor_paged_attention_f32", "conveyor_write_kv_f32"),
    "small_linear": ("conveyor_small_linear_f32",),
}


def entry_names() -> dict[int, str]:
    names = {}
    for lib_name, entries in KERNELS.items():
        lib = load_library(lib_name)
        for entry in entries:
            names[ctypes.cast(getattr(lib, f"{entry}_packed"), ctypes.c_void_p).value] = entry
    return names


def calls_of(words: list[int]) -> list[list[int]]:
    calls, i = [], 0
    while i < len(words):
        n = words[i + 1]
        calls.append(words[i : i + 2 + n])
        i += 2 + n
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    settings = Settings(None, None, args.rows, args.context, steps=4, warmup=2, array_bytes=1 << 20, repeats=1)
    rig = Rig(settings)
    ids = rig.start_rows()
    for _ in range(3):  # eager, recorded, replayed
        rig.decode(ids)
    graphs = rig.runner.graphs
    assert graphs is not None, "no decode graphs: not the cpu backend, or --enforce-eager"
    recorded = graphs._replays.get(args.rows)
    assert isinstance(recorded, program.Program), f"{args.rows} rows were not recorded"
    names = entry_names()
    calls = calls_of(recorded.words.tolist())
    print("calls:", dict(collections.Counter(names.get(c[0], "?") for c in calls)))

    def part(keep) -> torch.Tensor:
        return torch.tensor([w for c in calls if keep(names.get(c[0], "?")) for w in c], dtype=torch.int64)

    linear, attend = "conveyor_quant_linear_f32", "conveyor_paged_attention_f32"
    parts = {
        "whole program": recorded.words,
        "quantized linears": part(lambda n: n == linear),
        "attention": part(lambda n: n == attend),
        "the rest": part(lambda n: n not in (linear, attend)),
    }
    replay = program._replayer()
    results: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        for label, words in parts.items():
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                replay(words.data_ptr(), words.numel())
                times.append(time.perf_counter() - start)
            results[label].append(statistics.median(times))
    weights = sum(
        m.quantized.qweight.nbytes + m.quantized.scales.nbytes + (0 if m.quantized.mins is None else m.quantized.mins.nbytes)
        for name, m in rig.runner.model.named_modules()
        if getattr(m, "quantized", None) is not None and "layers." in name and name.endswith("proj")
    )
    medians = {label: statistics.median(values) * 1e3 for label, values in results.items()}
    for label, ms in medians.items():
        extra = f" ({weights / 1e6:.1f} MB of weights: {weights / ms / 1e6:.1f} GB/s)" if label == "quantized linears" else ""
        print(f"{label}: {ms:.3f} ms{extra}")
    rest = medians["whole program"] - medians["quantized linears"] - medians["attention"]
    print(f"the whole less the linears and attention: {rest:.3f} ms")


if __name__ == "__main__":
    main()
