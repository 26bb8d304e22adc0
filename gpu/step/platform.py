"""Platform: what the runner (gpu/step/runner.py) needs of the hardware it runs on, beyond where its
tensors live. One per worker, chosen once from --device (`platform_for`):

    TorchPlatform     CUDA or the CPU, through torch: the model is loaded and computed for real
    EmulatedPlatform  a modelled GPU (gpu/emulated/): no weights, each pass timed by a roofline

Every host-side operation of the runner (plan checks, the persistent batch, input preparation,
result collection) is the same on both; only these differ:
- `backend` / `load_model`: the attention backend (its KV cache in the given dtype) and ops, and
  the model that runs on them;
- `kv_blocks`: how many KV blocks of a given size the device holds;
- `mark` / `host_copy`: points on the device's timeline (the pass clock's busy and idle time)
  and a pass's results on their way to the host, readable once they land;
- `draw`: a pass's draws from its logits (gpu/sampling/draws.py's draw_step, or emulated ids);
- `runs_graphs`: whether decode steps take the CUDA-graph path (captured on CUDA; on the
  emulated device the same host path, replayed without capture); `records_programs`: whether
  they take it as the ops' recorded kernel programs where the ops record (Ops.records: the
  cpu backend on a real CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from conveyor.config.engine import CacheConfig, EngineConfig
from conveyor.config.model import ModelConfig
from conveyor.gpu.backends import Backend, select
from conveyor.gpu.kv.host_tier import HostTier, KVCopies
from conveyor.gpu.kv.kv_cache import num_blocks_for_memory
from conveyor.gpu.sampling.draws import DeviceSamples, SamplingRow, draw_step
from conveyor.gpu.sampling.params_table import DrawParams
from conveyor.gpu.sampling.transfer import HostCopy
from conveyor.gpu.step.host_memory import keep_freed_memory
from conveyor.gpu.step.pass_clock import EventMark, HostMark, Mark
from conveyor.gpu.structured import TokenMask


class ResultCopy(Protocol):
    """A pass's results on their way to the host."""

    def ready(self) -> bool: ...

    def seconds_left(self) -> float | None: ...  # until they land: 0.0 once they have, None if unknown

    def wait(self) -> list[Any]: ...


class Platform(Protocol):
    device: torch.device  # where the runner's tensors live
    runs_graphs: bool
    records_programs: bool

    def backend(self, name: str, model: ModelConfig, kv_dtype: str) -> Backend: ...

    def load_model(self, model: ModelConfig, backend: Backend) -> Any: ...

    def kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int: ...

    def mark(self) -> Mark: ...

    def host_copy(self, tensors: list[torch.Tensor | None]) -> ResultCopy: ...

    def host_tier(self, kv_caches: list[torch.Tensor], num_slots: int, bytes_per_slot: int, pool: torch.Tensor | None) -> KVCopies:
        """The KV host tier's `num_slots` slots (of one block of every layer, `bytes_per_slot`) and
        its copies beside `kv_caches` (gpu/kv/host_tier.py); `pool`: their memory, filled already."""
        ...

    def draw(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        eos_token_ids: tuple[int, ...],
        draw_params: DrawParams | None,
        mask: TokenMask | None,
    ) -> DeviceSamples: ...


@dataclasses.dataclass
class TorchPlatform:
    """A real device: `device` is cuda:N or cpu. `float32_matmul_precision`: torch's setting for
    the process (--float32-matmul-precision; None leaves the process's own)."""

    device: torch.device
    float32_matmul_precision: str | None = None

    def __post_init__(self) -> None:
        if self.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.float32_matmul_precision)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse warm heap pages instead of fresh mmaps
        self.runs_graphs = self.device.type == "cuda"
        self.records_programs = self.device.type == "cpu"

    def backend(self, name: str, model: ModelConfig, kv_dtype: str) -> Backend:
        return select(name, self.device, model, kv_dtype)

    def load_model(self, model: ModelConfig, backend: Backend) -> Any:
        from conveyor.gpu.loading.loader import load_model

        return load_model(model, self.device, backend)

    def kv_blocks(self, bytes_per_block: int, cache: CacheConfig) -> int:
        return num_blocks_for_memory(bytes_per_block, cache, self.device)

    def mark(self) -> Mark:
        return EventMark() if self.device.type == "cuda" else HostMark()

    def host_copy(self, tensors: list[torch.Tensor | None]) -> ResultCopy:
        return HostCopy(tensors)

    def host_tier(self, kv_caches: list[torch.Tensor], num_slots: int, bytes_per_slot: int, pool: torch.Tensor | None) -> KVCopies:
        return HostTier(kv_caches, num_slots, pool=pool)

    def draw(self, logits, rows, eos_token_ids, draw_params, mask) -> DeviceSamples:
        return draw_step(logits, rows, eos_token_ids, draw_params, mask)


def platform_for(config: EngineConfig, device_index: int, num_ranks: int) -> Platform:
    """The platform --device names; on CUDA, the visible device `device_index` takes (modulo their
    number, so the ranks and engines of one machine take one device each, and a process that sees
    only its own device, as Ray hands them out, takes that one). `num_ranks`: the engine's
    tensor-parallel ranks, which an emulated device divides the model over."""
    if config.parallel.device == "emulated":
        from conveyor.gpu.emulated.platform import EmulatedPlatform

        return EmulatedPlatform(config, num_ranks)
    device = torch.device(config.parallel.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", device_index % max(1, torch.cuda.device_count()))
    return TorchPlatform(device, config.parallel.float32_matmul_precision)
