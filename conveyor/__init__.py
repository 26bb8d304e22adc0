"""conveyor: a process-per-stage LLM inference server.

The front door: `conveyor serve` (conveyor/cli.py) for the daemon, and the Python API here.
"""

from typing import TYPE_CHECKING

from conveyor.wire.messages import SamplingParams

__all__ = ["LLM", "SamplingParams"]  # LLM comes through __getattr__

if TYPE_CHECKING:
    from conveyor.llm import LLM


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for.
    if name == "LLM":
        from conveyor.llm import LLM

        return LLM
    raise AttributeError(name)
