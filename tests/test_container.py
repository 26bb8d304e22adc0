"""The container image: docker/Dockerfile copies every package, and docker/smoke.sh passes.

The smoke test builds and runs real containers (podman, as root; about 10 minutes on a cold
layer cache, 2 warm), so it is marked `container` and runs only with CONVEYOR_CONTAINER_TESTS=1:
    CONVEYOR_CONTAINER_TESTS=1 python -m pytest -q -m container
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "docker" / "smoke.sh"


def test_dockerfile_copies_every_package_directory():
    """A top-level package missing from the image would only fail when the container starts."""
    package_dirs = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) \1$", (REPO / "docker" / "Dockerfile").read_text(), re.MULTILINE))
    assert package_dirs <= copied, f"docker/Dockerfile does not COPY {sorted(package_dirs - copied)}"


def test_smoke_script_parses():
    subprocess.run(["bash", "-n", str(SMOKE)], check=True)


@pytest.mark.container
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("CONVEYOR_CONTAINER_TESTS") != "1", reason="set CONVEYOR_CONTAINER_TESTS=1 (podman, root, minutes)")
def test_smoke_script_passes():
    result = subprocess.run([str(SMOKE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
