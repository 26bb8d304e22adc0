"""AWQ and GPTQ checkpoints, loaded as published (config.json's quantization_config, no flag).

Tiny Llama and Qwen2 checkpoints are quantized into each published layout (tests/gpu/
quant_packers.py). A reference dequantizer written here from the published formulas, not the
code under test, gives each layer's float weight: the loaded QuantizedWeight must dequantize to
it exactly, and the float checkpoint made of those weights is the model the quantized one must
equal (transformers cannot run either format on a CPU): logits close, greedy tokens equal,
served by conveyor, and with AWQ sharded over two ranks. Bad input is a ConfigError naming the
tensor or the config field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor import LLM, SamplingParams
from conveyor.config.errors import ConfigError
from conveyor.config.quant import QuantConfig
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.parallel.group import SINGLE
from conveyor.gpu.quant.scheme import scheme_for
from conveyor.tiny.checkpoint import make_checkpoint
from tests.gpu import quant_packers as packers
from tests.gpu.test_gpu_model import forward_prompts, random_prompts
from tests.gpu.test_tensor_parallel import run_checkpoints, run_ranks

# K is 64 (hidden) or 192 (intermediate): groups of 16, 32 and 64 divide both, and 192 / 2 ranks
# keeps whole groups of 32.
SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog, and then " * 3, "a"]
NUM_TOKENS = 10


@dataclasses.dataclass(frozen=True)
class Variant:
    arch: str
    config: dict  # quantization_config, as its tool publishes it
    pack: dict  # packers.pack_awq / pack_gptq options
    kind: str  # the QuantizedWeight kind expected
    skip: tuple[str, ...] = ()  # layers left float (modules_to_not_convert)


AWQ = {"quant_method": "awq", "zero_point": True}
GPTQ = {"quant_method": "gptq", "damp_percent": 0.01, "true_sequential": True}
VARIANTS = {
    # transformers' AwqConfig spelling, and AutoAWQ's own (w_bit, q_group_size, "GEMM") on a Qwen2
    # (q/k/v biases) with one layer kept float.
    "awq-g32": Variant("LlamaForCausalLM", {**AWQ, "bits": 4, "group_size": 32, "version": "gemm"}, dict(group=32), "u4"),
    "awq-g64": Variant(
        "Qwen2ForCausalLM",
        {**AWQ, "w_bit": 4, "q_group_size": 64, "version": "GEMM", "modules_to_not_convert": ["layers.1.mlp.down_proj"]},
        dict(group=64),
        "u4",
        skip=("layers.1.mlp.down_proj",),
    ),
    "gptq-4": Variant(
        "LlamaForCausalLM",
        {**GPTQ, "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
        dict(bits=4, group=32, sym=True, v2=False, act_order=False),
        "u4",
    ),
    "gptq-4-act": Variant(
        "LlamaForCausalLM",
        {**GPTQ, "bits": 4, "group_size": 32, "desc_act": True, "sym": True, "checkpoint_format": "gptq"},
        dict(bits=4, group=32, sym=True, v2=False, act_order=True),
        "u4",
    ),
    "gptq-8": Variant(
        "Qwen2ForCausalLM",
        {**GPTQ, "bits": 8, "group_size": 64, "desc_act": False, "sym": True},
        dict(bits=8, group=64, sym=True, v2=False, act_order=False),
        "u8",
    ),
    # GPTQModel's spelling of the v2 format, asymmetric (zero points of 0 occur), act-order.
    "gptq-8-act-v2": Variant(
        "LlamaForCausalLM",
        {**GPTQ, "bits": 8, "group_size": 32, "desc_act": True, "sym": False, "format": "gptq_v2", "checkpoint_format": "gptq_v2"},
        dict(bits=8, group=32, sym=False, v2=True, act_order=True),
        "u8",
    ),
    # Groups of 16 are not whole u4 chunks: the 4-bit codes sit a byte each.
    "gptq-4-g16-v2": Variant(
        "LlamaForCausalLM",
        {**GPTQ, "bits": 4, "group_size": 16, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"},
        dict(bits=4, group=16, sym=False, v2=True, act_order=True),
        "u8",
    ),
}


def reference_weight(variant: Variant, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The published formula, w[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], as float32 [N, K]."""
    method, spec = variant.config["quant_method"], variant.config
    if method == "awq":  # outputs 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i] in bits 4i of word c
        words, zwords = parts["qweight"].numpy().view(np.uint32), parts["qzeros"].numpy().view(np.uint32)
        q = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
        z = np.zeros((zwords.shape[0], zwords.shape[1] * 8), dtype=np.int64)
        for i, out in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            q[:, out::8] = (words >> (4 * i)) & 0xF
            z[:, out::8] = (zwords >> (4 * i)) & 0xF
        group = spec.get("group_size", spec.get("q_group_size"))
        assert group is not None
        g = np.arange(q.shape[0]) // group
    else:  # inputs 8r + i (4-bit) or 4r + i (8-bit) in bits b * i of row r; zeros along outputs
        bits = spec["bits"]
        per, mask = 32 // bits, (1 << bits) - 1
        words, zwords = parts["qweight"].numpy().view(np.uint32), parts["qzeros"].numpy().view(np.uint32)
        q = np.zeros((words.shape[0] * per, words.shape[1]), dtype=np.int64)
        z = np.zeros((zwords.shape[0], zwords.shape[1] * per), dtype=np.int64)
        for i in range(per):
            q[i::per] = (words >> (bits * i)) & mask
            z[:, i::per] = (zwords >> (bits * i)) & mask
        if spec.get("checkpoint_format", "gptq") == "gptq":
            z += 1  # v1 stores zero - 1
        g = parts["g_idx"].long().numpy() if spec["desc_act"] else np.arange(q.shape[0]) // spec["group_size"]
    s = parts["scales"].float()
    w = (torch.from_numpy(q - z[g]).float()) * s[torch.from_numpy(g)]
    return w.T.contiguous()


def layer_parts(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each quantized layer's published tensors, by prefix."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in ("qweight", "qzeros", "scales", "g_idx"):
            layers.setdefault(prefix, {})[suffix] = tensor
    return layers


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Variant name -> (quantized checkpoint, its reference-dequantized float twin), made on use."""
    root, cache = tmp_path_factory.mktemp("awq-gptq"), {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            v = VARIANTS[name]
            source = make_checkpoint(root / f"{name}-source", v.arch, seed=11, **SHAPE)
            if v.config["quant_method"] == "awq":
                pack = lambda w: packers.pack_awq(w, **v.pack)  # noqa: E731
            else:
                pack = lambda w: packers.pack_gptq(w, **v.pack, seed=w.shape[0] + w.shape[1])  # noqa: E731
            quantized = packers.write_quantized(source, root / name, v.config, pack, v.skip)
            weights = {prefix: reference_weight(v, parts) for prefix, parts in layer_parts(quantized).items()}
            cache[name] = quantized, packers.write_float(quantized, root / f"{name}-dequantized", weights)
        return cache[name]

    return get


@pytest.mark.parametrize("name", VARIANTS)
def test_loaded_weights_dequantize_exactly_to_the_reference(name, made):
    quantized, _ = made(name)
    v = VARIANTS[name]
    model = load_model(read_model_config(quantized), "cpu")
    modules = dict(model.named_modules())
    parts = layer_parts(quantized)
    assert len(parts) == 2 * len(packers.LINEARS) - len(v.skip)
    for prefix, layer_tensors in parts.items():
        weight = modules[prefix].quantized
        assert weight.kind == v.kind, prefix
        assert (weight.perm is not None) == bool(v.config.get("desc_act")), prefix
        assert torch.equal(weight.dequantize(), reference_weight(v, layer_tensors)), prefix
    for prefix in v.skip:  # modules_to_not_convert: float, as stored
        layer = next(m for p, m in modules.items() if p.endswith(prefix))
        assert layer.quantized is None and layer.weight is not None


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_the_dequantized_float_model(name, made):
    quantized, dequantized = made(name)
    prompts = [[t % 4096 for t in p] for p in random_prompts([9, 1, 23], seed=5)]
    logits = []
    for path in (quantized, dequantized):
        config = read_model_config(path)
        logits.append(forward_prompts(load_model(config, "cpu"), config, prompts))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["awq-g32", "awq-g64", "gptq-4", "gptq-4-act", "gptq-8", "gptq-8-act-v2"])
def test_greedy_tokens_equal_the_dequantized_model_served(name, made):
    quantized, dequantized = made(name)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    tokens = []
    for path in (quantized, dequantized):
        llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
        tokens.append([out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)])
    assert all(len(t) == NUM_TOKENS for t in tokens[0])
    assert tokens[0] == tokens[1]


def test_awq_sharded_over_two_ranks_equals_one(made, tmp_path):
    quantized, _ = made("awq-g32")
    checkpoints = {"awq": str(quantized)}
    sharded, whole = run_ranks(2, checkpoints, tmp_path), run_checkpoints(SINGLE, checkpoints)
    torch.testing.assert_close(sharded["awq"], whole["awq"], rtol=1e-4, atol=1e-4)
    assert sharded["awq greedy"] == whole["awq greedy"]


def one_word(qweight_shape: tuple[int, int], num_scales: int) -> dict[str, torch.Tensor]:
    """qweight of words 0x76543210 (field i = i), zero points 0, scales 1."""
    return {
        "qweight": torch.full(qweight_shape, 0x76543210, dtype=torch.int32),
        "qzeros": torch.zeros(1, 1, dtype=torch.int32),
        "scales": torch.ones(1, num_scales, dtype=torch.float16),
    }


def test_the_published_bit_orders():
    """Words of field i = i: AWQ spreads them over outputs (0, 2, 4, 6, 1, 3, 5, 7), GPTQ over 8
    consecutive inputs; zero points 0 (but 1 in GPTQ v1) and scales 1 leave the codes themselves."""
    awq = scheme_for(QuantConfig("awq", json.dumps({"bits": 4, "group_size": -1, "version": "gemm"})))
    assert awq.convert("l", one_word((32, 1), 8), (8, 32)).dequantize().tolist() == [[n] * 32 for n in (0, 4, 1, 5, 2, 6, 3, 7)]
    v2 = scheme_for(QuantConfig("gptq", json.dumps({"bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"})))
    assert v2.convert("l", one_word((4, 8), 8), (8, 32)).dequantize().tolist() == [list(range(8)) * 4] * 8
    v1 = scheme_for(QuantConfig("gptq", json.dumps({"bits": 4, "group_size": 32})))
    assert v1.convert("l", one_word((4, 8), 8), (8, 32)).dequantize().tolist() == [[i - 1 for i in range(8)] * 4] * 8


def edited(source: Path, root: Path, tensors=None, config=None) -> Path:
    """A copy of `source` with model.safetensors and quantization_config changed by the callables."""
    root.mkdir()
    weights = load_file(source / "model.safetensors")
    save_file(tensors(weights) if tensors else weights, root / "model.safetensors")
    hf = json.loads((source / "config.json").read_text())
    if config:
        hf["quantization_config"] = config(hf["quantization_config"])
    (root / "config.json").write_text(json.dumps(hf))
    return root


LAYER = "model.layers.0.self_attn.q_proj"


def test_mismatched_scales_name_the_tensor(made, tmp_path):
    quantized, _ = made("awq-g32")
    path = edited(quantized, tmp_path / "bad", tensors=lambda t: {**t, f"{LAYER}.scales": t[f"{LAYER}.scales"][:1].contiguous()})
    with pytest.raises(ConfigError, match=rf"^tensor {LAYER}\.scales has shape \(1, 64\), expected \(2, 64\)$"):
        load_model(read_model_config(path), "cpu")


def test_a_missing_qzeros_is_named(made, tmp_path):
    quantized, _ = made("gptq-4")
    path = edited(quantized, tmp_path / "bad", tensors=lambda t: {k: v for k, v in t.items() if k != f"{LAYER}.qzeros"})
    with pytest.raises(ConfigError, match=rf"^quantized layer {LAYER} lacks tensor {LAYER}\.qzeros$"):
        load_model(read_model_config(path), "cpu")


def test_a_scattered_g_idx_is_named(made, tmp_path):
    quantized, _ = made("gptq-4-act")
    path = edited(quantized, tmp_path / "bad", tensors=lambda t: {**t, f"{LAYER}.g_idx": torch.zeros(64, dtype=torch.int32)})
    with pytest.raises(ConfigError, match=rf"^tensor {LAYER}\.g_idx: its inputs do not fall 32 to each of 2 groups$"):
        load_model(read_model_config(path), "cpu")


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("awq-g32", {"version": "gemv"}, "AWQ checkpoint: quantization_config version 'gemv' is not served; served: 'gemm'"),
        ("awq-g32", {"bits": 8}, "AWQ checkpoint: quantization_config bits 8 is not served; served: 4"),
        ("gptq-4", {"bits": 3}, "GPTQ checkpoint: quantization_config bits 3 is not served; served: 4 or 8"),
        ("gptq-4", {"checkpoint_format": "marlin"}, "GPTQ checkpoint: quantization_config checkpoint_format 'marlin' is not served"),
        ("gptq-4", {"dynamic": {"-:.*down_proj": {}}}, "GPTQ checkpoint: quantization_config dynamic"),
    ],
)
def test_an_unsupported_config_is_one_line(name, change, message, made, tmp_path):
    quantized, _ = made(name)
    path = edited(quantized, tmp_path / "bad", config=lambda spec: {**spec, **change})
    with pytest.raises(ConfigError) as error:
        load_model(read_model_config(path), "cpu")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
