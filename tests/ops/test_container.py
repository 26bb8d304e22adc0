"""The container: docker/Dockerfile copies every package, compose.yaml waits out the drain, and
docker/smoke.sh passes.

The smoke test builds and runs real containers (podman, as root; about 7 minutes with no images,
1 with the layers cached), so it is marked `container` and runs only with CONVEYOR_CONTAINER_TESTS=1:
    CONVEYOR_CONTAINER_TESTS=1 python -m pytest -q -m container
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "docker" / "smoke.sh"


def test_compose_stop_grace_period_outlasts_the_drain():
    """Past stop_grace_period docker sends SIGKILL: it must cover the drain and the stages' stop."""
    yaml = pytest.importorskip("yaml")
    from conveyor.config import ServerConfig
    from conveyor.stages.launcher import GRACE_S

    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    grace = compose["services"]["conveyor"]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace), f"stop_grace_period {grace!r}: write it in whole seconds"
    assert int(grace[:-1]) > ServerConfig().drain_timeout_s + GRACE_S


def test_smoke_script_parses():
    subprocess.run(["bash", "-n", str(SMOKE)], check=True)


@pytest.mark.container
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("CONVEYOR_CONTAINER_TESTS") != "1", reason="set CONVEYOR_CONTAINER_TESTS=1 (podman, root, minutes)")
def test_smoke_script_passes():
    result = subprocess.run([str(SMOKE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
