"""Shipped cost models (`--cost NAME`): one measured, the others derived under stated assumptions,
and the host cost that goes with a device preset (HOST_COSTS).

    cpu-tiny        the embedded tiny Llama through the real ModelRunner on a 2-core CPU host,
                    fitted by `python -m conveyor.sim.measure`
    a100-7b         `roofline` arithmetic for a Llama-2-7B-like model on one A100-80GB
    a100-13b        a100-7b scaled to 13B parameters
    a100-70b-tp4    a100-7b scaled to 69B parameters on 4 GPUs, plus the all-reduces
    h100-llama3-8b  a RooflineCost on devices.py's h100 row, paired with vLLM 0.5's host cost

Invariants: every figure here is either fitted (cpu-tiny) or computed from the arithmetic written
next to it (docs/simulator.md, "The cost model", walks through cpu-tiny and a100-7b), never a GPU
measurement; a preset absent from HOST_COSTS folds its host work into its per-pass intercept, so its host cost
is zero. `--cost` (cost_model) finds a preset only through PRESETS.
"""

from __future__ import annotations

from conveyor.gpu.emulated.costmodel import CostModel, PassCost
from conveyor.gpu.emulated.devices import DEVICES
from conveyor.gpu.emulated.roofline import RooflineCost
from conveyor.sim.hostcost import HostCost

# Fitted by `python -m conveyor.sim.measure`: the minimum of 14 repeats per grid point (two runs of
# --repeats 7; one thread; the runner as of commit 51fe2c0). RMS relative error 8% over the grid
# (docs/simulator.md has the table). Reading: a one-token pass costs 3.5 ms of dispatch, each
# token 75 us, each row 52 us of host work, each cached token a decode reads 1.8 us (the
# reference attention gathers the KV), each query-key pair 75 ns.
CPU_TINY = CostModel(
    intercept_s=2.44e-3,
    per_token_s=75.0e-6,
    per_seq_s=52.5e-6,
    per_context_s=1.80e-6,
    per_pair_s=75.0e-9,
    floor_s=3.54e-3,
    name="cpu-tiny",
)


def roofline(
    params: float,
    *,
    peak_flops: float,
    mfu: float,
    mem_bw: float,
    bw_util: float,
    kv_bytes_per_token: float,
    pair_flops: float,
    launch_s: float,
    per_seq_s: float,
    name: str,
    weight_bytes_per_param: float = 2.0,
) -> CostModel:
    """A cost model from hardware numbers: compute at `mfu` of peak, memory at `bw_util` of peak."""
    flops, bw = peak_flops * mfu, mem_bw * bw_util
    return CostModel(
        intercept_s=launch_s,
        per_token_s=2.0 * params / flops,
        per_seq_s=per_seq_s,
        per_context_s=kv_bytes_per_token / bw,
        per_pair_s=pair_flops / flops,
        floor_s=launch_s + params * weight_bytes_per_param / bw,
        name=name,
    )


A100_7B = roofline(
    6.74e9,
    peak_flops=312e12,
    mfu=0.6,
    mem_bw=2.0e12,
    bw_util=0.8,
    kv_bytes_per_token=2 * 32 * 4096 * 2,
    pair_flops=4 * 4096 * 32,
    launch_s=1.5e-3,
    per_seq_s=20e-6,
    name="a100-7b",
)
A100_13B = A100_7B.scaled(13.0 / 6.74, floor_factor=13.0 / 6.74, name="a100-13b")
A100_70B_TP4 = A100_7B.scaled(69.0 / 6.74, 4, floor_factor=69.0 / 6.74 / 4, comm_s=0.5e-3, name="a100-70b-tp4")

# Llama-3-8B, bf16, one H100 SXM (80 GB HBM3): its row of devices.py (the emulated device's too).
# ESTIMATES, not measurements. Per pass: 0.4 ms + max(memory, compute).
#   weights    8.03e9 params x 2 bytes = 16.06e9 bytes, read once per pass
#   KV         2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131072 bytes per cached token
#   memory     HBM3 3.35e12 B/s at 80% achievable = 2.68e12 B/s:
#              weights 16.06e9 / 2.68e12 = 5.99 ms per pass; KV 131072 / 2.68e12 = 48.9 ns per token read
#   compute    989e12 FLOP/s dense bf16 at 60% achievable = 593.4e12 FLOP/s:
#              2 x 8.03e9 = 16.06e9 FLOPs per token -> 27.1 us per token; attention
#              4 x 128 x 32 query heads x 32 layers = 524288 FLOPs per query-key pair -> 0.88 ns
#   launch     0.4 ms: CUDA graphs assumed (the RFC's runs used them), ~32 layers x ~12 kernels at
#              ~1 us of gap each
# So a decode of 256 rows at 512 cached tokens each: memory (16.06e9 + 131072 x 256 x 513) / 2.68e12
# = 12.4 ms against compute (16.06e9 x 256 + 524288 x 256 x 513) / 593.4e12 = 7.0 ms: memory-bound,
# 12.8 ms with the launch floor. With no KV the knee is 5.99 ms / 27.1 us = 221 tokens per pass.
H100_LLAMA3_8B = RooflineCost.on(
    DEVICES["h100"],
    params=8.03e9,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    pair_flops=4 * 128 * 32 * 32,
    name="h100-llama3-8b",
)

# vLLM before multi-step (v0.5, synchronous) on that setup. The multi-step RFC (the seed document
# behind issue 16) profiles Llama-3-8B on one H100: "about 4ms of GPU bubble" per decode in the
# baseline, and "5-13ms of GPU bubble" overall. Assumed here: 4 ms per plan, plus 35 us per row,
# reading the 13 ms upper end as a full batch of 256 rows ((13 - 4) / 256 = 35 us). The v0.6 blog's
# profile of the same setup (scheduling 29% of the time against 38% on the GPU) is of the same order.
VLLM_V05_HOST = HostCost(per_plan_s=4e-3, per_row_s=35e-6, name="vllm-0.5")

PRESETS: dict[str, PassCost] = {m.name: m for m in (CPU_TINY, A100_7B, A100_13B, A100_70B_TP4, H100_LLAMA3_8B)}
# Device preset -> its host cost. The others' per-pass intercepts already hold their host work (zero).
HOST_COSTS: dict[str, HostCost] = {H100_LLAMA3_8B.name: VLLM_V05_HOST}


def cost_model(name: str) -> PassCost:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r}; choose one of {', '.join(PRESETS)}") from None
