"""Each op of a decode step timed, and the bytes it must move at least: `conveyor bench roofline`'s rows.

`install(runner)` returns a Meter that wraps, until `remove`, what ops/bench/decode_profile.py --ops wraps: the
backend's ops (the quantized and float linears, the norms, rotary, SiLU * up), its attention's
write_kv and attend, the model's embedding lookup, its LM head (compute_greedy: the argmax head
greedy draws take; compute_logits otherwise) and the platform's draw. Only the outermost timed
call counts: an op called inside another (TorchOps.linears calling linear per layer, the head
calling quant_linear) is the outer one's time and bytes, so the labels' times add up to no more
than the step's.

Bytes are the least each call must move, read off the call's own tensors (never constants):
- weights: as stored (a QuantizedWeight's nbytes: codes, scales, mins; a float weight's and
  bias's nbytes; the embedding's looked-up rows only; the head's whole table, tied or not);
- kv: a layer's key and value bytes per token (the backend's bytes_per_block) times the tokens
  written (write_kv) or read (attend: each row's context, its window where it has one);
- other: activations read and written once each, rotary's cos/sin rows, the draw's logits.
The head's row counts the whole product's weights; the cpu argmax kernel (from 2 rows) reads
one plane and a bound table instead, so it can come in under that roofline. Caches are ignored:
a small op's operands sit in L1/L2, so its time can come in under a DRAM roofline too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from conveyor.gpu.quant.weight import QuantizedWeight


@dataclasses.dataclass
class Traffic:
    weights: int = 0
    kv: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.other

    def add(self, more: Traffic) -> None:
        self.weights, self.kv, self.other = self.weights + more.weights, self.kv + more.kv, self.other + more.other


def nbytes(*values: Any) -> int:
    """The bytes of every tensor among values (lists and tuples of them too); others count 0."""
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.nbytes
        elif isinstance(v, (list, tuple)):
            total += nbytes(*v)
    return total


def layer_weight_bytes(layer: Any) -> int:
    """A linear layer's weight as stored (packed where quantized) and its bias."""
    quantized = getattr(layer, "quantized", None)
    weight = quantized.nbytes if isinstance(quantized, QuantizedWeight) else nbytes(layer.weight)
    return weight + nbytes(getattr(layer, "bias", None))


# A label's bytes from its call: (args, kwargs, result) -> Traffic.
Counter = Callable[[tuple, dict, Any], Traffic]


def _linear(args, kwargs, out) -> Traffic:  # ops.linear(x, layer)
    return Traffic(weights=layer_weight_bytes(args[1]), other=nbytes(args[0], out))


def _linears(args, kwargs, out) -> Traffic:  # ops.linears(x, layers): x read once
    return Traffic(weights=sum(layer_weight_bytes(layer) for layer in args[1]), other=nbytes(args[0], out))


def _quant_linear(args, kwargs, out) -> Traffic:  # ops.quant_linear(x, weight, bias)
    return Traffic(weights=args[1].nbytes + nbytes(args[2]), other=nbytes(args[0], out))


def _rms_norm(args, kwargs, out) -> Traffic:  # ops.rms_norm(x, weight, eps)
    return Traffic(weights=nbytes(args[1]), other=nbytes(args[0], out))


def _add_rms_norm(args, kwargs, out) -> Traffic:  # ops.add_rms_norm(x, residual, weight, eps) -> (normed, residual + x)
    return Traffic(weights=nbytes(args[2]), other=nbytes(args[0], args[1], out))


def _rotary(args, kwargs, out) -> Traffic:  # ops.rotary(positions, q, k, cos_sin): q, k read and written
    positions, q, k, cos_sin = args[:4]
    rows = positions.numel() * cos_sin.shape[-1] * cos_sin.element_size()
    return Traffic(other=nbytes(positions) + 2 * nbytes(q, k) + rows)


def _elementwise(args, kwargs, out) -> Traffic:  # ops.silu_mul(gate, up) and its kin
    return Traffic(other=nbytes(args[0], args[1], out))


class Meter:
    """Seconds, calls and Traffic per label, over the steps run while installed; `settle` after
    each step. A timed call costs its wrapper (a closure, two clock reads, a list append), which
    the step's time outside the ops carries: compare the steps with the timers on and off."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.traffic: dict[str, Traffic] = collections.defaultdict(Traffic)
        self._depth = 0
        self._undo: list[Callable[[], None]] = []
        self._pending: list[tuple[str, Counter, tuple, dict, Any]] = []

    def wrap(self, obj: object, name: str, label: str, count: Counter) -> None:
        original = getattr(obj, name)
        own = name in vars(obj)  # an instance attribute (else the class's method shows through again)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self._depth:  # inside another timed op: its time and bytes are that op's
                return original(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                self._depth -= 1
            self.seconds[label] += time.perf_counter() - start
            self._pending.append((label, count, args, kwargs, out))  # counted by settle, after the step
            return out

        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, original) if own else delattr(obj, name))

    def settle(self) -> None:
        """Count the calls made since the last settle: between steps, so the counting is no
        step's time (a call's arguments, the attention metadata among them, are still its step's)."""
        for label, count, args, kwargs, out in self._pending:
            self.calls[label] += 1
            self.traffic[label].add(count(args, kwargs, out))
        self._pending.clear()

    def remove(self) -> None:
        """Every wrapped method back as it was."""
        while self._undo:
            self._undo.pop()()


def install(runner: Any) -> Meter:
    """A Meter over `runner`'s (a ModelRunner's) ops, attention, embedding, head and draw."""
    meter = Meter()
    ops, attn, model = runner.backend.ops, runner.backend.attn, runner.model
    counters: dict[str, Counter] = {
        "quant_linear": _quant_linear,
        "linears": _linears,
        "linear": _linear,
        "rms_norm": _rms_norm,
        "add_rms_norm": _add_rms_norm,
        "rotary": _rotary,
        "silu_mul": _elementwise,
        "gelu_tanh_mul": _elementwise,
    }
    for name, count in counters.items():
        if hasattr(ops, name):
            meter.wrap(ops, name, name, count)
    per_token = attn.bytes_per_block(1) // attn.num_layers  # one layer's key and value of one token

    def write_kv(args, kwargs, out) -> Traffic:  # attn.write_kv(kv_cache, k, v, meta, ...)
        k, v, meta = args[1:4]
        return Traffic(kv=per_token * k.shape[0], other=nbytes(k, v, meta.slot_mapping))

    def attend(args, kwargs, out) -> Traffic:  # attn.attend(q, k, v, kv_cache, meta, scale, ...)
        q, meta = args[0], args[4]
        window = meta.sliding_window
        tokens = sum(n if window is None else min(n, window) for n in meta.host_seq_lens)
        return Traffic(kv=per_token * tokens, other=nbytes(q, out))

    meter.wrap(attn, "write_kv", "attention.write_kv", write_kv)
    meter.wrap(attn, "attend", "attention.attend", attend)
    table = model.model.embed_tokens
    row_bytes = layer_weight_bytes(table) // table.num_embeddings

    def embed(args, kwargs, out) -> Traffic:  # model.embed(input_ids): one table row per token
        return Traffic(weights=row_bytes * args[0].numel(), other=nbytes(args[0], out))

    def head(args, kwargs, out) -> Traffic:  # compute_greedy / compute_logits(hidden): the whole head
        if out is None:  # compute_greedy declined: compute_logits reads the head
            return Traffic()
        return Traffic(weights=layer_weight_bytes(model.lm_head), other=nbytes(args[0], out))

    meter.wrap(model, "embed", "embedding", embed)
    meter.wrap(model, "compute_greedy", "LM head (argmax)", head)
    meter.wrap(model, "compute_logits", "LM head (logits)", head)
    meter.wrap(runner.platform, "draw", "draw", lambda args, kwargs, out: Traffic(other=nbytes(args[0])))
    return meter
