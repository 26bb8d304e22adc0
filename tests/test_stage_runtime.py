"""stages/runtime.py: how a stage process takes the signals that stop it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

# A stage's shape: loop until StageStopped, then a cleanup slow enough for a second signal to
# land in it, then interpreter exit (where torch's and zmq's exit hooks run).
STAGE = textwrap.dedent(
    """
    import sys, time
    from conveyor.stages.runtime import StageStopped, raise_on_signals
    raise_on_signals()
    print("ready", flush=True)
    try:
        while True:
            time.sleep(0.01)
    except StageStopped as e:
        print("stopped by", e, flush=True)
        time.sleep(0.5)  # cleanup
        print("cleaned up", flush=True)
    """
)


def test_a_second_signal_does_not_interrupt_cleanup():
    proc = subprocess.Popen([sys.executable, "-c", STAGE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # inside the cleanup
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["stopped by SIGTERM", "cleaned up"]
    assert "Traceback" not in err
