"""GGUF files: a tiny random Llama written as GGUF here (F32 and quantized), served through the
Python API, gives transformers' own GGUF loading's greedy output token for token; the tokenizer,
its special tokens and the chat template come through; what cannot be served is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conveyor import LLM, SamplingParams  # noqa: E402
from conveyor.config.errors import ConfigError  # noqa: E402
from conveyor.engine_config import build_engine_config  # noqa: E402
from conveyor.gpu.loading.gguf import ensure_checkpoint  # noqa: E402
from conveyor.gpu.loading.gguf.weights import unpermute  # noqa: E402
from conveyor.stages.tokenizer.encoder import PromptEncoder  # noqa: E402
from conveyor.tiny.checkpoint import CHAT_TEMPLATE, make_checkpoint  # noqa: E402
from tests.conftest import SMALL  # noqa: E402

NUM_TOKENS = 10
PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog, and then " * 3, "a"]
GGML = gguf.GGMLQuantizationType
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_order(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k rows (what its converter writes): each head's halves interleaved pair by pair."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, checkpoint: Path, qtype, arch: str = "llama", rope_freqs: np.ndarray | None = None, encode=None) -> Path:
    """The HF checkpoint as llama.cpp's converter would write it: metadata, tokenizer, tensors
    (matrices in `qtype`, norms in F32, q/k rows in llama.cpp's order). `encode(gguf_name, w)`,
    where given, returns a matrix's (blocks, GGML type) instead, or None for `qtype`."""
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])

    vocab = {**tokenizer["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = sorted(vocab, key=lambda token: vocab[token])
    specials = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"][-1])
    writer.add_add_bos_token(arch == "llama")
    writer.add_chat_template(CHAT_TEMPLATE)

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        w = tensor.float().numpy()
        gguf_name = {
            "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight",
        }.get(name)
        if gguf_name is None:
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"
            if LAYER_PARTS[part] in heads and arch == "llama":  # llama.cpp leaves Qwen2's rows alone
                w = llama_cpp_order(w, heads[LAYER_PARTS[part]])
        encoded = encode(gguf_name, w) if encode is not None and w.ndim == 2 else None
        if encoded is not None:
            writer.add_tensor(gguf_name, encoded[0], raw_shape=encoded[0].shape, raw_dtype=encoded[1])
        elif w.ndim == 1 or qtype == GGML.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
        elif qtype == GGML.Q8_1:  # a type the gguf package cannot quantize or dequantize: any bytes will do
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((w.shape[0], w.shape[1] // block_size * type_size), dtype=np.uint8)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            q = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
    if rope_freqs is not None:  # Llama 3.1's rope scaling, as llama.cpp stores it
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """Llamas untied in F32 and Q4_0 and tied (SmolLM2's layout) in Q8_0, and a Qwen2 in Q8_0
    (q/k/v biases, rows not reordered), each alone in its directory: transformers and conveyor
    read the same file."""
    root = tmp_path_factory.mktemp("gguf")
    untied = make_checkpoint(root / "hf-untied", "LlamaForCausalLM", seed=3, **SMALL)
    tied = make_checkpoint(root / "hf-tied", "LlamaForCausalLM", seed=4, tie_word_embeddings=True, **SMALL)
    qwen2 = make_checkpoint(root / "hf-qwen2", "Qwen2ForCausalLM", seed=5, **SMALL)
    files = {}
    for key, hf, qtype, arch in (
        ("F32", untied, GGML.F32, "llama"),
        ("Q8_0", tied, GGML.Q8_0, "llama"),
        ("Q4_0", untied, GGML.Q4_0, "llama"),
        ("qwen2-Q8_0", qwen2, GGML.Q8_0, "qwen2"),
    ):
        (root / key).mkdir()
        files[key] = write_gguf(root / key / f"tiny-{key}.gguf", hf, qtype, arch)
    return files


class GGUFReference:
    """transformers' own GGUF loading of one file: its tokenizer and its greedy continuation."""

    def __init__(self, file: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        self.model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()

    def greedy(self, ids: list[int], num_tokens: int) -> list[int]:
        ids = list(ids)
        with torch.inference_mode():
            for _ in range(num_tokens):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-num_tokens:]


@pytest.mark.parametrize("key", ["F32", "Q8_0", "Q4_0", "qwen2-Q8_0"])
def test_greedy_matches_transformers_gguf_loading(key, gguf_files):
    file = gguf_files[key]
    ref = GGUFReference(file)
    llm = LLM(str(file), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.config.model.served_name == file.stem
    assert llm.config.model.tie_word_embeddings == (key == "Q8_0")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == ref.tokenizer(prompt).input_ids
        assert out.outputs[0].token_ids == ref.greedy(out.prompt_token_ids, NUM_TOKENS), prompt


def test_the_tokenizer_and_chat_template_come_through(gguf_files):
    file = gguf_files["F32"]
    checkpoint = ensure_checkpoint(file, "float32")
    encoder, ref = PromptEncoder(checkpoint), GGUFReference(file).tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    assert encoder.chat_template == CHAT_TEMPLATE
    assert encoder.encode_chat(messages) == ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = "Hello <|eot_id|> world"
    assert encoder.encode_prompt(text) == ref(text).input_ids and encoder.encode_prompt(text)[0] == 4080  # BOS added
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [4089] and generation["bos_token_id"] == 4080


def test_conversion_is_cached_and_follows_the_file(gguf_files, tmp_path):
    file = tmp_path / "copy.gguf"
    file.write_bytes(gguf_files["F32"].read_bytes())
    first = ensure_checkpoint(file, "float32")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoint(file, "float32") == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert ensure_checkpoint(file, "bfloat16") != first  # another serving dtype, another directory
    os.utime(file, ns=(stamp + 10**9, stamp + 10**9))  # a changed file is converted again
    assert ensure_checkpoint(file, "float32") != first


def test_unpermute_undoes_llama_cpp_row_order():
    w = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)
    assert torch.equal(unpermute(torch.from_numpy(llama_cpp_order(w.numpy(), 6)), 6), w)
    assert not torch.equal(torch.from_numpy(llama_cpp_order(w.numpy(), 6)), w)


def test_llama3_rope_scaling_is_read_from_rope_freqs(gguf_files, tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = Path(gguf_files["F32"]).parent.parent / "hf-untied"
    theta, head_dim = 10000.0, SMALL["hidden_size"] // SMALL["num_attention_heads"]
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = LlamaConfig(**SMALL, rope_parameters=llama3, max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    divisors = (1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim) / scaled).numpy()
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(8.0)  # high and low frequencies
    assert ((divisors > 1.01) & (divisors < 7.99)).any()  # and one between, smoothed
    config = build_engine_config(str(write_gguf(tmp_path / "l3.gguf", hf, GGML.F32, rope_freqs=divisors)), device="cpu").model
    assert dict(config.rope_scaling) == {k: v for k, v in llama3.items() if k != "rope_theta"}
    with pytest.raises(ConfigError, match="not Llama 3.1's rope scaling"):
        build_engine_config(str(write_gguf(tmp_path / "bad.gguf", hf, GGML.F32, rope_freqs=divisors[::-1].copy())), device="cpu")


def test_unsupported_architecture_is_one_line(gguf_files, tmp_path):
    hf = Path(gguf_files["F32"]).parent.parent / "hf-untied"
    file = write_gguf(tmp_path / "gpt2.gguf", hf, GGML.F32, arch="gpt2")
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "--device", "cpu", "--model", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "conveyor: error: unsupported GGUF architecture 'gpt2'; supported: llama, qwen2"


def test_a_type_without_a_dequantizer_is_named(gguf_files, tmp_path):
    hf = Path(gguf_files["F32"]).parent.parent / "hf-untied"
    file = write_gguf(tmp_path / "q8_1.gguf", hf, GGML.Q8_1)
    with pytest.raises(ConfigError, match=r"^cannot dequantize Q8_1 \(tensor '[\w.]+'\): the gguf package has no dequantizer for it$"):
        build_engine_config(str(file), device="cpu")


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="GGUF file .* does not exist"):
        build_engine_config(str(tmp_path / "nowhere.gguf"), device="cpu")
