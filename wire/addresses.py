"""Where each stage's inbound socket lives: ipc:// paths inside the private run directory, and the
run directory's life: made by the launcher, swept when the launcher that made it is gone."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

PREFIX = "conveyor-"
OWNER_FILE = "launcher.pid"  # the pid of the launcher that made the directory


def make_run_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700), naming its owner."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    os.chmod(path, 0o700)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def sweep_stale_run_dirs() -> list[str]:
    """Remove this user's run directories whose launcher no longer exists (killed with -9 before
    its stages could clean up); the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue  # not ours, or not a run directory
        if not process_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def address(run_dir: str, stage: str, index: int = 0) -> str:
    return f"ipc://{os.path.join(run_dir, f'{stage}-{index}.sock')}"
