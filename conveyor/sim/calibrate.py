"""The emulated device's calibration table, built from the GPU runs' records (ops/gpu/runs/*.json):
`python -m conveyor.sim.calibrate ops/gpu/runs/*.json` writes gpu/emulated/calibration/<kind>.json
for each device kind the records name; calibrated.py reads it.

The table holds measured figures only, reduced (a median where several runs measured the same
shape) and tagged with the records they came from:
- `gemms`: one product's device time, replayed from a CUDA graph, per (n, k, kind), at each m;
- `layer_products`: one decoder layer's seven bf16 products (q, k, v, o, gate, up, down, each
  its own product, as the GPU backends multiply them at every recorded run) per token count;
- `decode_steps`: the step profiles (a 4-layer Llama-3-8B cut, 64 and 256 rows after 128-token
  prompts: device time per class, the profile's 32-layer ESTIMATE, the host's wall per step,
  graphed and eager), and the LM head's time;
- `races`: the K = 1 races with CUDA graphs, what the emulated race is held against.
Everything the cost model derives from these (in-step factors, the eager host's cost per layer)
is derived in calibrated.py, at load, so a change here shows there. The model whose shapes
these are is the records' (Llama-3-8B shape, bf16): `model`.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

from conveyor.gpu.emulated.calibrated import TABLES

MODEL = {  # the shape every recorded figure was measured on (conveyor.tiny.generate's llama3-8b)
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "num_layers": 32,
    "dtype": "bfloat16",
}
PROMPT_TOKENS, WARMUP_STEPS = 128, 5  # step_profile.py's: the context a profiled decode step reads


def build(records: dict[str, dict], kind: str) -> dict:
    """The table of device kind `kind` from {file name: record}."""
    mine = {name: r for name, r in sorted(records.items()) if r.get("device_kind") == kind}
    gemms: dict[tuple, list[tuple[float, str]]] = collections.defaultdict(list)
    layer: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)
    steps, races = [], []
    lm_head: dict | None = None  # the last profiled step's LM head
    for name, record in mine.items():
        for g in record.get("gemms") or []:
            gemms[(g["n"], g["k"], g["kind"], g["m"])].append((g["us"], name))
        for row in (record.get("lora") or {}).get("rows", []):
            if "half" not in row["case"]:  # the base products alone: every row's case but the split one repeats one
                layer[row["tokens"]].append((row["base_us"], name))
        step = record.get("step")
        if step:
            context = PROMPT_TOKENS + WARMUP_STEPS + (step["steps"] + 1) / 2  # mean seq_len over the profiled steps
            for p in step["profiles"]:
                steps.append({**p, "layers": step["layers"], "model_layers": step["model_layers"], "context_per_row": context})
            head = next(k for k in step["kernels"] if k["kernel"].startswith("LM head"))
            lm_head = {"rows": head["rows"], "us": head["us"], "source": name}
        for race in record.get("races", []):
            if race.get("config") == "K = 1, CUDA graphs":
                worker = record.get("worker_ms_per_1000_tokens_range")
                races.append({**race, "source": name, "worker_ms_per_1000_tokens_range": worker})
    by_shape: dict[tuple, list] = collections.defaultdict(list)
    for (n, k, gemm_kind, m), found in sorted(gemms.items()):
        by_shape[(n, k, gemm_kind)].append([m, statistics.median(us for us, _ in found)])
    return {
        "device": kind,
        "sources": sorted(mine),
        "model": MODEL,
        "gemms": [{"n": n, "k": k, "kind": g, "points": points} for (n, k, g), points in by_shape.items()],
        "layer_products": {
            "kind": "bf16",
            "products": "q, k, v, o, gate, up, down, each its own product",
            "points": [[t, statistics.median(us for us, _ in found)] for t, found in sorted(layer.items())],
        },
        "decode_steps": steps,
        "lm_head": lm_head,
        "races": races,
    }


def device_kinds(records: dict[str, dict]) -> list[str]:
    return sorted({r["device_kind"] for r in records.values() if r.get("device_kind")})


def load_records(paths: list[Path]) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in paths}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m conveyor.sim.calibrate", description="Build the emulated device's calibration tables.")
    p.add_argument("records", type=Path, nargs="+", help="ops/gpu/runs/*.json")
    p.add_argument("--out", type=Path, default=TABLES)
    args = p.parse_args(argv)
    records = load_records(args.records)
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in device_kinds(records):
        path = args.out / f"{kind}.json"
        path.write_text(json.dumps(build(records, kind), indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
