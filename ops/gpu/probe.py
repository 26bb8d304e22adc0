"""What this machine holds for conveyor, as one JSON object on stdout: the runbook's setup step.

`python3 ops/gpu/probe.py [--site DIR] [--device-only]` reports
- versions: Python, torch (and the CUDA it was built for), triton and every package conveyor
  imports, as the interpreter resolves them (the packed wheels in --site come first on PYTHONPATH);
- the device: whether CUDA answers, its name, capability and memory;
- unmet requirements: conveyor's own (pyproject's dependencies, as installed) and those of every
  packed wheel in --site, each as {dist, requirement, found, runtime}; `runtime` is true where
  conveyor needs the package (directly or through another packed one), false for the test
  suite's (openai, jsonschema); the `cuda` extra's (triton) are reported apart, as warnings;
- import failures: every conveyor module is imported (every package under conveyor/); a module
  whose missing package belongs to an optional extra (ray) is listed apart, not as a failure.
It runs as its own process so that the runbook itself imports neither torch nor conveyor.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import os
import pkgutil
import platform
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSIONS = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "aiohttp",
    "uvloop",
    "pyzmq",
    "msgspec",
    "prometheus-client",
    "jinja2",
    "gguf",
    "xgrammar",
    "apache-tvm-ffi",
    "pydantic",
    "setuptools",
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def device() -> dict:
    import torch

    info: dict = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
    return info


def requirement_problems(site: str | None) -> tuple[list[dict], list[dict]]:
    """(unmet requirements, unmet requirements of the cuda extra)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return [{"dist": "packaging", "requirement": "packaging", "found": None, "runtime": False}], []
    packed = {canonical(d.metadata["Name"]): d for d in metadata.distributions(path=[site])} if site else {}

    def requires(dist: str, extra: str = "") -> list:
        reqs = [Requirement(r) for r in (metadata.requires(dist) or [])]
        return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": extra})]

    def unmet(dist: str, reqs: list, runtime: bool) -> list[dict]:
        out = []
        for r in reqs:
            try:
                found = metadata.version(r.name)
            except metadata.PackageNotFoundError:
                found = None
            if found is None or not r.specifier.contains(found, prereleases=True):
                out.append({"dist": dist, "requirement": str(r), "found": found, "runtime": runtime})
        return out

    # Conveyor's closure through the packed wheels: the rest of the pack serves the tests alone.
    runtime, todo = set(), [canonical(r.name) for r in requires("conveyor")]
    while todo:
        name = todo.pop()
        if name in packed and name not in runtime:
            runtime.add(name)
            todo += [canonical(r.name) for r in requires(packed[name].metadata["Name"])]
    problems = unmet("conveyor", requires("conveyor"), True)
    for name, dist in sorted(packed.items()):
        problems += unmet(dist.metadata["Name"], requires(dist.metadata["Name"]), name in runtime)
    plain = {str(r) for r in requires("conveyor")}
    cuda = [r for r in requires("conveyor", "cuda") if str(r) not in plain]
    return problems, unmet("conveyor[cuda]", cuda, False)


def import_all() -> tuple[int, dict[str, str], dict[str, str]]:
    """(modules imported, failures, modules that need an optional extra that is not installed)."""
    optional = {canonical(re.split(r"[^A-Za-z0-9._-]", r, maxsplit=1)[0]) for r in metadata.requires("conveyor") or [] if "extra" in r}
    # Every package under conveyor/, through its layers' links to the top-level folders (as setuptools finds them).
    walk = os.walk(REPO / "conveyor", followlinks=True)
    packages = sorted(".".join(Path(d).relative_to(REPO).parts) for d, _, files in walk if "__init__.py" in files)
    count, failures, skipped = 0, dict[str, str](), dict[str, str]()
    for package in packages:
        names = [package]
        try:
            modules = pkgutil.iter_modules(importlib.import_module(package).__path__, package + ".")
            names += [m.name for m in modules if not m.ispkg]  # subpackages are in the list themselves
        except Exception:  # the package itself fails: reported below
            pass
        for name in names:
            if name.endswith(".__main__"):  # runs a command line when imported
                continue
            count += 1
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                missing = canonical((e.name or "").split(".")[0])
                (skipped if missing in optional else failures)[name] = f"{type(e).__name__}: {e}"
            except Exception as e:
                failures[name] = f"{type(e).__name__}: {e}"
    return count, failures, skipped


def main() -> int:
    p = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    p.add_argument("--site", help="the folder the packed wheels were installed into")
    p.add_argument("--device-only", action="store_true", help="the device and versions alone (no imports checked)")
    args = p.parse_args()
    out: dict = {"versions": versions(), "device": device()}
    if not args.device_only:
        out["unmet_requirements"], out["cuda_extra_unmet"] = requirement_problems(args.site)
        out["modules_imported"], out["import_failures"], out["optional_missing"] = import_all()
    json.dump(out, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
