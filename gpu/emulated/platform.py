"""EmulatedPlatform: a GPU from the device table (gpu/emulated/devices.py), modelled, in place of
a real one (gpu/step/platform.py has the seam).

Runs for real: everything on the host, the runner's whole CUDA-graph path included. Emulated:
the device's work, and the CPU a GPU host's driver spends beside that host code. Each pass is
queued on a virtual stream (stream.py) for its time on this device: from the device's calibration
table of kernel times measured on it (gpu/emulated/calibrated.py; with it the eager forwards' host
time and CUDA's spin-waits, counted in conveyor_worker_emulated_host_cpu_seconds), or from the
roofline (footprint.py) where the table has not the model's shapes or `--emulate-cost roofline`
asks; the start-up log says which. Its ids are drawn on the host (draws.py) but readable only
once the stream reaches the pass's end, as a CUDA copy behind an event would land. Tensors live
in host memory; no weights are loaded and no KV is held.

KV capacity is the real device's: gpu_memory_utilization of its memory, less the weights (the
rank's share with tensor parallelism) and an ASSUMED activation peak, which stands for the
profile run a CUDA worker makes: the token budget's hidden states (6 x hidden + 3 x the rank's
intermediate size per token, in the model dtype), three float32 copies of the logits of the
most rows a step samples, and 512 MiB for the CUDA context and libraries' workspaces.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from conveyor.config.engine import CacheConfig, EngineConfig
from conveyor.config.errors import ConfigError
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends import Backend
from conveyor.gpu.backends.torch import TorchOps
from conveyor.gpu.emulated.calibrated import for_model, load_table
from conveyor.gpu.emulated.costmodel import PassCost
from conveyor.gpu.emulated.devices import DEVICES, MIB
from conveyor.gpu.emulated.draws import EmulatedDraws
from conveyor.gpu.emulated.footprint import footprint, pass_cost
from conveyor.gpu.emulated.host_link import EmulatedHostLink
from conveyor.gpu.emulated.model import EmulatedAttention, EmulatedModel
from conveyor.gpu.emulated.stream import VirtualCopy, VirtualEvent, VirtualStream
from conveyor.gpu.sampling.draws import DeviceSamples
from conveyor.stages import metrics

log = logging.getLogger(__name__)

CONTEXT_BYTES = 512 * MIB


class EmulatedPlatform:
    runs_graphs = True
    records_programs = False

    def __init__(self, config: EngineConfig, num_ranks: int) -> None:
        assert config.parallel.emulate is not None
        self.config, self.num_ranks = config, num_ranks
        self.spec = DEVICES[config.parallel.emulate]
        self.device = torch.device("cpu")
        self.stream = VirtualStream()
        kv_dtype = config.cache.kv_dtype(config.model.dtype)
        self.cost: PassCost = pass_cost(config.model, self.spec, num_ranks, kv_dtype)
        table = None if config.parallel.emulate_cost == "roofline" else load_table(self.spec.name)
        calibrated = for_model(table, self.spec, config.model, num_ranks, kv_dtype)
        if calibrated is not None:
            self.cost = calibrated
            self.stream.spin_waits = True  # CUDA's default wait on a host with more cores than GPUs
            self.stream.on_modelled_cpu = lambda seconds: metrics.worker_emulated_host_cpu.inc(seconds)
            source = f"the calibration table gpu/emulated/calibration/{self.spec.name}.json (kernel times measured on the device)"
        elif table is not None:
            source = f"roofline: {self.spec.name}'s calibration table has no entries for this model's shapes"
        else:
            asked = config.parallel.emulate_cost == "roofline"
            source = "roofline" + ("" if asked else f": no calibration table for {self.spec.name}")
        self.draws = EmulatedDraws(ordinary_ids(config.model), config.model.vocab_size)
        torch.set_num_threads(1)  # host tensors of a few hundred ids: threads would only contend
        log.warning(
            "EMULATED device: %s%s, modelled, not measured: pass times from %s (gpu/emulated/devices.py: %.0f TFLOP/s, "
            "%.2f TB/s); no weights loaded; every device time and figure is emulated",
            self.spec.name,
            f" x {num_ranks} (tensor parallel)" if num_ranks > 1 else "",
            source,
            self.spec.peak_flops / 1e12,
            self.spec.mem_bw / 1e12,
        )

    def backend(self, name: str, model: ModelConfig, kv_dtype: str) -> Backend:
        description = f"emulated {self.spec.name} (the CUDA-graph host path; device time from {self.cost.name}, no kernels)"
        return Backend("emulated", EmulatedAttention(model, self.device, kv_dtype), TorchOps(), description)

    def load_model(self, model: ModelConfig, backend: Backend) -> EmulatedModel:
        return EmulatedModel(self.cost, self.stream)

    def kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int:
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        model, sched = self.config.model, self.config.scheduler
        weights = footprint(model).weight_bytes / self.num_ranks
        dtype_bytes = footprint(model).dtype_bytes
        tokens = sched.max_num_batched_tokens
        activations = tokens * (6 * model.hidden_size + 3 * model.intermediate_size // self.num_ranks) * dtype_bytes
        logits = 3 * min(sched.max_num_seqs, tokens) * model.vocab_size * 4
        budget = cache.gpu_memory_utilization * self.spec.memory_bytes - weights - activations - logits - CONTEXT_BYTES
        num_blocks = int(budget // bytes_per_block)
        log.info(
            "emulated %s memory: %.1f GiB, weights %.2f GiB, activations %.2f GiB (assumed): %d KV blocks",
            self.spec.name,
            self.spec.memory_bytes / 2**30,
            weights / 2**30,
            (activations + logits + CONTEXT_BYTES) / 2**30,
            max(0, num_blocks),
        )
        if num_blocks < 1:
            raise ConfigError(
                f"the model does not fit an emulated {self.spec.name}: {weights / 2**30:.1f} GiB of weights per device "
                f"leave no memory for the KV cache (try --tensor-parallel-size)"
            )
        return num_blocks

    def mark(self) -> VirtualEvent:
        return self.stream.record()

    def host_copy(self, tensors: list) -> VirtualCopy:
        return VirtualCopy(tensors, self.stream.record())

    def host_tier(
        self, kv_caches: list[torch.Tensor], num_slots: int, bytes_per_slot: int, pool: torch.Tensor | None
    ) -> EmulatedHostLink:
        """No KV bytes: the copies are time on the host link (host_link.py)."""
        return EmulatedHostLink(self.stream, num_slots, bytes_per_slot, self.spec.host_bw)

    def draw(self, logits, rows, eos_token_ids, draw_params, mask) -> DeviceSamples:
        return self.draws(logits, rows, eos_token_ids, draw_params, mask)


def ordinary_ids(model: ModelConfig) -> np.ndarray:
    """The tokenizer's ids that are not special tokens nor EOS, below the model's vocab_size."""
    from tokenizers import Tokenizer

    path = Path(model.path) / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises its own Exception type
        raise ConfigError(f"cannot read {path}: {e}") from None
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special} | set(model.eos_token_ids)
    size = min(tokenizer.get_vocab_size(with_added_tokens=True), model.vocab_size)
    return np.array([i for i in range(size) if i not in special], dtype=np.int64)
