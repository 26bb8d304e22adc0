"""The features of the worker's step, each a StepFeature (base.py) in its own file: lora.py,
speculation.py, prompt_logprobs.py, pooling.py, grammars.py, kv_offload.py, vision.py. `features_for` builds those a
config enables, in the order the core calls their hooks: vision first (a pass through an image
placeholder runs eagerly, which the others' begin_pass must see); LoRA names its rows' slots before the
forward; a drafter's pass follows the target's before other features read its hidden states.
Where two features meet, the meeting is in the core's files, one each: the pass sampler (drafts x
penalties x masks: the rows a pass draws), the advance (forks x drafts: the host's counts after a
pass) and the pass result (a verifying row's run of draws and its matcher); docs/architecture.md
("The step core and its features")."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from conveyor.config.engine import EngineConfig
from conveyor.gpu.backends import Backend
from conveyor.gpu.lora.slots import LoraSlots
from conveyor.gpu.models.multimodal import VisionModel
from conveyor.gpu.parallel.group import TensorParallel
from conveyor.gpu.step.features.base import StepFeature
from conveyor.gpu.step.features.grammars import GrammarStep
from conveyor.gpu.step.features.kv_offload import KvOffloadStep
from conveyor.gpu.step.features.lora import LoraStep
from conveyor.gpu.step.features.pooling import PoolingStep
from conveyor.gpu.step.features.prompt_logprobs import PromptLogprobsStep
from conveyor.gpu.step.features.speculation import SpeculationStep
from conveyor.gpu.step.features.vision import VisionStep
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.platform import Platform
from conveyor.gpu.step.step_inputs import with_metadata

if TYPE_CHECKING:
    from conveyor.gpu.models.base import CausalLM

__all__ = ["StepFeature", "features_for"]


def features_for(
    config: EngineConfig, platform: Platform, batch: PersistentBatch, tp: TensorParallel, model: CausalLM, backend: Backend
) -> list[StepFeature]:
    """The step's features under `config`, in hook order. LoRA's slots are allocated here, before
    the KV pool is sized."""
    features: list[StepFeature] = []
    if config.model.vision is not None:  # first: it may make a pass eager, which LoRA's slots must know
        assert isinstance(model, VisionModel), f"{config.model.architecture} has a vision config but no encode_images"
        window = config.model.sliding_window
        eager = functools.partial(with_metadata, attn=backend.attn, block_size=config.cache.block_size, sliding_window=window)
        features.append(VisionStep(model, platform.device, eager, config.scheduler.max_num_seqs))
    if config.lora.enable_lora:
        features.append(LoraStep(LoraSlots(model, config, backend.ops, tp, platform.device)))
    if config.speculative is not None:
        features.append(SpeculationStep(config, platform, batch, tp, model))
    features.append(PromptLogprobsStep(model.compute_logits))
    if config.model.pooling is not None:
        features.append(PoolingStep(config.model.pooling))
    features.append(GrammarStep(config.model, tp, platform.device))
    if config.cache.kv_offloading_size:
        features.append(KvOffloadStep(config, backend.attn, tp, platform))
    return features
