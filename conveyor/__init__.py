"""conveyor: a process-per-stage LLM inference server.

The front door: `conveyor serve` (conveyor/cli.py) for the daemon, and the Python API here.
"""

from typing import TYPE_CHECKING

from conveyor.wire.messages import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]  # LLM and LoRARequest come through __getattr__

if TYPE_CHECKING:
    from conveyor.llm import LLM, LoRARequest


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for.
    if name in ("LLM", "LoRARequest"):
        from conveyor import llm

        return getattr(llm, name)
    raise AttributeError(name)
