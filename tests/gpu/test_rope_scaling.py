"""gpu/models/rope.py's dynamic NTK and YaRN tables against Hugging Face transformers.

The frequencies and YaRN's attention factor are compared with transformers' ROPE_INIT_FUNCTIONS,
then a tiny random Llama with each scaling is compared end to end: prompt logits within the
tolerance of tests/gpu/test_gpu_model.py (1e-4 of the largest logit). Dynamic NTK past the original
context is compared with transformers decoding token by token, the case gpu/models/rope.py's per-position
table reproduces (`RotaryEmbedding`'s docstring says how a one-shot HF prefill differs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conveyor.config import ConfigError
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.models.rope import RotaryEmbedding, attention_factor, dynamic_ntk_frequencies, inverse_frequencies
from tests.gpu.test_gpu_model import forward_prompts, random_prompts
from tests.gpu_checkpoints import COMMON_FIELDS

HEAD_DIM = 64
YARNS = [
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0, "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1000, "truncate": False},
]


def _hf_config(scaling: dict, max_position_embeddings: int = 8192, **extra) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={**scaling, "rope_theta": 10000.0},
        **extra,
    )


@pytest.mark.parametrize("scaling", YARNS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items() if k != "rope_type"))
def test_yarn_frequencies_and_attention_factor_match_hf(scaling):
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(scaling), "cpu")
    got = inverse_frequencies(HEAD_DIM, 10000.0, scaling)
    assert got.dtype == torch.float32 and torch.equal(got, want_inv_freq)
    assert attention_factor(scaling) == pytest.approx(want_factor, rel=1e-15)
    assert attention_factor({"rope_type": "linear", "factor": 4.0}) == 1.0


@pytest.mark.parametrize("seq_len", [1, 100, 512, 513, 700, 4096])
def test_dynamic_frequencies_match_hf_below_and_above_the_original_max(seq_len):
    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 512}
    # A tensor seq_len, as HF's dynamic update passes during generate (max(position_ids) + 1).
    want, want_factor = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(scaling, 512), "cpu", seq_len=torch.tensor(seq_len))
    got = dynamic_ntk_frequencies(HEAD_DIM, 10000.0, scaling, torch.tensor([seq_len]))[0]
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
    assert want_factor == 1.0 == attention_factor(scaling)
    if seq_len <= 512:  # inside the original context: the default frequencies
        torch.testing.assert_close(got, inverse_frequencies(HEAD_DIM, 10000.0, {}), rtol=2e-7, atol=0)


def test_dynamic_table_rows_use_their_own_length_past_the_original_max():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    table = RotaryEmbedding(HEAD_DIM, 10000.0, scaling, 200).cos_sin
    assert torch.equal(table[:64], RotaryEmbedding(HEAD_DIM, 10000.0, {}, 64).cos_sin)
    for p in (64, 65, 120, 199):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(scaling, 64), "cpu", seq_len=torch.tensor(p + 1))
        freqs = torch.tensor(float(p)) * inv_freq
        torch.testing.assert_close(table[p], torch.cat((freqs.cos(), freqs.sin())), rtol=0, atol=2e-6)
    assert not torch.allclose(table[64:], RotaryEmbedding(HEAD_DIM, 10000.0, {}, 200).cos_sin[64:])


def test_yarn_table_scales_cos_and_sin():
    scaling = YARNS[1]
    table = RotaryEmbedding(HEAD_DIM, 10000.0, scaling, 32).cos_sin
    freqs = torch.arange(32).float()[:, None] * inverse_frequencies(HEAD_DIM, 10000.0, scaling)[None, :]
    scale = attention_factor(scaling)
    assert scale > 1
    assert torch.equal(table, torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1))


def _write_config(path: Path, rope_parameters: dict, **extra) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_theta": 10000.0, **rope_parameters},
        **extra,
    }
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_config_accepts_dynamic_and_yarn_and_names_missing_fields(tmp_path):
    dynamic = read_model_config(_write_config(tmp_path / "d", {"rope_type": "dynamic", "factor": 2.0}))
    # HF's dynamic NTK scales from max_position_embeddings: so does ours.
    assert dict(dynamic.rope_scaling)["original_max_position_embeddings"] == 128
    yarn = read_model_config(_write_config(tmp_path / "y", {"type": "yarn", "factor": 4.0}))
    assert yarn.rope_type == "yarn" and dict(yarn.rope_scaling)["original_max_position_embeddings"] == 128
    phi3_style = _write_config(tmp_path / "p", {"rope_type": "yarn", "factor": 4.0}, original_max_position_embeddings=32)
    assert dict(read_model_config(phi3_style).rope_scaling)["original_max_position_embeddings"] == 32
    # The context the scaling exists for: dynamic to max_position_embeddings x factor, YaRN to
    # original_max_position_embeddings x factor (never below max_position_embeddings).
    assert dynamic.max_model_len == 256 and yarn.max_model_len == 512
    assert read_model_config(phi3_style).max_model_len == 128
    with pytest.raises(ConfigError, match="'yarn'.*needs a number for factor"):
        read_model_config(_write_config(tmp_path / "m", {"rope_type": "yarn"}))
    with pytest.raises(ConfigError, match="'llama3'.*low_freq_factor, high_freq_factor"):
        read_model_config(_write_config(tmp_path / "l", {"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ConfigError, match="unsupported rope_type 'ntk-by-parts'"):
        read_model_config(_write_config(tmp_path / "u", {"rope_type": "ntk-by-parts", "factor": 8.0}))


def _tiny_llama(path: Path, rope_parameters: dict, max_position_embeddings: int) -> transformers.LlamaForCausalLM:
    """A 2-layer random Llama saved to `path`, returned as the HF reference (float32, eval)."""
    fields = COMMON_FIELDS.copy()
    fields["max_position_embeddings"] = max_position_embeddings
    config = transformers.LlamaConfig(
        **fields,
        rope_parameters={"rope_theta": 10000.0, **rope_parameters},
    )
    torch.manual_seed(4321)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model.eval()


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # tests/gpu/test_gpu_model.py's tolerance


@pytest.mark.parametrize("scaling", [YARNS[0], YARNS[2]], ids=["factor2", "mscale"])
def test_yarn_llama_prompt_logits_match_hf(tmp_path, scaling):
    scaling = {**scaling, "original_max_position_embeddings": 16}  # prompts reach past it
    hf = _tiny_llama(tmp_path, scaling, 64)
    config = read_model_config(tmp_path)
    assert config.rope_type == "yarn"
    prompts = random_prompts([60, 5, 23], seed=5)
    ours = forward_prompts(load_model(config, "cpu"), config, prompts)
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float()
        _assert_logits_close(ours[start : start + len(prompt)], want)
        start += len(prompt)


def test_dynamic_llama_matches_hf_inside_the_context_and_token_by_token_past_it(tmp_path):
    hf = _tiny_llama(tmp_path, {"rope_type": "dynamic", "factor": 2.0}, 32)
    # Dynamic NTK serves max_position_embeddings x factor (64) positions, as in vLLM.
    assert read_model_config(tmp_path).max_model_len == 64
    config = read_model_config(tmp_path, max_model_len=56)
    model = load_model(config, "cpu")
    short, long = random_prompts([30, 56], seed=6)
    with torch.no_grad():
        want = hf(torch.tensor([short])).logits[0].float()
    _assert_logits_close(forward_prompts(model, config, [short]), want)

    # HF one token at a time, as in decoding: each step's seq_len is its position + 1.
    cache = transformers.DynamicCache(config=hf.config)
    rows = []
    with torch.no_grad():
        for position, token in enumerate(long):
            out = hf(torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
    _assert_logits_close(forward_prompts(model, config, [long]), torch.stack(rows))
    # ...which a one-shot HF forward of the long prompt does not give (it scales every position by 56).
    with torch.no_grad():
        one_shot = hf(torch.tensor([long])).logits[0].float()
    assert (one_shot - torch.stack(rows)).abs().max() > 1e-3 * one_shot.abs().max()
