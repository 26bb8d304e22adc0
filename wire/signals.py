"""The signals between the launcher and its stage processes.

Shutdown is the launcher's. It drains on SIGINT or SIGTERM (LAUNCHERS), then stops each stage with
STOP, then SIGKILL after a grace period (stages/launcher.py). Stages ignore SIGINT and SIGTERM:
a terminal's Ctrl-C (SIGINT to the whole foreground process group) and an orchestrator that
signals every process of its unit reach them too, and a stage that stopped on them would look
like a failure in the middle of the drain. A stage stops on STOP, or on PARENT_DIED, which the
kernel sends when the launcher itself dies (stages/runtime.py). The ranks of a tensor-parallel
engine take STOP's default action, since one blocked in a collective never runs a Python handler
(gpu/parallel/rendezvous.py).
"""

from __future__ import annotations

import signal

LAUNCHERS = (signal.SIGINT, signal.SIGTERM)
STOP = signal.SIGUSR1
# Not SIGTERM, which is the launcher's: this one also means nobody is left to remove the run
# directory. (getppid cannot tell: the kernel signals when the launcher's forking thread exits,
# and a multi-threaded launcher killed with -9 may not have been reaped yet.)
PARENT_DIED = signal.SIGHUP
