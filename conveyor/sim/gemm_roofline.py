"""One linear layer's roofline, quantized or not: `python -m conveyor.sim.gemm_roofline` prints
docs/benchmarks.md's issue-29 tables (ESTIMATES), and ops/gpu/kernel_bench.py sets each measured
time beside its estimate.

A product y [M, N] = x [M, K] @ W^T streams the weight once whatever M is (its codes, and a
scale and a min per group of G inputs), reads x and writes y; it does 2 M N K FLOPs:

    bytes     = N K bits / 8 + N (K / G) (scale + min bytes) + M K x_bytes + M N y_bytes
    time      = max(bytes / mem_bw, 2 M N K / peak)        (the ideal: 100% of both peaks)

peak is the device's dense bf16 FLOP/s for weight-only formats (their codes are widened to x's
dtype before the tensor cores) and its FP8 FLOP/s for W8A8, whose activations are quantized per
token first: one more pass that reads x and writes it in FP8 (3 M K bytes) before the GEMM reads
it in FP8 (M K). The device's row comes from devices.py (the datasheet's peaks). What this leaves
out, and a measurement must show: launches (a few us each without CUDA graphs, about 1 us of gap
with them), the split-K partials (S M N 4 bytes, written then read), L2 hits, and the
dequantization's own work on the CUDA cores, which this assumes hides under the memory stream.
"""

from __future__ import annotations

import argparse
import dataclasses

from conveyor.gpu.emulated.devices import BW_UTIL, DEVICES, DeviceSpec


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int  # per weight, the codes alone
    group: int | None  # inputs sharing a scale (and a min); None: one per output row
    scale_bytes: int  # per group, the scale and the min together
    fp8_activations: bool = False  # W8A8: the GEMM runs on FP8 tensor cores

    def weight_bytes(self, n: int, k: int) -> float:
        groups = 1 if self.group is None else k // self.group
        return n * k * self.bits / 8 + n * groups * self.scale_bytes


# The scales and mins in float16, as the Triton kernel reads them for a 16-bit model.
FORMATS = {
    f.name: f
    for f in (
        WeightFormat("bf16", 16, None, 0),
        WeightFormat("W8A16 g128", 8, 128, 4),
        WeightFormat("W4A16 g128", 4, 128, 4),
        WeightFormat("W8A16 g32", 8, 32, 2),  # GGUF Q8_0's layout: an fp16 scale per 32, no min
        WeightFormat("W4A16 g32", 4, 32, 4),  # GGUF Q4_1's layout: an fp16 scale and min per 32
        WeightFormat("FP8 W8A8", 8, None, 4, fp8_activations=True),  # a float32 scale per channel
    )
}

# (N, K) of each product in a decoder layer (q, k, v and gate, up as the fused GEMMs they could
# be: the same bytes, fewer launches), the layer count, and the LM head left in bf16 (as AWQ,
# GPTQ and --quantization leave it).
MODELS = {
    "Llama-3-8B": (((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)), 32, (128256, 4096)),
    "SmolLM2-135M": (((960, 576), (576, 576), (3072, 576), (576, 1536)), 30, (49152, 576)),
}
ROWS = (1, 16, 64)


@dataclasses.dataclass(frozen=True)
class Estimate:
    num_bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def estimate(device: DeviceSpec, fmt: WeightFormat, m: int, n: int, k: int, x_bytes: int = 2) -> Estimate:
    """One product's roofline on `device`, activations of x_bytes (bf16: 2)."""
    activations = m * k * (x_bytes + 1 + 1) if fmt.fp8_activations else m * k * x_bytes
    num_bytes = fmt.weight_bytes(n, k) + activations + m * n * x_bytes
    flops = 2.0 * m * n * k
    peak = device.peak_fp8_flops if fmt.fp8_activations else device.peak_flops
    return Estimate(num_bytes, flops, num_bytes / device.mem_bw, flops / peak)


def fits(fmt: WeightFormat, k: int) -> bool:
    return fmt.group is None or k % fmt.group == 0


def decode_tables(device: DeviceSpec) -> str:
    """Markdown: per model and format, one decode step's linear layers at M = 1, 16, 64."""
    lines = []
    for model, (shapes, layers, head) in MODELS.items():
        lines += [
            f"| {model}, {device.name}, all linear layers of a step | MB at M = 1 | " + " | ".join(f"M = {m}" for m in ROWS) + " |",
            "|---|---:|" + "---:|" * len(ROWS),
        ]
        for fmt in FORMATS.values():
            if not all(fits(fmt, k) for _, k in shapes):
                continue
            cells, mb = [], 0.0
            for m in ROWS:
                parts = [estimate(device, fmt, m, n, k) for n, k in shapes]
                head_part = estimate(device, FORMATS["bf16"], m, *head)
                seconds = layers * sum(p.seconds for p in parts) + head_part.seconds
                compute = sum(p.bound == "compute" for p in parts)
                mb = (layers * sum(p.num_bytes for p in parts) + head_part.num_bytes) / 1e6 if m == 1 else mb
                cells.append(f"{seconds * 1e6:,.0f} us" + (f" ({compute} of 4 compute-bound)" if compute else ""))
            lines.append(f"| {fmt.name} | {mb:,.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def layer_table(device: DeviceSpec, n: int, k: int) -> str:
    """Markdown: one product, every format, at M = 1, 16, 64: bytes, FLOPs, both times."""
    lines = [
        f"| N = {n}, K = {k}, {device.name} | M | MB | GFLOP | memory us | compute us | bound |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for fmt in FORMATS.values():
        if not fits(fmt, k):
            continue
        for m in ROWS:
            e = estimate(device, fmt, m, n, k)
            lines.append(
                f"| {fmt.name} | {m} | {e.num_bytes / 1e6:.2f} | {e.flops / 1e9:.2f} | {e.memory_s * 1e6:.2f} | "
                f"{e.compute_s * 1e6:.2f} | {e.bound} |"
            )
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m conveyor.sim.gemm_roofline", description="Quantized GEMM roofline estimates.")
    p.add_argument("--device", default="h100", choices=[name for name, d in DEVICES.items() if d.peak_fp8_flops])
    device = DEVICES[p.parse_args(argv).device]
    print(f"ESTIMATES: {device.name}, {device.mem_bw / 1e12:.2f} TB/s, {device.peak_flops / 1e12:.0f} TFLOP/s bf16, ", end="")
    print(f"{device.peak_fp8_flops / 1e12:.0f} FP8 (dense); 100% of each (devices.py plans with {BW_UTIL:.0%} of the bandwidth)\n")
    print(layer_table(device, 4096, 4096))
    print(layer_table(device, 28672, 4096))
    print(decode_tables(device))


if __name__ == "__main__":
    main()
