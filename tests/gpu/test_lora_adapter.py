"""PEFT adapters as PEFT saves them: read and checked without torch (config/lora_adapter.py), then
loaded (gpu/lora/weights.py), against peft's own state dict.

The adapters are made by peft itself on the tiny Llama and Qwen2 of tests/gpu_checkpoints.py,
with init_lora_weights=False so that B is not zero; each refusal is provoked by editing a copy's
adapter_config.json or rewriting its tensors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.config.lora_adapter import LORA_TARGETS, LoraError, read_adapter_info
from conveyor.config.moe import MoeConfig
from conveyor.gpu.lora.weights import load_adapter
from conveyor.gpu.models.registry import read_model_config
from tests.gpu_checkpoints import checkpoint, hf_model

peft = pytest.importorskip("peft")

MAX_RANK = 16
WEIGHTS = "adapter_model.safetensors"


def make_adapter(arch: str, path: Path, **lora) -> tuple[Path, dict[str, torch.Tensor]]:
    """A PEFT LoRA on the tiny `arch`, saved in `path`, and peft's state dict of it."""
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_model(arch), peft.LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(path)
    return path, {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    return make_adapter("llama", tmp_path_factory.mktemp("llama-lora"), r=8, lora_alpha=16, target_modules=list(LORA_TARGETS))


@pytest.fixture(scope="module")
def llama():
    return read_model_config(checkpoint("llama"))


def key(layer: int, target: str, half: str) -> str:
    block = "self_attn" if target in LORA_TARGETS[:4] else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{half}.weight"


def assert_loads_as_peft(info, model, state: dict[str, torch.Tensor], dtype=torch.float32) -> None:
    loaded = load_adapter(info, model.num_layers, dtype, "cpu")
    assert {key(layer, target, "A") for layer, target in loaded} == {k for k in state if ".lora_A." in k}
    for (layer, target), (a, b) in loaded.items():
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, state[key(layer, target, "A")].to(dtype))
        assert torch.equal(b, state[key(layer, target, "B")].to(dtype))
        assert b.abs().sum() > 0  # init_lora_weights=False: a real B, so a swap or a zero would show


def test_llama_adapter_on_every_target(llama_adapter, llama):
    path, state = llama_adapter
    info = read_adapter_info("sql", str(path), llama, MAX_RANK)
    assert (info.name, info.path, info.rank, info.scaling) == ("sql", str(path), 8, 2.0)
    assert info.targets == frozenset(LORA_TARGETS)
    assert len(state) == 2 * 7 * llama.num_layers
    assert_loads_as_peft(info, llama, state)
    assert_loads_as_peft(info, llama, state, torch.float16)


def test_qwen2_rslora_on_some_targets(tmp_path):
    model = read_model_config(checkpoint("qwen2"))
    targets = ["q_proj", "v_proj", "down_proj"]
    path, state = make_adapter("qwen2", tmp_path, r=16, lora_alpha=32, use_rslora=True, target_modules=targets)
    info = read_adapter_info("chat", str(path), model, MAX_RANK)
    assert info.rank == 16 and info.scaling == pytest.approx(32 / math.sqrt(16))  # 8, where alpha / r is 2
    assert info.targets == frozenset({"q_proj", "v_proj", "down_proj"})
    assert_loads_as_peft(info, model, state)


def test_regex_targets_match_module_paths_as_peft(tmp_path, llama):
    path, state = make_adapter("llama", tmp_path, r=8, lora_alpha=8, target_modules=r".*\.layers\.1\.self_attn\.(q|k)_proj")
    info = read_adapter_info("re", str(path), llama, MAX_RANK)
    assert info.targets == frozenset({"q_proj", "k_proj"}) and info.scaling == 1.0
    assert_loads_as_peft(info, llama, state)
    assert set(load_adapter(info, llama.num_layers, torch.float32, "cpu")) == {(1, "q_proj"), (1, "k_proj")}


def test_layers_to_transform_covers_only_those_layers(tmp_path, llama):
    path, state = make_adapter("llama", tmp_path, r=8, lora_alpha=8, target_modules=["o_proj", "up_proj"], layers_to_transform=[1])
    info = read_adapter_info("late", str(path), llama, MAX_RANK)
    assert_loads_as_peft(info, llama, state)
    assert set(load_adapter(info, llama.num_layers, torch.float32, "cpu")) == {(1, "o_proj"), (1, "up_proj")}


def test_all_linear_targets_every_projection(tmp_path, llama):
    path, state = make_adapter("llama", tmp_path / "saved", r=4, lora_alpha=8, target_modules="all-linear")
    info = read_adapter_info("all", str(path), llama, MAX_RANK)
    assert info.targets == frozenset(LORA_TARGETS)
    assert_loads_as_peft(info, llama, state)
    # PEFT saves the module paths it chose; a file that kept the alias means the same.
    alias = copy_with(path, tmp_path, target_modules="all-linear")
    assert read_adapter_info("all", str(alias), llama, MAX_RANK) == dataclasses.replace(info, path=str(alias))


def copy_with(adapter: Path, tmp_path: Path, **config) -> Path:
    """A copy of `adapter` with `config` merged into its adapter_config.json."""
    path = tmp_path / "edited"
    shutil.copytree(adapter, path)
    data = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**data, **config}))
    return path


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LORA"),
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias 'lora_only'"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern"),
        ({"lora_bias": True}, "lora_bias"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa'"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules 'lm_head'"),
        ({"target_modules": ["embed_tokens"]}, "target_modules 'embed_tokens'"),
        ({"target_modules": r"model\.embed_tokens|.*q_proj"}, "names model.embed_tokens"),
        ({"target_modules": ["q_proj"]}, r"tensor .*layers\.\d\.\w+\.(?!q_proj)\w+\.lora_[AB]\.weight: its module is not in"),
        ({"layers_to_transform": [0]}, r"layers\.1\..*not in target_modules"),
        ({"target_modules": "(("}, "not a regular expression"),
        ({"r": 32}, "r 32 is over --max-lora-rank 16"),
        ({"r": 4}, r"lora_[AB]\.weight: shape \[\d+, \d+\] is not \[(4, \d+|\d+, 4)\]"),
    ],
)
def test_refusals_name_the_key(llama_adapter, llama, tmp_path, config, message):
    path = copy_with(llama_adapter[0], tmp_path, **config)
    with pytest.raises(LoraError, match=message):
        read_adapter_info("bad", str(path), llama, MAX_RANK)


def test_refuses_what_is_not_an_adapter(llama_adapter, llama, tmp_path):
    for path in (tmp_path / "missing", llama_adapter[0] / WEIGHTS, checkpoint("llama")):
        with pytest.raises(LoraError, match="not a LoRA adapter"):
            read_adapter_info("none", str(path), llama, MAX_RANK)


def rewrite_tensors(adapter: Path, tmp_path: Path, change) -> Path:
    path = copy_with(adapter, tmp_path)
    tensors = load_file(path / WEIGHTS)
    change(tensors)
    save_file(tensors, path / WEIGHTS)
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop(key(1, "down_proj", "B")), r"tensor .*layers\.1\.mlp\.down_proj\.lora_B\.weight is missing"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}), r"tensor base_model\.model\.lm_head"),
        (lambda t: t.update({key(0, "k_proj", "B"): torch.zeros(64, 8)}), r"k_proj\.lora_B\.weight: shape \[64, 8\] is not \[32, 8\]"),
        (lambda t: t.update({key(0, "q_proj", "A"): torch.zeros(8, 64, dtype=torch.int32)}), "dtype I32"),
        (lambda t: t.update({key(0, "q_proj", "A").replace("weight", "bias"): torch.zeros(8)}), "not a lora_A / lora_B weight"),
    ],
)
def test_refuses_tensors_that_disagree(llama_adapter, llama, tmp_path, change, message):
    path = rewrite_tensors(llama_adapter[0], tmp_path, change)
    with pytest.raises(LoraError, match=message):
        read_adapter_info("bad", str(path), llama, MAX_RANK)


def test_refuses_an_unreadable_weights_file(llama_adapter, llama, tmp_path):
    path = copy_with(llama_adapter[0], tmp_path)
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(struct.pack("<Q", len(data)) + data[8:100])  # a header past the end
    with pytest.raises(LoraError, match=f"{WEIGHTS} is not a safetensors file"):
        read_adapter_info("bad", str(path), llama, MAX_RANK)
    (path / WEIGHTS).rename(path / "adapter_model.bin")
    with pytest.raises(LoraError, match="only safetensors"):
        read_adapter_info("bad", str(path), llama, MAX_RANK)


def test_refuses_a_target_the_model_lacks(tmp_path, llama):
    """Phi-3 fuses q/k/v into qkv_proj (its checkpoint says so); a mixture-of-experts layer has
    no dense MLP (its ModelConfig says so, for a checkpoint whose names cannot be read)."""
    path, _ = make_adapter("llama", tmp_path / "a", r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    with pytest.raises(LoraError, match=r"tensor .*layers\.\d\.self_attn\.q_proj\.lora_[AB]\.weight: not a LoRA weight of a module"):
        read_adapter_info("phi", str(path), read_model_config(checkpoint("phi3")), MAX_RANK)
    path, _ = make_adapter("llama", tmp_path / "b", r=8, lora_alpha=8, target_modules=["gate_proj"])
    moe = MoeConfig(4, 2, 32, True, False, 0, (0, 1), "mlp", ("gate_proj", "up_proj", "down_proj"))
    (tmp_path / "no-checkpoint").mkdir()
    sparse = dataclasses.replace(llama, path=str(tmp_path / "no-checkpoint"), moe=moe)
    with pytest.raises(LoraError, match=r"target_modules \['gate_proj'\] names no module of this model"):
        read_adapter_info("moe", str(path), sparse, MAX_RANK)
    dense_second = dataclasses.replace(sparse, moe=dataclasses.replace(moe, sparse_layers=(0,)))
    with pytest.raises(LoraError, match=r"layers\.0\.mlp\.gate_proj\.lora_[AB]\.weight: not a LoRA weight of a module"):
        read_adapter_info("moe", str(path), dense_second, MAX_RANK)
