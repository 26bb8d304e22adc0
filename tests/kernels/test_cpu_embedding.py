"""The embedding lookup by the cpu backend's C kernels (Ops.embedding: fused_ops.cpp's row gather
for a float32 table, quant_linear.cpp's rows decoded from a packed one) against torch's, the
reference every backend inherits (F.embedding; QuantizedWeight.dequantize(rows=ids)).

- A float table's rows are copies: equal to F.embedding exactly.
- A quantized table's rows are decoded as conveyor_quant_dequantize_f32 decodes them (equal to
  its rows exactly), and equal to dequantize(rows=ids) exactly where the weight has no mins (one
  rounding, code * scale, on both sides); with mins, within the last bits: the kernel rounds
  code * scale + min once (a fused multiply-add) where torch rounds the product, then the sum, so
  they differ by at most 2^-24 (|code * scale| + 2 |w|) (two half-ulps apart). A wrong code, scale,
  min or row is off by a step of the codes, far beyond that.
- Both in every ISA variant this CPU runs (tests/kernels/cpu_isa.py: the float vectors' width,
  the decode's only dependence), with repeated ids, one id, and more than the one-thread bound.
- The cpu ops take the kernels only where they apply (float32, ids [T] int64 contiguous, a
  prepared weight without act-order), torch's otherwise; their lookups record and replay as
  kernel programs; ids outside the table give zeros, not a read past it.
- In context: a tiny float model and tiny GGUF ones (Q8_0 and Q4_1 tied tables) on the cpu backend
  give the logits of the same model with torch's lookup.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.gpu.backends import select
from conveyor.gpu.backends.cpu.kernels import program
from conveyor.gpu.backends.cpu.kernels.build import load_library
from conveyor.gpu.backends.cpu.kernels.fused_ops import CpuFusedOps, cpu_fused_ops
from conveyor.gpu.backends.cpu.kernels.quant_linear import CpuQuantLinear, QuantArgs, cpu_quant_linear
from conveyor.gpu.backends.cpu.ops import CpuOps
from conveyor.gpu.backends.torch import TorchOps
from conveyor.gpu.models.layers import VocabParallelEmbedding
from conveyor.gpu.quant.weight import QuantizedWeight, quantize_groups
from tests.kernels.cpu_isa import variant_params

FUSED, QUANT = cpu_fused_ops(), cpu_quant_linear()
pytestmark = pytest.mark.skipif(FUSED is None or QUANT is None, reason="no C++ compiler for the CPU kernels")

BUILDS = variant_params(int8=False)  # the lookups use float vectors only
CPU = torch.device("cpu")
IDS = [[5], [0, 0, 0], [3, 9, 3, 0, 99, 9], list(range(99, -1, -1)) * 4]  # one, repeated, mixed; 400 rows: past one thread


def fused_build(name: str) -> CpuFusedOps:
    lib = load_library("fused_ops", None if name == "native" else name)
    assert lib is not None, f"fused_ops.cpp did not build for {name}"
    return CpuFusedOps(lib)


def quant_build(name: str) -> CpuQuantLinear:
    lib = load_library("quant_linear", None if name == "native" else name)
    assert lib is not None, f"quant_linear.cpp did not build for {name}"
    return CpuQuantLinear(lib)


def table(kind: str, group: int, mins: bool, half: bool, seed: int, shape: tuple[int, int] = (100, 256)) -> QuantizedWeight:
    w = quantize_groups(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), kind, group)
    w.mins = w.mins if mins else None
    if half:  # float16 scales and mins (QuantizedWeight.compact, as GGUF's are)
        w.scales, w.mins = w.scales.half().float(), None if w.mins is None else w.mins.half().float()
        w.compact()
        assert w.scales.dtype == torch.float16
    return w


@pytest.mark.parametrize("build_name", BUILDS)
def test_float_rows_are_f_embeddings(build_name):
    fused = fused_build(build_name)
    weight = torch.randn(100, 96)
    for ids in IDS:
        ids_t = torch.tensor(ids)
        got = fused.embedding(ids_t, weight)
        assert got.shape == (len(ids), 96) and torch.equal(got, F.embedding(ids_t, weight))


@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("build_name", BUILDS)
@pytest.mark.parametrize("kind, group", [("u4", 32), ("u4", 128), ("u8", 16), ("u8", 64), ("e4m3", 16), ("e4m3", 32)])
def test_quantized_rows_are_the_dequantized_rows(kind, group, build_name, half):
    kernel = quant_build(build_name)
    for mins in (False, True) if kind != "e4m3" else (False,):
        w = table(kind, group, mins, half, seed=group)
        decoded, args = torch.empty(100, 256), kernel.prepare(w)  # args: alive through the call
        kernel._dequantize(decoded.data_ptr(), 0, 100, args.address)  # the existing decode, every row
        for ids in IDS:
            ids_t = torch.tensor(ids)
            got, want = kernel.rows(ids_t, w), w.dequantize(rows=ids_t)
            where = f"{kind} G={group} mins={mins} ids={ids[:6]}"
            assert got.shape == want.shape and torch.equal(got, decoded[ids_t]), where
            if not mins:
                assert torch.equal(got, want), where
                continue
            product = (w.codes(ids_t).view(len(ids), -1, group) * w.scales[ids_t].float().unsqueeze(-1)).view(len(ids), -1)
            bound = 2.0**-24 * (product.abs() + 2 * want.abs())
            assert ((got - want).abs() <= bound).all(), where


def test_ids_outside_the_table_give_zeros():
    weight, w = torch.randn(10, 64), table("u4", 32, False, False, seed=0, shape=(10, 64))  # no mins: exact
    ids = torch.tensor([-1, 10, 1 << 40, 3])
    for got, row in ((FUSED.embedding(ids, weight), weight[3]), (QUANT.rows(ids, w), w.dequantize(rows=ids[3:])[0])):
        assert torch.equal(got[:3], torch.zeros(3, 64)) and torch.equal(got[3], row)


def embedding_of(ops: CpuOps, weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype = torch.float32) -> VocabParallelEmbedding:
    """A table as the loader leaves it (a quantized one: no float weight, `quantized` set), prepared."""
    num_rows, hidden = weight.shape
    layer = VocabParallelEmbedding(num_rows, hidden, ops)
    if isinstance(weight, QuantizedWeight):
        layer.register_parameter("weight", None)
        layer.quantized, layer.dtype = weight, dtype
    else:
        layer.weight.data = weight
    ops.prepare(layer)
    return layer


def test_the_cpu_ops_take_the_kernels_where_they_apply(monkeypatch):
    calls: list[str] = []
    for cls, method in ((CpuFusedOps, "embedding"), (CpuQuantLinear, "rows")):
        real = getattr(cls, method)
        monkeypatch.setattr(cls, method, lambda self, *a, _real=real, _name=method: calls.append(_name) or _real(self, *a))
    ops, reference = CpuOps(FUSED, None, QUANT), TorchOps()
    ids = torch.tensor([7, 1, 7, 0])
    plain = table("u4", 32, True, False, seed=1, shape=(16, 64))
    act_order = table("u4", 32, True, False, seed=2, shape=(16, 64))
    act_order.perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    cases = [  # (table, dtype, ids, the kernel that serves it or None)
        (torch.randn(16, 64), torch.float32, ids, "embedding"),
        (torch.randn(16, 64, dtype=torch.bfloat16), torch.bfloat16, ids, None),  # not float32
        (torch.randn(16, 64), torch.float32, ids.int(), None),  # int32 ids: torch's
        (torch.randn(16, 64), torch.float32, ids.repeat(2)[::2], None),  # ids not contiguous
        (plain, torch.float32, ids, "rows"),
        (plain, torch.bfloat16, ids, None),  # the activations are not float32
        (act_order, torch.float32, ids, None),  # act-order: torch's
    ]
    for weight, dtype, some_ids, kernel in cases:
        layer = embedding_of(ops, weight, dtype)
        calls.clear()
        got = layer(some_ids)
        layer.ops = reference
        want = layer(some_ids)
        assert calls == ([kernel] if kernel else []), (kernel, dtype)
        assert got.dtype == want.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=1e-6, atol=1e-6), (kernel, dtype)
        if kernel != "rows":  # a gather and torch's own paths: the same values
            assert torch.equal(got, want)
    assert isinstance(plain.prepared, QuantArgs)  # prepare gave the table its C arguments


@pytest.mark.skipif(not program.available(), reason="no replay library")
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "u8"])
def test_lookups_record_and_replay(quantized):
    """The lookup is kernel calls only: recorded once, replayed on new ids written in place."""
    ops = CpuOps(FUSED, None, QUANT)
    weight = table("u8", 32, True, True, seed=4, shape=(50, 64)) if quantized else torch.randn(50, 64)
    layer = embedding_of(ops, weight)
    ids = torch.tensor([3, 3, 49])
    out, replay = ops.record(lambda: layer(ids))
    for new in ([0, 1, 2], [49, 7, 7]):
        ids.copy_(torch.tensor(new))
        replay.replay()
        layer.ops = TorchOps()
        assert torch.equal(out, layer(ids)) or quantized and torch.allclose(out, layer(ids), rtol=1e-6, atol=1e-6)
        layer.ops = ops


def model_logits(model, config) -> torch.Tensor:
    from tests.gpu.test_gpu_model import forward_prompts, random_prompts

    return forward_prompts(model, config, random_prompts([9, 1, 30], seed=2))


@pytest.mark.parametrize("kind", ["float", "Q8_0", "Q4_1"])
def test_the_tiny_models_logits_are_those_of_torchs_lookup(kind, tmp_path, monkeypatch):
    """The cpu backend's model with its lookups by the kernels, then with torch's (the reference):
    the same logits (float: exactly; quantized: but for the rows' last bits) and the same greedy tokens."""
    from conveyor.gpu.loading.loader import load_model
    from conveyor.gpu.models.registry import read_model_config
    from tests.gpu_checkpoints import checkpoint

    if kind == "float":
        path = checkpoint("llama")
    else:
        gguf = pytest.importorskip("gguf")
        from conveyor.gpu.loading.gguf import ensure_checkpoint
        from conveyor.tiny.checkpoint import make_checkpoint
        from tests.conftest import SMALL
        from tests.gpu.test_gguf import write_gguf

        hf = make_checkpoint(tmp_path / "hf", "LlamaForCausalLM", seed=4, tie_word_embeddings=True, **SMALL)
        (tmp_path / kind).mkdir()
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        path = ensure_checkpoint(write_gguf(tmp_path / kind / f"tiny-{kind}.gguf", hf, qtype), "float32")
    config = read_model_config(path)
    model = load_model(config, CPU, select("cpu", CPU, config))
    table = model.model.embed_tokens
    assert (table.quantized is not None) == (kind != "float")
    calls: list[int] = []
    for cls, method in ((CpuFusedOps, "embedding"), (CpuQuantLinear, "rows")):
        real = getattr(cls, method)
        monkeypatch.setattr(cls, method, lambda self, ids, *a, _real=real: calls.append(len(ids)) or _real(self, ids, *a))
    got = model_logits(model, config)
    assert calls == [40]  # the prompts' rows, in one lookup
    table.ops = TorchOps()
    want = model_logits(model, config)
    if kind == "float":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
