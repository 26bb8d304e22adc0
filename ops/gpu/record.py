"""The runbook's results: one JSON state that accumulates across calls, and its two reports.

The state lives in WORK/state.json (under /tmp: it lasts as long as the machine). A machine is
given back 30 s after a call, so a call that finds none starts from the last report fetched, if
it was copied to .gpu-pack/gpu-runbook.json (`--resume`), and only where it was written in the
same mode (emulated or not). Shape, which is also gpu-runbook.json's:

    {"emulated": bool, "device": str, "commit": str, "updated": str,
     "steps": {STEP: {"status": "ok" | "failed" | "skipped", "seconds": float, "commit": str,
                      "figures": {...}, "failures": [{"what", "exit_status", "output_tail"}], "note": str}}}

A race step's figures are keyed by configuration ("K = 1, CUDA graphs"). `write` puts
gpu-runbook.json and gpu-runbook.md (one table per step; every figure of an emulated run is
labelled EMULATED) into the output folder ($OUT on the GPU machine).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

RACE_HEADER = "| {title} | req/s | output tok/s | TTFT p50 / p99 | ITL p50 / p99 | bubble | graph capture s / MiB |"


def load(state_file: Path, emulated: bool, resume: Path | None) -> tuple[dict, str | None]:
    """(the state, where it came from when it was not this machine's)."""
    for source in (state_file, resume):
        if source is not None and source.is_file():
            state = json.loads(source.read_text())
            if state.get("emulated") == emulated:
                return state, None if source == state_file else str(source)
    return {"emulated": emulated, "device": None, "commit": None, "steps": {}}, None


def save(state: dict, state_file: Path) -> None:
    state["updated"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(state, indent=1) + "\n")


def write(state: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu-runbook.json").write_text(json.dumps(state, indent=1) + "\n")
    (out_dir / "gpu-runbook.md").write_text(markdown(state))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _ms(a: float, b: float) -> str:
    return f"{a:.1f} / {b:.1f} ms"


def race_tables(figures: dict, tag: str) -> list[str]:
    """The docs/benchmarks.md issue-16 table (paste-ready), then the rest of the figures."""
    ok = {label: f for label, f in figures.items() if f.get("ok")}
    if not ok:
        return []
    num_prompts = max(f["completed"] + f["failed"] for f in ok.values())
    lines = [RACE_HEADER.format(title=f"ShareGPT {num_prompts}, all at once, {tag}"), "|---|---:|---:|---:|---:|---:|---:|"]
    for label, f in ok.items():
        graphs = f.get("graph_capture")
        capture = f"{graphs['seconds']:.1f} s / {graphs['mib']} MiB" if graphs else "-"
        lines.append(
            f"| {tag}: {label} | {f['req_per_s']:.2f} | {f['output_tok_per_s']:.0f} | "
            f"{_ms(f['ttft_p50_ms'], f['ttft_p99_ms'])} | {_ms(f['itl_p50_ms'], f['itl_p99_ms'])} | "
            f"{f['bubble']:.3f} | {capture} |"
        )
    stages = sorted({s for f in ok.values() for s in f["stage_ms_per_1000_output_tokens"]})
    lines += [
        "",
        f"| {tag} | completed | TPOT p50 | start-up s | host us / output token | "
        + " | ".join(f"{s} ms / 1k tok" for s in stages)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(stages),
    ]
    for label, f in ok.items():
        per_stage = " | ".join(f"{f['stage_ms_per_1000_output_tokens'].get(s, 0.0):.1f}" for s in stages)
        lines.append(
            f"| {tag}: {label} | {f['completed']}/{f['completed'] + f['failed']} | {f['tpot_p50_ms']:.2f} ms | "
            f"{f['startup_s']:.1f} | {f['host_us_per_output_token']:.1f} | {per_stage} |"
        )
    if "K = 1, CUDA graphs" in ok:  # issue 15's table: the daemon as it starts by default
        f = ok["K = 1, CUDA graphs"]
        lines += [
            "",
            f"| ShareGPT {num_prompts}, all at once, {tag} | req/s | output tok/s | median TTFT | mean TPOT | bubble |",
            "|---|---:|---:|---:|---:|---:|",
            f"| {tag}: conveyor, K = 1, CUDA graphs | {f['req_per_s']:.2f} | {f['output_tok_per_s']:.0f} | "
            f"{f['ttft_p50_ms']:.1f} ms | {f['tpot_mean_ms']:.2f} ms | {f['bubble']:.3f} |",
        ]
    for label, f in ok.items():
        lines += [f"- {label}: `{line.split('] ', 1)[-1]}`" for line in f.get("log_lines", [])]
    return lines


def step_lines(name: str, step: dict, tag: str) -> list[str]:
    lines = [f"## {name}: {step['status']} ({step['seconds']:.0f} s, commit {step.get('commit')})", ""]
    if step.get("note"):
        lines += [step["note"], ""]
    figures = step.get("figures") or {}
    if name.startswith("race-"):
        lines += race_tables(figures, tag)
    elif figures:
        lines += [f"| {name} | {tag} |", "|---|---|"]
        lines += [f"| {key} | {_cell(value)} |" for key, value in figures.items()]
    for failure in step.get("failures", []):
        status = "" if failure.get("exit_status") is None else f" (exit status {failure['exit_status']})"
        lines += ["", f"FAILED: {failure['what']}{status}"]
        if failure.get("output_tail"):
            lines += ["", "```", *failure["output_tail"].splitlines()[-20:], "```"]
    return lines + [""]


def markdown(state: dict) -> str:
    emulated = state["emulated"]
    tag = state.get("device") or ("EMULATED h100" if emulated else "device not yet read")
    head = [f"# GPU runbook: {tag}", ""]
    if emulated:
        head += ["EMULATED: no GPU ran; every device time below is the roofline model's (`--device emulated`).", ""]
    head += [f"Commit {state.get('commit')}, updated {state.get('updated')}.", ""]
    body = [line for name, step in state["steps"].items() for line in step_lines(name, step, tag)]
    return "\n".join(head + body)
