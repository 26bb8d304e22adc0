"""gpu/step/host_memory.py: glibc keeps freed memory for the next CPU step."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from conveyor.gpu.step import host_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_large_blocks_come_back_from_the_heap_after_the_call():
    # In a fresh process. By default a 64 MiB block is always mmapped (glibc's adaptive threshold
    # stops at 32 MiB), so every free returns it to the kernel; after keep_freed_memory it comes
    # from the heap. mallinfo2's hblkhd counts the bytes in mmapped blocks.
    script = (
        "import ctypes\n"
        "from conveyor.gpu.step.host_memory import keep_freed_memory\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype = ctypes.c_void_p\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in\n"
        "                'arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost'.split()]\n"
        "libc.mallinfo2.restype = Info\n"
        "def mapped_after_malloc():\n"
        "    p = libc.malloc(64 << 20); info = libc.mallinfo2(); libc.free(ctypes.c_void_p(p)); return info.hblkhd\n"
        "before = [mapped_after_malloc() for _ in range(2)]\n"
        "assert keep_freed_memory()\n"
        "after = mapped_after_malloc()\n"
        "print(min(before) >= 64 << 20, after < 64 << 20)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_without_glibc_nothing_changes(monkeypatch):
    def no_libc(name):
        raise OSError("no libc here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()
