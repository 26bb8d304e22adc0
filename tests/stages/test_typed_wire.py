"""The process graph's senders are typed (wire/topology.py): sending a peer a message its socket
does not take is an error for the type checker, before any process starts. Run mypy on two
snippets that differ only in the message sent; marked `lint` with the other checker runs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.lint,
    pytest.mark.slow,  # mypy from cold, most of a minute (-m slow); .ci/lint type-checks the tree itself
    pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[test]')"),
]

SNIPPET = """
import zmq
from conveyor.config import EngineConfig
from conveyor.wire.messages import AbortRequest
from conveyor.wire.step import StepPlan
from conveyor.wire.topology import SCHEDULER, sender

def tell(ctx: zmq.Context, config: EngineConfig) -> None:
    sender(ctx, config, SCHEDULER).send({message})
"""


def mypy(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(code)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--follow-imports=silent", str(snippet)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_message_the_scheduler_takes_type_checks(tmp_path):
    run = mypy(SNIPPET.format(message='AbortRequest(request_ids=["r"])'), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_message_the_scheduler_does_not_take_is_a_type_error(tmp_path):
    run = mypy(SNIPPET.format(message="StepPlan(step=0, new_seqs=[], scheduled=[])"), tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert 'Argument 1 to "send" of "Sender" has incompatible type "StepPlan"' in run.stdout, run.stdout
