"""Where each stage's inbound socket lives: ipc:// paths inside the private run directory."""

from __future__ import annotations

import os
import tempfile


def make_run_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700)."""
    path = tempfile.mkdtemp(prefix="conveyor-")
    os.chmod(path, 0o700)
    return path


def address(run_dir: str, stage: str, index: int = 0) -> str:
    return f"ipc://{os.path.join(run_dir, f'{stage}-{index}.sock')}"
