"""LoRA as the step meets it: --max-loras slots beside the weights (gpu/lora/slots.py), filled by
the plan's adapter loads, each pass's rows naming theirs before the forward; decode graphs read
the slots from a static buffer (`decode_model`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from conveyor.gpu.lora.slots import LoraSlots
from conveyor.gpu.step.features.base import StepFeature

if TYPE_CHECKING:
    from conveyor.gpu.step.cuda_graphs import DecodeModel
    from conveyor.gpu.step.passes import PassWork, WorkerSeq
    from conveyor.wire.step import NewSeq, StepPlan

log = logging.getLogger(__name__)


class LoraStep(StepFeature):
    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots  # allocated before the KV pool is sized: the pool leaves room for them
        lora = slots.config.lora
        size = slots.bytes / 2**20
        log.info("LoRA: %d slots at rank %d hold %.1f MiB beside the weights", lora.max_loras, lora.max_lora_rank, size)

    def decode_model(self, model: DecodeModel) -> DecodeModel:
        return self.slots.graph_model(model)

    def register(self, seq: WorkerSeq, new: NewSeq | None) -> None:
        if new is not None:  # a fork keeps its parent's slot
            seq.lora_slot = new.lora_slot

    def apply(self, plan: StepPlan) -> None:
        for load in plan.lora_loads:
            self.slots.load(load)

    def begin_pass(self, work: PassWork) -> None:
        self.slots.begin_pass([seq.lora_slot for seq in work.rows], work.num_new, graphed=work.inputs.meta is None)
