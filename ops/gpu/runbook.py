"""The GPU runbook: `python3 ops/gpu/runbook.py STEP [--emulated]`, one step per device call, each
recording its figures or its failure (exit status, last lines of output) in its reports.

It owns the steps of ops/gpu/README.md's procedure, their time budget and the state across calls
(record.py); the procedure itself, each step's time estimate and where the figures go afterwards
are the README's. Each step runs conveyor in subprocesses. Invariants:
- every step is idempotent, stops itself within --budget-s (540 s: a device call has 600) and
  writes gpu-runbook.json and gpu-runbook.md to $OUT (./gpu-runbook-out where unset, or --out);
- a race configuration that no longer fits in the call is recorded as not run, and running the
  step again measures only the ones still missing on the same workload (--rerun measures all again);
- the races send a named workload (--workload, ops/gpu/workloads.py: sharegpt-500 by default),
  whose tokenizer the checkpoint step generates the checkpoint with; its figures name it;
- `--emulated` runs the same steps against `conveyor serve --device emulated` on a config-only
  tiny checkpoint, at a tiny scale, without the GPU tests: tests/ops/test_gpu_runbook.py;
- stdlib only, so that it can report a machine where conveyor's imports fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import race
import record
import workloads

REPO = Path(__file__).resolve().parents[2]
PACK = REPO / ".gpu-pack"
STEPS = (
    "setup",
    "tests",
    "kernels",
    "checkpoint",
    "race-k1",
    "race-k8",
    "race-defaults",
    "report",
)  # report: from the state alone, in seconds
COMPLETE = ".runbook-complete"  # written into a checkpoint once conveyor.tiny.generate has finished
TAIL = 40


@dataclasses.dataclass(frozen=True)
class Options:
    step: str
    emulated: bool
    out: Path  # the reports
    work: Path  # state, checkpoint, logs
    model: Path
    model_given: bool  # --model: served as it is, never generated
    workload: workloads.Workload  # its tokenizer is the checkpoint's; --sharegpt and --num-prompts override the rest
    sharegpt: Path
    num_prompts: int
    budget_s: float
    rerun: bool
    resume: Path
    site: str | None
    start_timeout_s: float  # loading 16 GB and capturing graphs on the GPU
    reserve_s: float  # ESTIMATE of a burst and a stop: the wait for /health leaves them this much
    min_race_s: float  # ESTIMATE of one configuration's whole run: less left, and it is not started


class StepFailed(Exception):
    def __init__(self, what: str, exit_status: int | None = None, output: str = ""):
        super().__init__(what)
        self.record = {"what": what, "exit_status": exit_status, "output_tail": "\n".join(output.splitlines()[-TAIL:])}


def run(cmd: list[str], timeout_s: float, **kw) -> tuple[int | None, str]:
    """(exit status or None on timeout, stdout and stderr together). The command runs in its own
    process group, killed whole on a timeout: daemons that pytest started must not outlive it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)
    try:
        out = proc.communicate(timeout=max(timeout_s, 1))[0]
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0] + f"\n(stopped after {timeout_s:.0f} s)"
    finally:
        if proc.poll() is None:  # SIGTERM reached the runbook meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def commit(packed_first: bool) -> str:
    """The commit the tree is. On the device (packed_first) the pack's word comes first: the copy of
    the tree there may come without .git, or with the .git of an older commit (a second GPU run
    reported its session's first commit "with uncommitted changes")."""
    packed = PACK / "commit.txt"
    if packed_first and packed.is_file():
        return f"{packed.read_text().strip()} (as packed)"
    status, out = run(["git", "-C", str(REPO), "rev-parse", "HEAD"], 30)
    if status == 0:
        _, changes = run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], 30)
        return out.strip() + (" (with uncommitted changes)" if changes.strip() else "")
    return f"{packed.read_text().strip()} (as packed)" if packed.is_file() else "unknown"


def probe(opts: Options, *args: str, timeout_s: float = 300) -> dict:
    site = ("--site", opts.site) if opts.site else ()
    status, out = run([sys.executable, str(REPO / "ops/gpu/probe.py"), *site, *args], timeout_s)
    if status != 0:
        raise StepFailed("ops/gpu/probe.py failed", status, out)
    return json.loads(out)


def device_name(opts: Options, device: dict) -> str:
    if opts.emulated:
        return "EMULATED h100"
    return device.get("name") or "no CUDA device"


def setup(opts: Options, state: dict, deadline: float) -> dict:
    found = probe(opts, timeout_s=deadline - time.monotonic())
    versions, device = found["versions"], found["device"]
    state["device"] = device_name(opts, device)
    print("versions:", ", ".join(f"{k} {v}" for k, v in versions.items()), f"\ndevice: {device}\ncommit: {state['commit']}")
    unmet = [(f"{p['dist']} needs {p['requirement']}, found {p['found']}", p["runtime"]) for p in found["unmet_requirements"]]
    failures = [StepFailed(what).record for what, runtime in unmet if runtime]
    failures += [StepFailed(f"import {name}: {error}").record for name, error in found["import_failures"].items()]
    if not opts.emulated and not device["cuda_available"]:
        failures.append(StepFailed("CUDA is not available to torch").record)
    warnings = [what for what, runtime in unmet if not runtime]
    warnings += [f"{p['requirement']} (the cuda extra), found {p['found']}" for p in found["cuda_extra_unmet"]]
    warnings += [f"{name} not imported: {error}" for name, error in found["optional_missing"].items()]
    figures = {"device": state["device"], **device, "commit": state["commit"], **versions}
    figures["modules_imported"] = found["modules_imported"]
    return {"figures": figures, "failures": failures, "note": "; ".join(warnings)}


def gpu_test_files() -> list[str]:
    """Every test file that marks a test cuda (the quantized kernels' among them), repository-relative."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())


def tests(opts: Options, state: dict, deadline: float) -> dict:
    if not probe(opts, "--device-only")["device"]["cuda_available"]:
        return {"status": "skipped", "note": "skipped: no CUDA device here (the GPU-marked tests skip without one)"}
    files = gpu_test_files()
    junit = opts.work / "tests.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    status, out = run(cmd, deadline - time.monotonic() - 10, cwd=REPO)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "tests.log").write_text(out)  # every failure's whole traceback, which the tails below cut
    print(out[-3000:])
    if not junit.is_file():
        raise StepFailed("pytest wrote no results", status, out)
    cases = ET.parse(junit).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    names = []
    for case in cases:
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        counts["failed" if outcome == "failure" else outcome] += 1
        if outcome in ("failure", "error"):
            names.append(f"{case.get('classname')}::{case.get('name')}")
    what = f"{len(names)} GPU tests failed: {', '.join(names)}" if names else f"pytest exited with {status}"
    failures = [StepFailed(what, status, out).record] if names or status != 0 else []
    return {"figures": {**counts, "failed_tests": names, "files": files}, "failures": failures}


def kernels(opts: Options, state: dict, deadline: float) -> dict:
    """ops/gpu/kernel_bench.py: the quantized GEMMs against bf16 and their roofline estimates."""
    if not probe(opts, "--device-only")["device"]["cuda_available"]:
        return {"status": "skipped", "note": "skipped: no CUDA device here (its times would be the interpreter's)"}
    status, out = run([sys.executable, str(REPO / "ops/gpu/kernel_bench.py"), "--json"], deadline - time.monotonic() - 5, cwd=REPO)
    print(out[-6000:])
    if status != 0:
        raise StepFailed("ops/gpu/kernel_bench.py failed", status, out)
    note = "times: do_bench medians, L2 cleared before each run; estimates: the ideal roofline"
    return {"figures": json.loads(out.strip().splitlines()[-1]), "note": note}


def checkpoint_command(opts: Options) -> list[str]:
    shape = ["--shape", "tiny", "--no-weights"] if opts.emulated else ["--shape", "llama3-8b", "--dtype", "bfloat16"]
    tokenizer = None if opts.emulated else opts.workload.tokenizer_dir(PACK)
    if tokenizer is not None:
        shape += ["--tokenizer-from", str(tokenizer)]
    return [sys.executable, "-m", "conveyor.tiny.generate", *shape, str(opts.model)]


def checkpoint(opts: Options, state: dict, deadline: float) -> dict:
    cmd = checkpoint_command(opts)
    tokenizer = None if opts.emulated or opts.model_given else opts.workload.tokenizer_dir(PACK)
    if tokenizer is not None and not (tokenizer / "tokenizer.json").is_file():
        raise StepFailed(f"{opts.workload.name} needs {tokenizer}/tokenizer.json: pack it here with bash ops/gpu/pack.sh")
    if opts.model_given:
        if not (opts.model / "config.json").is_file():
            raise StepFailed(f"--model {opts.model}: no config.json there")
        return {"figures": {"path": str(opts.model), "generated": False}, "note": "the checkpoint given with --model"}
    marker = opts.model / COMPLETE
    reused = marker.is_file() and marker.read_text() == " ".join(cmd[1:])
    started = time.monotonic()
    if not reused:
        shutil.rmtree(opts.model, ignore_errors=True)  # a generation cut short leaves a torn file
        status, out = run(cmd, deadline - time.monotonic() - 5, cwd=REPO)
        if status != 0:
            raise StepFailed("conveyor.tiny.generate failed", status, out)
        marker.write_text(" ".join(cmd[1:]))
    size = sum(f.stat().st_size for f in opts.model.iterdir())
    return {
        "figures": {
            "path": str(opts.model),
            "command": " ".join(cmd[1:]),
            "reused": reused,
            "generate_s": time.monotonic() - started,
            "size_gb": size / 1e9,
        }
    }


def _multistep(k: int) -> list[tuple[str, tuple[str, ...]]]:
    steps = ("--num-scheduler-steps", str(k)) if k > 1 else ()
    return [(f"K = {k}, CUDA graphs", steps), (f"K = {k}, eager", (*steps, "--enforce-eager"))]


def _scheduler(seqs: int, tokens: int, graphs: int) -> tuple[str, tuple[str, ...]]:
    flags = ("--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens), "--max-cuda-graph-batch-size", str(graphs))
    return f"{seqs} seqs, {tokens} tokens, graphs to {graphs}", flags


# Each race step's configurations: (label, the daemon's flags beyond the device's). race-defaults
# sweeps what vLLM V1 picks per device (running sequences, the token budget, graphed batch sizes)
# around today's defaults (256, 2048, 256), so that the GPU's own defaults come from a measurement.
RACES = {
    "race-k1": _multistep(1),
    "race-k8": _multistep(8),
    "race-defaults": [
        _scheduler(256, 2048, 256),
        _scheduler(512, 8192, 512),
        _scheduler(1024, 8192, 512),
        _scheduler(1024, 16384, 512),
    ],
}


def race_step(name: str):
    def step(opts: Options, state: dict, deadline: float) -> dict:
        note: list[str] = []
        earlier = state["steps"].get(name, {}).get("figures", {})
        configs = RACES[name]
        # Kept: a configuration measured on this workload (the earlier runs' figures name none).
        ok = {label: f for label, f in earlier.items() if f.get("ok") and f.get("workload") == opts.workload.name}
        figures = {label: ok[label] for label, _ in configs if label in ok and not opts.rerun}
        note += [f"{label}: kept from an earlier call (--rerun measures it again)" for label in figures]
        configs = [(label, flags) for label, flags in configs if label not in figures]
        if configs and not opts.model_given and not (opts.model / COMPLETE).is_file():
            note.append("the checkpoint was generated first (a fresh machine: its /tmp was empty)")
            if not run_step("checkpoint", opts, state, deadline):
                raise StepFailed("no checkpoint to serve: the checkpoint step failed")
        device = ("--device", "emulated", "--emulate", "h100")
        if not opts.emulated:
            device = ("--device", "cuda", "--attention-backend", "triton")
        failures = []
        for label, flags in configs:
            if deadline - time.monotonic() < opts.min_race_s:
                failures.append(StepFailed(f"{label}: not run, too little of this call's time left; run {name} again").record)
                continue
            config = race.RaceConfig(
                label,
                opts.model,
                (*device, *flags),
                opts.sharegpt,
                opts.num_prompts,
                opts.work,
                deadline,
                opts.start_timeout_s,
                opts.reserve_s,
            )
            print(f"{name}: {label}: serving {opts.model} ...", flush=True)
            try:
                figures[label] = {**race.measure(config), "ok": True, "workload": opts.workload.name}
                print(f"  {figures[label]['req_per_s']:.2f} req/s, bubble {figures[label]['bubble']:.3f}", flush=True)
            except race.RaceFailed as e:
                figures[label] = {**e.record.pop("figures", {}), "ok": False, "workload": opts.workload.name}
                failures.append({**e.record, "what": f"{label}: {e.record['what']}"})
        return {"figures": figures, "failures": failures, "note": "; ".join(note)}

    return step


STEP_FUNCTIONS = {
    "setup": setup,
    "tests": tests,
    "kernels": kernels,
    "checkpoint": checkpoint,
    **{name: race_step(name) for name in RACES},
}


def run_step(name: str, opts: Options, state: dict, deadline: float | None = None) -> bool:
    """Runs one step into the state and writes the reports; False if it failed. A step run inside
    another (the checkpoint inside a race) shares the outer one's deadline."""
    print(f"== {name}", flush=True)
    started = time.monotonic()
    try:
        result = STEP_FUNCTIONS[name](opts, state, deadline or started + opts.budget_s)
    except StepFailed as e:
        result = {"failures": [e.record]}
    except BaseException as e:  # a bug here, or SIGTERM: recorded, then passed on
        result = {"failures": [StepFailed(f"{type(e).__name__}: {e}", None, traceback.format_exc()).record]}
        if not isinstance(e, Exception):
            finish(name, started, result, opts, state)
            raise
    return finish(name, started, result, opts, state)


def finish(name: str, started: float, result: dict, opts: Options, state: dict) -> bool:
    failures = result.get("failures", [])
    status = "failed" if failures else result.get("status", "ok")
    state["steps"][name] = {
        "status": status,
        "seconds": time.monotonic() - started,
        "commit": state["commit"],
        "figures": result.get("figures", {}),
        "failures": failures,
        "note": result.get("note", ""),
    }
    record.save(state, opts.work / "state.json")
    record.write(state, opts.out)
    for failure in failures:
        print(f"{name} FAILED: {failure['what']}\n{failure.get('output_tail', '')}", flush=True)
    print(f"== {name}: {status} in {state['steps'][name]['seconds']:.0f} s", flush=True)
    return not failures


def options(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(prog="ops/gpu/runbook.py", description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    p.add_argument("step", choices=(*STEPS, "all"))  # all: every step in order (--emulated; on a GPU one call each)
    p.add_argument("--emulated", action="store_true", help="conveyor serve --device emulated, at a tiny scale, on any machine")
    p.add_argument("--out", type=Path, help="where the reports go (default: $OUT, else ./gpu-runbook-out)")
    p.add_argument("--work", type=Path, help="state, checkpoint and logs (default: /tmp/gpu-runbook, -emulated with --emulated)")
    p.add_argument("--model", type=Path, help="serve this checkpoint instead of generating one (the checkpoint step checks it)")
    p.add_argument("--workload", choices=sorted(workloads.WORKLOADS), default=workloads.DEFAULT, help="ops/gpu/workloads.py")
    p.add_argument("--sharegpt", type=Path, help="the ShareGPT JSON (default: .gpu-pack's, else ../shared/workloads')")
    p.add_argument("--num-prompts", type=int, help="requests per race (default: the workload's; 16 with --emulated)")
    p.add_argument("--budget-s", type=float, default=540.0, help="each step stops itself within this (default: %(default)s)")
    p.add_argument("--rerun", action="store_true", help="measure race configurations measured by an earlier call again")
    p.add_argument("--resume", type=Path, default=PACK / "gpu-runbook.json", help="a fetched report to start from on a fresh machine")
    p.add_argument("--site", help="the folder run.sh installed the packed wheels into (probe.py checks their requirements)")
    args = p.parse_args(argv)
    work = args.work or Path("/tmp/gpu-runbook-emulated" if args.emulated else "/tmp/gpu-runbook")
    packed = PACK / "sharegpt_sample.json"
    workload = workloads.WORKLOADS[args.workload]
    return Options(
        step=args.step,
        emulated=args.emulated,
        out=args.out or Path(os.environ.get("OUT") or "gpu-runbook-out"),
        work=work,
        model=args.model or work / ("tiny-emulated" if args.emulated else workload.checkpoint),
        model_given=args.model is not None,
        workload=workload,
        sharegpt=args.sharegpt or (packed if packed.is_file() else REPO.parent / "shared/workloads/sharegpt_sample.json"),
        num_prompts=args.num_prompts or (16 if args.emulated else workload.num_prompts),
        budget_s=args.budget_s,
        rerun=args.rerun,
        resume=args.resume,
        site=args.site,
        start_timeout_s=120.0 if args.emulated else 240.0,
        reserve_s=10.0 if args.emulated else 60.0,
        min_race_s=20.0 if args.emulated else 150.0,
    )


def main(argv: list[str] | None = None) -> int:
    opts = options(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that finally-blocks stop the daemons
    opts.work.mkdir(parents=True, exist_ok=True)
    state, resumed = record.load(opts.work / "state.json", opts.emulated, opts.resume)
    if resumed:
        print(f"resumed from {resumed} (this machine had no state)")
    state["commit"] = commit(packed_first=not opts.emulated)
    if opts.emulated:
        state["device"] = "EMULATED h100"
    elif not state.get("device") and opts.step not in ("setup", "report"):
        try:  # the report names the device, also when setup ran on another machine or not at all
            state["device"] = device_name(opts, probe(opts, "--device-only", timeout_s=60)["device"])
        except StepFailed as e:
            print(f"could not read the device: {e}")
    steps = STEPS[:-1] if opts.step == "all" else () if opts.step == "report" else (opts.step,)
    ok = [run_step(name, opts, state) for name in steps]
    record.save(state, opts.work / "state.json")
    record.write(state, opts.out)
    print(record.markdown(state))
    print(f"reports: {opts.out / 'gpu-runbook.json'}, {opts.out / 'gpu-runbook.md'}")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
