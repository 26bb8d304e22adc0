"""Adapters: the LoRA adapters one engine serves, by name, and which of them hold its device slots.

The registry maps a name to its AdapterInfo (config/lora_adapter.py checked it): --lora-modules at
start, /v1/load_lora_adapter while serving. The worker has `--max-loras` slots, each holding one
adapter or none. A sequence of an adapter pins it while it runs (admitted, until it finishes or is
preempted); a slot whose adapter no sequence pins may be taken, least recently used first. A
waiting sequence whose adapter has no slot and finds none to take waits (admission skips it,
step_builder.py), and the others go on. Unloading a name refuses new requests for it at once; its
running sequences finish on their slot, which empties when the last one does.

Pure Python, no torch: `acquire` says which slot, and the load the plan carries when the adapter
is not there yet (StepPlan.lora_loads); the worker moves the weights.
"""

from __future__ import annotations

import collections

from conveyor.config.engine import EngineConfig
from conveyor.config.lora_adapter import AdapterInfo, read_adapter_info
from conveyor.wire.step import LoraLoad


class UnknownAdapter(LookupError):
    """A request named an adapter this engine does not serve (a 404 for the client)."""


class NameTaken(ValueError):
    """An adapter's name is served already, or still finishing requests after its unload."""


class Adapters:
    def __init__(self, max_loras: int) -> None:
        self.registry: dict[str, AdapterInfo] = {}
        self._slots: list[str | None] = [None] * max_loras  # the adapter each slot holds
        self._slot_of: dict[str, int] = {}
        self._pins: collections.Counter[str] = collections.Counter()  # running sequences per adapter
        self._idle: collections.OrderedDict[str, None] = collections.OrderedDict()  # resident, unpinned: LRU first
        self._unloaded: set[str] = set()  # unregistered while resident: freed once unpinned
        self.num_loads = 0
        self.num_evictions = 0

    def register(self, info: AdapterInfo) -> None:
        """NameTaken for a name served already, or still finishing requests after its unload."""
        if info.name in self.registry:
            raise NameTaken(f"an adapter named {info.name!r} is loaded already")
        if info.name in self._unloaded:
            raise NameTaken(f"the adapter {info.name!r} was unloaded and still finishes requests; try again shortly")
        self.registry[info.name] = info

    def unregister(self, name: str) -> None:
        """New requests for it are refused from now on; its running sequences finish."""
        del self.registry[name]
        if name in self._slot_of:
            self._unloaded.add(name)
            if not self._pins[name]:
                self._free(name)

    def check(self, name: str) -> None:
        if name not in self.registry:
            raise UnknownAdapter(name)

    @property
    def resident(self) -> list[str]:
        return [name for name in self._slots if name is not None]

    def acquire(self, name: str) -> tuple[int, LoraLoad | None] | None:
        """Pin `name` for one more sequence: (its slot, the load to send when it is not resident
        yet); None when every slot is pinned by other adapters (the sequence waits)."""
        slot = self._slot_of.get(name)
        load = None
        if slot is None:
            if None in self._slots:
                slot = self._slots.index(None)
            elif self._idle:
                victim, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(victim)
                self.num_evictions += 1
            else:
                return None
            self._slots[slot] = name
            self._slot_of[name] = slot
            info = self.registry[name]
            load = LoraLoad(slot, name, info.path)
            self.num_loads += 1
        self._idle.pop(name, None)
        self._pins[name] += 1
        return slot, load

    def pin(self, name: str) -> None:
        """One more sequence on an adapter already pinned (a fork of a running sequence)."""
        self._pins[name] += 1

    def release(self, name: str) -> None:
        """A sequence of `name` stopped running (finished, aborted or preempted)."""
        self._pins[name] -= 1
        if self._pins[name] > 0:
            return
        del self._pins[name]
        if name in self._unloaded:
            self._free(name)
        else:
            self._idle[name] = None

    def _free(self, name: str) -> None:
        slot = self._slot_of.pop(name)
        self._slots[slot] = None
        self._idle.pop(name, None)
        self._unloaded.discard(name)


def adapters_for(config: EngineConfig) -> Adapters | None:
    """The engine's adapters with --lora-modules registered (checked already when the config was
    built); None without --enable-lora."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    adapters = Adapters(lora.max_loras)
    for name, path in lora.modules():
        adapters.register(read_adapter_info(name, path, config.model, lora.max_lora_rank))
    return adapters
