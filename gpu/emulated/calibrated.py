"""A forward pass's time on a GPU from kernel times measured on it (calibrate.py's table), and the
host CPU a GPU host spends launching it: the emulated device's cost (`--emulate-cost table`).

For a pass of T tokens over S rows reading C KV entries with P query-key pairs, on L layers:

    device = L x (dense(T) + attention(C, P)) + once(S)
    dense(T)        = layer_products(T) x in_situ(T)
    attention(C, P) = a + b C + (P - C) x 4 head_dim heads / (peak x MFU)
    once(S)         = c + d S                        (LM head, sampling, embedding: per step)
    host (eager)    = L x (e + f S)                  (torch's Python and launches, per layer)

layer_products: the seven products of one layer timed alone (interpolated in T; past the last
point scaled by their roofline from it). The step profiles (64 and 256 rows, 128-token prompts)
give the rest exactly at their two shapes: a layer's in-step time less its attention over the
products alone is in_situ (L2 and launch gaps differ inside a step), attention is linear in C
through both, `once` is the step less L layers (the profile's own split of per-layer kernels
from per-step ones), and the eager host is the wall of an eager step less a graphed one's per
layer. Between the two shapes each is linear; outside it is extrapolated linearly (in_situ held).
Two terms are no measurement: a prompt's attention pairs beyond a decode's (P - C; 0 for
decodes) at the roofline's MFU, and the host CPU of a graph replay (none: not yet measured).

The table's model only (`model` of the table): another shape, tensor parallelism or an fp8 KV
cache is not in it, and `for_model` returns None (the emulated device then says it uses the
roofline). A reproduced shape gives its measured time: tests/scheduler/test_calibrated_cost.py.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from conveyor.gpu.emulated.costmodel import StepShape
from conveyor.gpu.emulated.devices import MFU, DeviceSpec

TABLES = Path(__file__).resolve().parent / "calibration"  # one table per device, written by conveyor/sim/calibrate.py

US = 1e-6


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, extended linearly past both ends."""
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def load_table(kind: str, tables: Path = TABLES) -> dict | None:
    path = tables / f"{kind}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@dataclasses.dataclass(frozen=True)
class CalibratedCost:
    """A PassCost (costmodel.py) from a device's table; `host_seconds` is the host's side."""

    name: str
    num_layers: int
    layer_points: tuple[tuple[float, float], ...]  # (tokens, us): the seven products alone
    layer_flops_per_token: float  # 2 x the layer's weights: to scale layer_points past its last point
    layer_bytes: float  # the layer's weights, read once a pass
    in_situ: tuple[tuple[float, float], ...]  # (tokens, in-step / alone), at the profiles' rows
    attention_us: tuple[float, float]  # a, b: per layer, a + b x KV entries read
    once_us: tuple[float, float]  # c, d: per step, c + d x rows
    eager_host_us: tuple[float, float]  # e, f: per layer, e + f x rows
    pair_seconds: float  # one prompt pair's attention beyond a decode's, a layer (roofline, MFU)
    peak_flops: float
    mem_bw: float

    @classmethod
    def from_table(cls, table: dict, device: DeviceSpec, num_layers: int) -> CalibratedCost:
        model = table["model"]
        hidden, inter = model["hidden_size"], model["intermediate_size"]
        heads, kv_heads, head_dim = model["num_heads"], model["num_kv_heads"], model["head_dim"]
        weights = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter  # q, o; k, v; gate, up, down
        layer_points = tuple((float(t), float(us)) for t, us in table["layer_products"]["points"])
        graphed = sorted((s for s in table["decode_steps"] if s["mode"] == "CUDA graphs"), key=lambda s: s["rows"])
        eager = {s["rows"]: s for s in table["decode_steps"] if s["mode"] == "eager"}
        in_situ, attention, once, host = [], [], [], []
        for s in graphed:
            rows, layers, context = s["rows"], s["layers"], s["rows"] * s["context_per_row"]
            # The profile's split: kernels launched every layer scaled by model_layers / layers, the rest once.
            per_layer = (s["estimate_32_layers_us"] - s["device_us_per_step"]) / (s["model_layers"] / layers - 1) / layers
            attn = s["by_class_us"]["attention"] / layers
            in_situ.append((float(rows), (per_layer - attn) / interpolate(layer_points, rows)))
            attention.append((context, attn))
            once.append((float(rows), s["device_us_per_step"] - layers * per_layer))
            if rows in eager:
                host.append((float(rows), 1e3 * (eager[rows]["wall_ms_p50"] - s["wall_ms_p50"]) / layers))
        return cls(
            name=f"calibrated-{device.name}",
            num_layers=num_layers,
            layer_points=layer_points,
            layer_flops_per_token=2.0 * weights,
            layer_bytes=2.0 * weights,  # bf16
            in_situ=tuple(in_situ),
            attention_us=_line(attention),
            once_us=_line(once),
            eager_host_us=_line(host),
            pair_seconds=4.0 * head_dim * heads / (device.peak_flops * MFU),
            peak_flops=device.peak_flops,
            mem_bw=device.mem_bw,
        )

    def dense_us(self, tokens: int) -> float:
        """One layer's products and the kernels between them, in a step of `tokens`."""
        last_t, last_us = self.layer_points[-1]
        if tokens <= last_t:
            alone = interpolate(self.layer_points, tokens)
        else:  # past the table: its last point's efficiency, on the roofline's growth
            alone = last_us * self._roofline(tokens) / self._roofline(last_t)
        (t0, first), (t1, last) = self.in_situ[0], self.in_situ[-1]  # held outside the profiled rows
        factor = first if tokens <= t0 else last if tokens >= t1 else interpolate(self.in_situ, tokens)
        return alone * factor

    def _roofline(self, tokens: float) -> float:
        return max(self.layer_bytes / self.mem_bw, self.layer_flops_per_token * tokens / self.peak_flops)

    def latency(self, shape: StepShape) -> float:
        """Seconds of device time for one pass; an empty pass costs nothing."""
        if shape.num_tokens == 0:
            return 0.0
        a, b = self.attention_us
        c, d = self.once_us
        attention_us = a + b * shape.context_tokens
        prompt_pairs = max(0, shape.attention_pairs - shape.context_tokens)  # 0 for a decode row: P = C
        per_layer = US * (self.dense_us(shape.num_tokens) + attention_us) + prompt_pairs * self.pair_seconds
        return self.num_layers * per_layer + US * (c + d * shape.num_seqs)

    def host_seconds(self, shape: StepShape, graphed: bool) -> float:
        """The host CPU a GPU host spends launching the pass beyond the host code that runs here:
        an eager forward's per-layer Python and launches; a graph replay's is not measured (0)."""
        if graphed or shape.num_tokens == 0:
            return 0.0
        e, f = self.eager_host_us
        return US * self.num_layers * (e + f * shape.num_seqs)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) through two points, or flat through one."""
    if len(points) == 1:
        return points[0][1], 0.0
    (x0, y0), (x1, y1) = points[0], points[-1]
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


def for_model(table: dict | None, device: DeviceSpec, config, ranks: int = 1, kv_dtype: str | None = None) -> CalibratedCost | None:
    """The table's cost for `config` (a ModelConfig), or None where the table cannot say: no
    table, another model shape, tensor parallelism, a KV cache in another dtype."""
    if table is None or ranks != 1:
        return None
    model = table["model"]
    found = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "dtype": config.dtype,
    }
    if any(model[k] != v for k, v in found.items()) or (kv_dtype or config.dtype) != config.dtype or config.moe is not None:
        return None
    return CalibratedCost.from_table(table, device, config.num_layers)
