"""The dense families past Llama (Qwen2 with windowed layers, Qwen3, Gemma 2, Gemma 3, Phi-3) and
Llama 3 against transformers on tiny random checkpoints (tests/gpu_checkpoints.py).

tests/gpu/test_gpu_model.py runs every checkpoint plain (prompt logits, greedy generation with
sequences joining mid-way); here greedy output must stay equal under 3-token prompt chunks and
under preemption, on the cpu backend's kernels (`auto` for float32) and on the torch backend.
Then: one metadata per distinct window per step, the soft-cap actually binding, the Triton kernels'
soft-cap and per-layer windows, and config.json parsing and refusals.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from conveyor.config import ConfigError, EngineConfig, ModelConfig, config_from_json, config_to_json
from conveyor.gpu.backends import select
from conveyor.gpu.loading.loader import load_model
from conveyor.gpu.models.registry import read_model_config
from conveyor.gpu.step.runner import ModelRunner
from tests.gpu.test_gpu_model import drive_greedy, forward_prompts, hf_greedy, random_prompts
from tests.gpu_checkpoints import checkpoint, engine_config, hf_model

FAMILIES = ("llama", "qwen2_swa", "qwen3", "gemma2", "gemma3", "phi3")


def runner_for(arch: str, backend: str, num_blocks: int = 128) -> ModelRunner:
    config = engine_config(arch)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, attention_backend=backend))
    runner = ModelRunner(config)
    runner.initialize_cache(num_blocks)
    return runner


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_under_small_chunks_and_preemption(arch, backend):
    prompts = random_prompts([5, 19, 33], seed=5)  # past the windows (8, 16)
    hf = hf_model(arch)
    expected = [hf_greedy(hf, prompt, 10) for prompt in prompts]
    chunked = drive_greedy(runner_for(arch, backend), prompts, max_new=10, chunk=3, join_at=[0, 1, 4])
    assert chunked == expected, arch
    preempted = drive_greedy(runner_for(arch, backend, num_blocks=64), prompts, max_new=10, preempt={6: 1, 12: 2, 14: 0}, seed=4)
    assert preempted == expected, arch


def hf_incremental_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding with HF's model forward, one token per call on its KV cache. For Phi-3 this
    is not what `generate` does: its prepare_inputs_for_generation drops the cache when a
    sequence first passes the original context and recomputes every key with the long factors."""
    from transformers import DynamicCache

    ids, out = torch.tensor([prompt]), []
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        for _ in range(max_new):
            out.append(int(logits[0, -1].argmax()))
            position = torch.tensor([[len(prompt) + len(out) - 1]])
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True, position_ids=position).logits
    return out


def with_word_tokenizer(arch: str, root) -> str:
    """A copy of checkpoint `arch` with a tokenizer.json the Python API can load: one word per id
    (token-id prompts need no more)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = root / arch
    shutil.copytree(checkpoint(arch), path)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.mark.parametrize("arch", FAMILIES[1:])
def test_python_api_with_a_small_budget_and_pool(arch, tmp_path):
    """The real scheduler: an 8-token budget chunks every prompt beside decodes, and 16 blocks of
    4 cannot hold the sequences it admitted once they grow, so some are preempted and recomputed."""
    from conveyor import LLM, SamplingParams

    llm = LLM(with_word_tokenizer(arch, tmp_path), device="cpu", max_num_batched_tokens=8, num_kv_blocks=16, block_size=4)
    prompts = random_prompts([5, 19, 33, 12], seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = hf_model(arch)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, prompt, 24) for prompt in prompts]
    assert llm.core.scheduler.num_preemptions > 0 and llm.core.scheduler.blocks.num_used == 0


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_longrope_switches_to_long_factors_past_the_original_context(backend):
    """phi3_long's original context is 32: prompts inside it, generation past it. Each position
    keeps the factors it was rotated with, as HF's forward does token by token (see
    hf_incremental_greedy for where HF's generate differs)."""
    prompts = random_prompts([20, 9, 28], seed=6)
    hf = hf_model("phi3_long")
    outputs = drive_greedy(runner_for("phi3_long", backend), prompts, max_new=16, chunk=5)
    for prompt, got in zip(prompts, outputs):
        assert got == hf_incremental_greedy(hf, prompt, 16)
    assert any(len(prompt) + 16 > 33 for prompt in prompts)


def test_layers_share_one_metadata_per_window(monkeypatch):
    """gemma2's layers are windowed (8), global, windowed: the step's metadata is the window's
    (config.sliding_window), and the global layer's is built once."""
    config = read_model_config(checkpoint("gemma2"))
    assert (config.sliding_window, config.layer_windows) == (8, (8, None, 8))
    model = load_model(config, "cpu")
    attn = model.backend.attn
    built = []
    with_window = attn.with_window
    monkeypatch.setattr(attn, "with_window", lambda meta, window: built.append(window) or with_window(meta, window))
    forward_prompts(model, config, random_prompts([20, 3]))
    assert built == [None]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_attention_soft_cap_binds(backend):
    """Without the cap, gemma2's logits move: the tests above would notice a backend ignoring it."""
    config = read_model_config(checkpoint("gemma2"))
    model = load_model(config, "cpu", select(backend, "cpu", config))
    prompts = random_prompts([30])
    capped = forward_prompts(model, config, prompts)
    model.backend.attn.softcap = None
    uncapped = forward_prompts(model, config, prompts)
    assert (capped - uncapped).abs().max() > 1e-2


# --- Triton, under the interpreter on a CPU: tiny grids -------------------------------------


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_soft_cap_matches_reference(num_splits):
    pytest.importorskip("triton")
    from conveyor.gpu.backends.triton.paged_attention import paged_attention
    from conveyor.gpu.backends.triton.paged_attention_reference import reference_paged_attention
    from tests.kernels.test_triton_attention import make_step

    q, kv_cache, tables, starts, seq_lens, scale = make_step([(13, 1), (0, 6), (20, 1)], 1, 2, 16, 16, torch.float32)
    q = q * 4  # scores of several units, so a cap of 2 binds
    got = paged_attention(q, kv_cache, tables, starts, seq_lens, scale, 8, num_splits=num_splits, softcap=2.0)
    want = reference_paged_attention(q, kv_cache, tables, starts, seq_lens, scale, 8, softcap=2.0)
    assert (got - want).abs().max() < 1e-5
    assert (want - reference_paged_attention(q, kv_cache, tables, starts, seq_lens, scale, 8)).abs().max() > 1e-2


def test_graph_metadata_variants_share_the_static_buffers():
    """A CUDA graph's metadata (gpu/step/cuda_graphs.py) is built once per bucket over static buffers;
    a layer of another window gets a variant over the same buffers, built once."""
    pytest.importorskip("triton")
    config = read_model_config(checkpoint("gemma2"))
    attn = select("triton", "cpu", config).attn
    meta = attn.build_graph_metadata(
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        seq_lens=torch.ones(4, dtype=torch.int32),
        block_tables=torch.zeros(4, 8, dtype=torch.int32),
        positions=torch.zeros(4, dtype=torch.int64),
        block_size=16,
        sliding_window=config.sliding_window,
    )
    full = attn.for_window(meta, None)
    assert full.sliding_window is None and attn.for_window(meta, None) is full and attn.for_window(meta, 8) is meta
    for name in ("slot_mapping", "seq_lens", "block_tables", "positions", "query_start_loc"):
        assert getattr(full, name) is getattr(meta, name)


@pytest.mark.parametrize("arch", FAMILIES[1:])
def test_triton_backend_matches_hf(arch):
    """The triton backend's prompt logits: windowed and global layers (qwen2_swa, gemma), the
    soft-cap (gemma2), q/k norms (qwen3, gemma3), rotary and SiLU in place on views of Phi-3's
    fused projections."""
    pytest.importorskip("triton")
    config = read_model_config(checkpoint(arch))
    model = load_model(config, "cpu", select("triton", "cpu", config))
    prompts = random_prompts([14, 3], seed=7)
    ours = forward_prompts(model, config, prompts, block_size=16)
    hf = hf_model(arch)
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (ours[start : start + len(prompt)] - ref).abs().max() <= 1e-4 * ref.abs().max()
        start += len(prompt)


# --- config.json ----------------------------------------------------------------------------

BASE = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


def load(tmp_path, **fields) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return read_model_config(tmp_path)


def test_transformers_4_configs_imply_the_layer_windows(tmp_path):
    gemma2 = load(tmp_path, architectures=["Gemma2ForCausalLM"], sliding_window=16)
    assert gemma2.layer_windows == (16, None, 16, None) and gemma2.window_of(1) is None
    qwen2 = load(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True, max_window_layers=3)
    assert qwen2.layer_windows == (None, None, None, 16)
    mistral = load(tmp_path, architectures=["MistralForCausalLM"], sliding_window=16)
    assert (mistral.sliding_window, mistral.layer_windows, mistral.window_of(3)) == (16, (), 16)


def test_gemma3_spellings_agree(tmp_path):
    v4 = load(
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        sliding_window=16,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh",
    )
    v5 = load(
        tmp_path,
        architectures=["Gemma3ForCausalLM"],
        sliding_window=16,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    assert v4 == v5
    assert (v5.layer_windows, v5.local_rope_theta, v5.rope_theta, v5.rope_type) == ((16, None, 16, None), 1e4, 1e6, "linear")
    assert (v5.qk_norm, v5.attention_scale, v5.architecture) == (True, 0.25, "Gemma3ForCausalLM")


def test_engine_config_with_new_fields_round_trips_through_json():
    for arch in ("gemma2", "phi3"):
        config = EngineConfig(model=read_model_config(checkpoint(arch)))
        assert config_from_json(config_to_json(config)) == config


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["PaliGemmaForConditionalGeneration"]}, "unsupported architecture"),
        ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor 0.5"),
        ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 4}, "unsupported layer_types"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4}}, "needs a number for long_factor"),
        ({"attn_logit_softcapping": 50.0}, "unsupported logit soft-capping"),
        ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True}, "unsupported use_bidirectional_attention"),
    ],
)
def test_refusals_name_the_field(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, **{"architectures": ["LlamaForCausalLM"], **fields})
