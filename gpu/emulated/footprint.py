"""What a model costs an emulated device, from its config alone: the roofline of its passes and
the bytes its weights take.

Parameters are counted on the model built on the meta device (gpu/models: each family's exact
shapes, a tied LM head once, no memory taken). Each token computes with all of them, except a
mixture of experts' routed experts, of which it uses top_k of num_experts. Per cached token the
KV takes 2 x layers x KV heads x head_dim x the dtype's bytes (the model's, or one byte a value
with --kv-cache-dtype fp8: `pass_cost`'s kv_dtype); per query-key pair attention does
4 x head_dim x query heads x layers FLOPs (QK^T and PV). Tensor parallelism splits all three
evenly over the ranks and adds two all-reduces of the hidden state per layer (attention's and
the MLP's), T x hidden x dtype bytes each.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from conveyor.config.model import ModelConfig
from conveyor.gpu.emulated.devices import DeviceSpec
from conveyor.gpu.emulated.roofline import RooflineCost


@dataclasses.dataclass(frozen=True)
class Footprint:
    params: int
    active_params: int  # what one token computes with
    dtype_bytes: int
    kv_bytes_per_token: int
    pair_flops: int
    num_layers: int
    hidden_size: int

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


@functools.cache
def footprint(config: ModelConfig) -> Footprint:
    from conveyor.gpu.models import build_model  # the model classes: torch, but no weights

    with torch.device("meta"):
        model = build_model(config)
    params = experts = 0
    for name, p in model.named_parameters():
        params += p.numel()
        if ".experts." in name:
            experts += p.numel()
    active = params
    if experts and config.moe is not None:
        active = params - experts + experts * config.moe.top_k // config.moe.num_experts
    dtype_bytes = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    return Footprint(
        params=params,
        active_params=active,
        dtype_bytes=dtype_bytes,
        kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes,
        pair_flops=4 * config.head_dim * config.num_heads * config.num_layers,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
    )


def pass_cost(config: ModelConfig, device: DeviceSpec, ranks: int = 1, kv_dtype: str | None = None) -> RooflineCost:
    """The roofline of one pass of `config` on `device`, split over `ranks` of them, its KV cache
    read in `kv_dtype` (a torch dtype name; None: the model's)."""
    f = footprint(config)
    kv_bytes = f.kv_bytes_per_token // f.dtype_bytes * getattr(torch, kv_dtype or config.dtype).itemsize
    return RooflineCost.on(
        device,
        params=f.params,
        kv_bytes_per_token=kv_bytes,
        pair_flops=f.pair_flops,
        name=f"emulated-{device.name}",
        weight_bytes_per_param=f.dtype_bytes,
        active_params=f.active_params if f.active_params != f.params else None,
        ranks=ranks,
        allreduces_per_pass=2 * f.num_layers,
        allreduce_bytes_per_token=f.hidden_size * f.dtype_bytes,
    )
