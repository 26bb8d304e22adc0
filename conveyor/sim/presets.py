"""Shipped cost models: one measured ("cpu-tiny"), the others derived under stated assumptions.

cpu-tiny   the embedded tiny Llama (4 layers, hidden 256) through the real ModelRunner on this
           project's 2-core CPU host, float32, torch's reference attention, one thread; fitted
           by `python -m conveyor.sim.measure` (relative least squares, see below).
a100-7b    illustrative: a Llama-2-7B-like model on one A100-80GB, from roofline arithmetic, not
           a measurement. Compute: 2 FLOPs per parameter per token at 60% of 312 TFLOP/s bf16.
           Floor: the 13.5 GB of weights read once per pass at 80% of 2.0 TB/s, plus 1.5 ms of
           launches and host work (also the intercept). KV read: 0.5 MiB per context token
           (2 x 32 layers x 4096 x 2 bytes) at the same bandwidth. Attention arithmetic:
           4 x 4096 x 32 FLOPs per query-key pair at the same 60%. Per row: 20 us of host work.
a100-13b   a100-7b.scaled(13/6.74): compute and the weight-read floor grow with the parameters.
a100-70b-tp4  a100-7b.scaled(69/6.74, gpus=4): split over 4 GPUs by tensor parallelism, plus
           0.5 ms of all-reduces per pass (GQA's smaller KV is ignored: the KV terms are high).
h100-llama3-8b  Llama-3-8B in bf16 on one H100 SXM, a RooflineCost (roofline.py) on the h100 row
           of devices.py (the emulated device's too): ESTIMATES, not measurements; the
           arithmetic is written out at H100_LLAMA3_8B below. Paired with
           the host cost of vLLM before multi-step (VLLM_V05_HOST) in HOST_COSTS.
The cpu-tiny numbers do not scale to a GPU by a factor: on the CPU the intercept is Python and
dispatch overhead, and there is no weight-read floor, so the GPU presets start from a roofline.
Every preset but h100-llama3-8b folds host work into its per-pass cost: their host cost is zero.
"""

from __future__ import annotations

from conveyor.sim.costmodel import CostModel, PassCost
from conveyor.sim.devices import DEVICES
from conveyor.sim.hostcost import HostCost
from conveyor.sim.roofline import RooflineCost

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
    6.74e9, peak_flops=312e12, mfu=0.6, mem_bw=2.0e12, bw_util=0.8,
    kv_bytes_per_token=2 * 32 * 4096 * 2, pair_flops=4 * 4096 * 32,
    launch_s=1.5e-3, per_seq_s=20e-6, name="a100-7b",
)  # fmt: skip
A100_13B = A100_7B.scaled(13.0 / 6.74, floor_factor=13.0 / 6.74, name="a100-13b")
A100_70B_TP4 = A100_7B.scaled(69.0 / 6.74, 4, floor_factor=69.0 / 6.74 / 4, comm_s=0.5e-3, name="a100-70b-tp4")

# Llama-3-8B, bf16, one H100 SXM (80 GB HBM3): its row of devices.py. Per pass: 0.4 ms + max(memory, compute).
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
    DEVICES["h100"], params=8.03e9, kv_bytes_per_token=2 * 32 * 8 * 128 * 2, pair_flops=4 * 128 * 32 * 32, name="h100-llama3-8b",
)  # fmt: skip

# vLLM before multi-step (v0.5, synchronous) on that setup. The multi-step RFC (the seed document
# behind issue 16) profiles Llama-3-8B on one H100: "about 4ms of GPU bubble" per decode in the
# baseline, and "5-13ms of GPU bubble" overall. Assumed here: 4 ms per plan, plus 35 us per row,
# reading the 13 ms upper end as a full batch of 256 rows ((13 - 4) / 256 = 35 us). The v0.6 blog's
# profile of the same setup (scheduling 29% of the time against 38% on the GPU) is of the same order.
VLLM_V05_HOST = HostCost(per_plan_s=4e-3, per_row_s=35e-6, name="vllm-0.5")

PRESETS: dict[str, PassCost] = {m.name: m for m in (CPU_TINY, A100_7B, A100_13B, A100_70B_TP4, H100_LLAMA3_8B)}
HOST_COSTS: dict[str, HostCost] = {H100_LLAMA3_8B.name: VLLM_V05_HOST}  # device preset -> its host; else zero


def cost_model(name: str) -> PassCost:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cost model {name!r}; choose one of {', '.join(PRESETS)}") from None
