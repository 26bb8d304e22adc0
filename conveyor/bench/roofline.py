"""`conveyor bench roofline`: a decode step's ops on the cpu backend beside their bandwidth roofline.

For one stream a decode pass reads the weights once, so its floor is bytes / bandwidth. Per ISA
variant (--isa; each in its own process with CONVEYOR_CPU_ISA set, roofline_round.py), in
interleaved rounds so that a shared machine slows every variant alike, this measures the memory
bandwidth (stream.py) and then the model's decode steps, each op timed with the least bytes it
must move (op_meter.py). Per variant one markdown table: each op's ms per step, its roofline
(its bytes / the roofline bandwidth) and their ratio; the timed ops' sum; the step's time outside
them (Python, the step's host work); the step with the timers on and off against the sum of the
rooflines, the ratio issue 52 wants within 1.25, off both eagerly and as the daemon runs it (from
the recorded kernel programs where the backend records them; the meter times the eager steps,
since a replay calls no op's Python face).

Figures: median over rounds of each round's mean per step (an op's, the step's), so the outside
line is the metered step minus its ops within one round; the plain steps (eager, as served) are
the median over rounds of each round's median step. The roofline bandwidth is the highest best-of-passes figure (STREAM's
convention) among copy, triad and read at the steps' threads (--threads, else the backend's): a
roofline is a floor, so it takes the most the machine showed. Bytes per step come from the last
round (every round decodes the same contexts). On a machine shared with other work, a step's
threads wait for cores (with 2 or more, each kernel's OpenMP barrier waits for the slowest), so
the ratios are upper bounds there; the bandwidth's median against its best shows how shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from conveyor.bench import stream
from conveyor.bench.roofline_round import Settings
from conveyor.config import env
from conveyor.gpu.backends.cpu.kernels import isa

MIB = 1 << 20


def parse_isa(text: str) -> tuple[str, ...]:
    """--isa: `all` (every variant this CPU runs) or VARIANT[,VARIANT...], each one this CPU runs."""
    if text == "all":
        return tuple(isa.runnable())
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names:
        raise argparse.ArgumentTypeError("expected `all` or comma-separated ISA variants")
    for name in names:
        try:
            isa.check_runs_here(isa.variant(name))
        except (ValueError, RuntimeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


class Child:
    """One variant's process (roofline_round.py): started, then asked for rounds one at a time."""

    def __init__(self, variant: str, settings: Settings) -> None:
        env = {**os.environ, "CONVEYOR_CPU_ISA": variant}
        command = [sys.executable, "-m", "conveyor.bench.roofline_round", json.dumps(settings.__dict__)]
        self.variant = variant
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready: dict[str, Any] | None = None

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.variant}'s process ended (exit {self.process.wait()}); its stderr is above")
        return json.loads(line)

    def round(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        """End of input ends the process (a dead one's pipe may be broken already)."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
        except BrokenPipeError:
            pass
        self.process.wait(timeout=60)


def summarize(ready: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds -> its figures (module docstring), JSON-able."""
    threads = ready["threads"]
    bandwidth = {}
    for b in rounds[0]["bandwidth"]:
        kind, t = b["kind"], b["threads"]
        seconds = [s for r in rounds for m in r["bandwidth"] if (m["kind"], m["threads"]) == (kind, t) for s in m["seconds"]]
        figure = stream.Bandwidth(kind, t, b["bytes_per_pass"], tuple(seconds))
        bandwidth[f"{kind}/{t}"] = {"kind": kind, "threads": t, "best_gbps": figure.best_gbps, "median_gbps": figure.median_gbps}
    roof = max((b for b in bandwidth.values() if b["threads"] == threads), key=lambda b: b["best_gbps"])
    gbps = roof["best_gbps"]
    steps = len(rounds[0]["metered_seconds"])

    def per_step_ms(values: list[float]) -> float:  # each round's total -> median ms per step
        return statistics.median(values) / steps * 1e3

    ops = []
    for label, last in rounds[-1]["ops"].items():
        ms = per_step_ms([r["ops"].get(label, {"seconds": 0.0})["seconds"] for r in rounds])
        roofline_ms = (last["weights"] + last["kv"] + last["other"]) / steps / gbps / 1e6
        ops.append(
            {
                "op": label,
                "calls_per_step": last["calls"] / steps,
                "mb_per_step": {k: last[k] / steps / 1e6 for k in ("weights", "kv", "other")},
                "ms": ms,
                "roofline_ms": roofline_ms,
                "ratio": ms / roofline_ms if roofline_ms else None,
            }
        )
    ops.sort(key=lambda o: -o["ms"])
    roofline_ms = sum(o["roofline_ms"] for o in ops)
    metered = per_step_ms([sum(r["metered_seconds"]) for r in rounds])
    outside = per_step_ms([sum(r["metered_seconds"]) - sum(o["seconds"] for o in r["ops"].values()) for r in rounds])
    plain = statistics.median(statistics.median(r["plain_seconds"]) for r in rounds) * 1e3
    eager = statistics.median(statistics.median(r["eager_seconds"]) for r in rounds) * 1e3
    return {
        "describe": ready["describe"],
        "threads": threads,
        "bandwidth": bandwidth,
        "roofline_bandwidth": roof,
        "ops": ops,
        "timed_ops_ms": sum(o["ms"] for o in ops),
        "outside_ms": outside,
        "step_metered_ms": metered,
        "step_plain_ms": plain,
        "step_eager_ms": eager,
        "roofline_ms": roofline_ms,
        "mb_per_step": sum(sum(o["mb_per_step"].values()) for o in ops),
    }


def render(variant: str, s: dict[str, Any], num_rounds: int, settings: Settings) -> str:
    """One variant's summary as markdown: the bandwidth table, then the ops'."""
    threads = sorted({b["threads"] for b in s["bandwidth"].values()})
    roof = s["roofline_bandwidth"]
    lines = [
        f"#### {variant}: {s['describe']}",
        "",
        f"Bandwidth, GB/s, best / median of {num_rounds} rounds x {settings.repeats} passes over arrays of "
        f"{settings.array_bytes / MIB:.0f} MiB; roofline: {roof['best_gbps']:.1f} GB/s "
        f"({roof['kind']}, {roof['threads']} threads, best).",
        "",
        "| kernel | " + " | ".join(f"{t} thread{'s' * (t > 1)}" for t in threads) + " |",
        "|---" * (len(threads) + 1) + "|",
    ]
    for kind in stream.ARRAYS:
        cells = [s["bandwidth"][f"{kind}/{t}"] for t in threads]
        lines.append(f"| {kind} | " + " | ".join(f"{c['best_gbps']:.1f} / {c['median_gbps']:.1f}" for c in cells) + " |")
    lines += [
        "",
        f"Decode step, {settings.rows} row(s) of {settings.context}+ tokens, {s['threads']} threads; ms per step, "
        f"median of {num_rounds} rounds x {settings.steps} steps.",
        "",
        "| op | calls/step | weights MB | KV MB | other MB | ms | roofline ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in s["ops"]:
        mb = o["mb_per_step"]
        ratio = "" if o["ratio"] is None else f"{o['ratio']:.2f}"
        lines.append(
            f"| {o['op']} | {o['calls_per_step']:.0f} | {mb['weights']:.3f} | {mb['kv']:.3f} | {mb['other']:.3f} "
            f"| {o['ms']:.3f} | {o['roofline_ms']:.3f} | {ratio} |"
        )
    roofline = s["roofline_ms"]

    def total(label: str, ms: float) -> str:
        return f"| {label} | | | | | {ms:.2f} | {roofline:.3f} | {ms / roofline:.2f} |"

    lines += [
        total("timed ops", s["timed_ops_ms"]),
        f"| outside the ops (Python, host work) | | | | | {s['outside_ms']:.2f} | | |",
        total(f"step, timers on ({s['mb_per_step']:.1f} MB)", s["step_metered_ms"]),
        total("step, timers off, eager", s["step_eager_ms"]),
        total("step, timers off, as served (recorded programs where recorded)", s["step_plain_ms"]),
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    variants = args.isa or (env.cpu_isa(),)
    l3 = stream.last_level_cache_bytes()
    array_bytes = args.array_mib * MIB if args.array_mib else (4 * l3 if l3 else 256 * MIB)
    settings = Settings(
        args.model,
        args.quantization,
        args.rows,
        args.context,
        args.steps,
        args.warmup,
        array_bytes,
        args.repeats,
        args.temperature,
        args.threads,
    )
    children = [Child(v, settings) for v in variants]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for child in children:
            child.ready = child.read()
        for _ in range(args.rounds):
            for child in children:
                results[child.variant].append(child.round())
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for child in children:
            child.close()
    features = isa.cpu_features() or frozenset()
    load = os.getloadavg()[0]  # a shared machine's other work shows here
    print(f"CPU: {isa.cpu_model()}; flags that matter: {' '.join(sorted(f for f in isa.GUARDS if f in features)) or 'none'}")
    print(f"{os.cpu_count()} CPUs; load average over the last minute at the end: {load:.2f}")
    summaries = {}
    for child in children:
        assert child.ready is not None
        summaries[child.variant] = summary = summarize(child.ready, results[child.variant])
        print()
        print(render(child.variant, summary, args.rounds, settings))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            record = {"cpu": isa.cpu_model(), "flags": sorted(features & set(isa.GUARDS)), "load_average_1m": load}
            record["settings"] = settings.__dict__
            json.dump({**record, "rounds": args.rounds, "variants": summaries}, f, indent=1)
    return 0
