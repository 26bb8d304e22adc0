"""stages/runtime.py: how a stage process takes the signals that stop it (wire/signals.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from conveyor.wire.signals import STOP

# A stage's shape: loop until StageStopped, then a cleanup slow enough for a second signal to
# land in it, then interpreter exit (where torch's and zmq's exit hooks run). "ready" is printed
# inside the try: a signal sent once it is read must land where the stage handles it.
STAGE = textwrap.dedent(
    """
    import sys, time
    from conveyor.stages.runtime import StageStopped, raise_on_signals
    raise_on_signals()
    try:
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
    except StageStopped as e:
        print("stopped by", e, flush=True)
        time.sleep(0.5)  # cleanup
        print("cleaned up", flush=True)
    """
)


def start() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STAGE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_signal_does_not_interrupt_cleanup():
    proc = start()
    proc.send_signal(STOP)
    time.sleep(0.2)  # inside the cleanup
    proc.send_signal(STOP)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["stopped by SIGUSR1", "cleaned up"]
    assert "Traceback" not in err


def test_sigint_and_sigterm_are_the_launchers():
    """Ctrl-C signals the whole process group: a stage leaves it to the launcher's drain."""
    proc = start()
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None  # still serving
    proc.send_signal(STOP)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and out.splitlines() == ["stopped by SIGUSR1", "cleaned up"], err
