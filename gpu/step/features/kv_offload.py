"""The KV host tier as the step meets it (a StepFeature, --kv-offloading-size): the plan's saves
(device blocks to host slots) and loads (host slots to device blocks) applied before its passes,
saves first, by gpu/kv/host_tier.py. The scheduler decides what moves
(stages/scheduler/kv_tiers.py); this moves the bytes.

Ordering, on CUDA where the copies run on a side stream behind the passes queued before them: a
plan's saves read blocks its passes may rewrite (a freed block handed out again), so its first
pass waits for them; its loads fill blocks no row of it reads (the scheduler holds them for the
next plan), so the next plan's first pass waits for them, and the copy overlaps this plan's
passes. On a CPU every copy is done when the call returns.

The emulated device keeps no KV bytes: there the tier moves nothing (its transfer time is not
modelled yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.gpu.kv.host_tier import HostTier, KVTransfer, num_host_slots
from conveyor.gpu.step.features.base import StepFeature

if TYPE_CHECKING:
    import torch

    from conveyor.gpu.step.passes import PassWork
    from conveyor.wire.messages import StepPlan


class KvOffloadStep(StepFeature):
    def __init__(self, gib: float, bytes_per_block: int) -> None:
        self.num_slots = num_host_slots(gib, bytes_per_block)
        self.host: HostTier | None = None
        self._before_pass: list[KVTransfer] = []  # what the next pass must wait for
        self._next_plan: list[KVTransfer] = []  # this plan's loads: the next plan's first pass waits
        self.num_saved = 0  # blocks copied each way (by this rank)
        self.num_loaded = 0

    def allocate(self, num_blocks: int, kv_caches: list[torch.Tensor]) -> None:
        if self.num_slots and kv_caches and kv_caches[0][0, 0].numel():  # the emulated device's caches are empty
            self.host = HostTier(kv_caches, self.num_slots)

    def apply(self, plan: StepPlan) -> None:
        self._before_pass += self._next_plan
        self._next_plan = []
        if self.host is None:
            return
        if plan.kv_saves:
            blocks, slots = zip(*plan.kv_saves)
            self._before_pass.append(self.host.save(blocks, slots))
            self.num_saved += len(blocks)
        if plan.kv_loads:
            slots, blocks = zip(*plan.kv_loads)
            self._next_plan.append(self.host.load(slots, blocks))
            self.num_loaded += len(blocks)

    def begin_pass(self, work: PassWork) -> None:
        for transfer in self._before_pass:
            transfer.wait_on_stream()
        self._before_pass = []
