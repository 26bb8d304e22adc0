"""The generated checkpoints: tokenizer, tensor layout, determinism, and transformers' view of them."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor.gpu.models.registry import read_model_config
from conveyor.tiny.checkpoint import DEFAULT_SHAPE, TINY_MODEL_VERSION, ensure_default_model, make_checkpoint
from conveyor.tiny.tokenizer import DEFAULT_CORPUS, SPECIAL_TOKEN_IDS, VOCAB_SIZE, train_tokenizer

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_checkpoint(root / arch, arch, **SMALL) for arch in ARCHS}


# --- tokenizer ------------------------------------------------------------------------------


def test_corpus_is_a_fixed_file_of_useful_size():
    size = DEFAULT_CORPUS.stat().st_size
    assert 150_000 <= size <= 300_000


def test_tokenizer_has_exactly_4096_ids_with_specials_on_top():
    tok = train_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE == 4096
    assert SPECIAL_TOKEN_IDS["<|begin_of_text|>"] == 4080
    for token, token_id in SPECIAL_TOKEN_IDS.items():
        assert tok.token_to_id(token) == token_id


def test_tokenizer_training_is_deterministic():
    here = train_tokenizer().to_str()
    assert train_tokenizer().to_str() == here
    # Another process has other hash seeds (Rust's HashMap randomizes per process).
    code = "from conveyor.tiny.tokenizer import train_tokenizer; print(train_tokenizer().to_str())"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == here


@pytest.mark.parametrize("text", ["Hello, world!", "emoji 😊🌄 and 東京, ещё", "  spaces\t\ttabs\n\n", "x = [1, 22, 333]"])
def test_tokenizer_round_trips_any_text_and_prepends_bos(text):
    tok = train_tokenizer()
    enc = tok.encode(text)
    assert enc.ids[0] == SPECIAL_TOKEN_IDS["<|begin_of_text|>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == text


def test_tokenizer_learned_english():
    tok = train_tokenizer()
    text = "Can you help me write a short email to my landlord about the heater?"
    # A useful BPE needs about one token per word here; raw bytes would need 68.
    assert len(tok.encode(text, add_special_tokens=False).ids) <= 20


# --- tensors and config ---------------------------------------------------------------------


def test_llama_tensor_names_and_shapes(small):
    tensors = load_file(small["LlamaForCausalLM"] / "model.safetensors")
    hidden, inter, kv = 64, 160, 2 * 16
    expected = {
        "model.embed_tokens.weight": (VOCAB_SIZE, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (VOCAB_SIZE, hidden),
    }
    for i in range(2):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (hidden, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, hidden),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.float32 for v in tensors.values())


def test_qwen2_has_qkv_biases_only(small):
    names = set(load_file(small["Qwen2ForCausalLM"] / "model.safetensors"))
    biases = {n for n in names if n.endswith(".bias")}
    assert biases == {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"}


def test_tied_embeddings_leave_out_lm_head(tmp_path):
    path = make_checkpoint(tmp_path, tie_word_embeddings=True, **SMALL)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    assert read_model_config(path).tie_word_embeddings


@pytest.mark.parametrize("arch", ARCHS)
def test_model_config_reads_it(small, arch):
    cfg = read_model_config(small[arch])
    shape = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert cfg.architecture == arch and shape == (64, 2, 4, 2, 16)
    assert cfg.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert cfg.bos_token_id == SPECIAL_TOKEN_IDS["<|begin_of_text|>"]
    assert cfg.eos_token_ids == (SPECIAL_TOKEN_IDS["<|end_of_text|>"], SPECIAL_TOKEN_IDS["<|eot_id|>"])
    assert cfg.sliding_window is None and cfg.dtype == "float32"


def test_overrides_reach_config_and_tensors(tmp_path):
    path = make_checkpoint(
        tmp_path, rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, dtype="bfloat16", **SMALL
    )
    cfg = read_model_config(path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_type == "linear" and cfg.dtype == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(path / "model.safetensors").values())
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path / "bad", vocab_size=1000)
    with pytest.raises(ValueError):
        make_checkpoint(tmp_path / "bad", "GPT2LMHeadModel")


def test_weights_are_deterministic_per_seed(tmp_path):
    a = load_file(make_checkpoint(tmp_path / "a", seed=3, **SMALL) / "model.safetensors")
    b = load_file(make_checkpoint(tmp_path / "b", seed=3, **SMALL) / "model.safetensors")
    c = load_file(make_checkpoint(tmp_path / "c", seed=4, **SMALL) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


# --- transformers' view ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_everything(small, arch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = small[arch]
    assert AutoConfig.from_pretrained(path).architectures == [arch]
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == arch
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == VOCAB_SIZE
    messages = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}], ids=["untied", "tied"])
def test_default_shape_model_is_decisive(tmp_path, overrides):
    """Greedy decoding must not hinge on float rounding: top-1 and top-2 logits stand apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_checkpoint(tmp_path, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    gaps, outputs = [], []
    for prompt in ("Hello, my name is", "def fibonacci(n):", "The weather today"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(
                ids,
                max_new_tokens=64,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=0,
            )
            hidden = model(out.sequences, output_hidden_states=True).hidden_states
        assert all(torch.isfinite(h).all() for h in hidden)
        gaps += [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        outputs.append(out.sequences[0, ids.shape[1] :].tolist())
    assert statistics.median(gaps) > 0.1  # measured ~0.7; HF's std 0.02 init gives ~1e-4
    assert all(len(set(o)) > 8 for o in outputs)  # not one token (or a short loop) repeated


# --- the default model in the cache -------------------------------------------------------------


def test_ensure_default_model_generates_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / "models" / f"tiny-llama-{TINY_MODEL_VERSION}"
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in DEFAULT_SHAPE} == DEFAULT_SHAPE
    assert {p.name for p in path.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no scratch directory left


def test_ensure_default_model_concurrent_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert [p.name for p in results[0].parent.iterdir()] == [results[0].name]
    assert read_model_config(results[0]).num_layers == 4
