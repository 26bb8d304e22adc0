"""ruff (lint and format), mypy and pyright over the whole tree, through .ci/lint, so that the README's
test command runs them.

Marked `lint` (`-m "not lint"` leaves them out). Skipped where a tool is not installed (the
`test` extra pins them).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.lint


@pytest.mark.parametrize("tool", ["ruff-check", "ruff-format", "mypy", "pyright"])
def test_clean(tool: str):
    module = tool.split("-")[0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    # The tools' scripts sit beside this interpreter.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", ".ci/lint", tool], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f".ci/lint {tool} failed:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"
