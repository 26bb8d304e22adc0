"""Build a directory of the cache (config/env.py `cache_dir`) once, safely under races.

Generated checkpoints (the tiny model, converted GGUF files) are written into a scratch
directory beside their final place and renamed into it: a rename is atomic, so a reader sees no
checkpoint or a whole one, whatever crashes or runs at the same time. A process that loses the
race to another keeps the winner's directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_cached(target: Path, make: Callable[[Path], object]) -> Path:
    """`target`, made by `make(scratch)` unless it exists already."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make(scratch)
        os.rename(scratch, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
