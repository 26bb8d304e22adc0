"""GGUF kept packed: each GGML type's blocks read into QuantizedWeight exactly as the `gguf`
package dequantizes them; K-quant and Q4_1 models served packed give transformers' own GGUF
loading's greedy tokens; the packed layers hold no float weight; tensor parallelism cuts the
packed weights; a truncated file or a malformed tensor is one line naming the tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conveyor import LLM, SamplingParams  # noqa: E402
from conveyor.config.errors import ConfigError  # noqa: E402
from conveyor.config.quant import QuantConfig  # noqa: E402
from conveyor.gpu.backends.cpu.kernels.quant_argmax import QuantArgmax, cpu_quant_argmax  # noqa: E402
from conveyor.gpu.loading.gguf import ensure_checkpoint  # noqa: E402
from conveyor.gpu.loading.loader import load_model  # noqa: E402
from conveyor.gpu.models.layers import Linear  # noqa: E402
from conveyor.gpu.models.registry import read_model_config  # noqa: E402
from conveyor.gpu.quant.formats.gguf import BLOCK_BYTES, GgufScheme  # noqa: E402
from conveyor.gpu.spec.ngram import NgramProposer  # noqa: E402
from conveyor.tiny.checkpoint import make_checkpoint  # noqa: E402
from tests.gpu.test_gguf import PROMPTS, GGUFReference, write_gguf  # noqa: E402

GGML = gguf.GGMLQuantizationType
SCHEME = GgufScheme(QuantConfig("gguf"))
# hidden and intermediate sizes that K-quants' 256-input blocks divide
K_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def k_blocks(w: np.ndarray, qtype, seed: int) -> np.ndarray:
    """Blocks of a K-quant type for a matrix shaped like w, [N, K / 256 * bytes]: random codes
    and sub-scales (the gguf package has no K-quant quantizer), the fp16 super-scales chosen so
    the weights have about w's spread."""
    rng = np.random.default_rng(seed)
    n, k = w.shape
    blocks = rng.integers(0, 256, (n * k // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    spread = float(w.std()) or 0.02

    def half(value: float) -> np.ndarray:
        return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)

    if qtype == GGML.Q6_K:  # d last; int8 sub-scales: (q - 32) * d * sc
        blocks[:, 208:210] = half(spread / 600)
    else:  # d, dmin first: q * d * sc - dmin * m; sc, m in 0..63
        top = 15 if qtype == GGML.Q4_K else 31
        blocks[:, 0:2] = half(spread / (top * 16))
        blocks[:, 2:4] = half(spread / 4)
    return blocks.reshape(n, -1)


def convert(blocks: np.ndarray, qtype, shape: tuple[int, int]):
    parts = {"gguf_blocks": torch.from_numpy(blocks), "gguf_type": torch.tensor([int(qtype)])}
    return SCHEME.convert("blk.0.ffn_up", parts, shape)


@pytest.mark.parametrize("qtype", [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0])
@pytest.mark.parametrize("shape", [(17, 64), (3, 512)])
def test_simple_types_read_exactly_as_gguf_dequantizes(qtype, shape):
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    weight = convert(blocks, qtype, shape)
    assert weight.kind == ("u8" if qtype == GGML.Q8_0 else "u4")
    assert torch.equal(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    assert weight.nbytes < w.nbytes * (0.32 if qtype == GGML.Q8_0 else 0.2)


@pytest.mark.parametrize("qtype", [GGML.Q4_K, GGML.Q5_K, GGML.Q6_K])
def test_k_quants_read_exactly_as_gguf_dequantizes(qtype):
    shape = (5, 768)
    blocks = k_blocks(np.zeros(shape, np.float32) + 0.05, qtype, seed=int(qtype))
    weight = convert(blocks, qtype, shape)
    assert (weight.kind, weight.group_size) == (("u4", 32) if qtype == GGML.Q4_K else ("u8", 16 if qtype == GGML.Q6_K else 32))
    assert torch.equal(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))


def test_a_malformed_or_unpacked_tensor_is_named():
    blocks = gguf.quants.quantize(np.ones((4, 64), np.float32), GGML.Q4_0)
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_up\.gguf_blocks has shape \(4, 36\), not 4 rows of 96 Q4_0"):
        convert(blocks, GGML.Q4_0, (4, 96))
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_up\.gguf_blocks: GGML type 9 is not kept packed"):
        convert(blocks, GGML.Q8_1, (4, 64))


def test_a_truncated_file_names_the_tensor_it_cuts(tmp_path):
    hf = make_checkpoint(tmp_path / "hf", "LlamaForCausalLM", seed=3, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    whole = write_gguf(tmp_path / "whole.gguf", hf, GGML.Q4_0).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(ConfigError, match=r"cut\.gguf'.*truncated: tensor '[\w.]+' ends at byte \d+, the file has \d+"):
        ensure_checkpoint(cut, "float32")


@pytest.fixture(scope="module")
def packed_files(tmp_path_factory) -> dict[str, Path]:
    """A K-quant mix as llama.cpp's Q4_K_M writes it (Q4_K, Q6_K for the down projections and
    the untied head, Q5_K for v) and a tied Q4_1 Llama (SmolLM2's layout but its embedding)."""
    root = tmp_path_factory.mktemp("gguf-packed")
    mix = {"ffn_down": GGML.Q6_K, "output": GGML.Q6_K, "attn_v": GGML.Q5_K}

    def k_mix(name: str, w: np.ndarray):
        part = name.split(".")[-2]
        qtype = mix.get(part, GGML.Q4_K)
        return k_blocks(w, qtype, seed=sum(map(ord, name))), qtype

    files = {}
    hf = make_checkpoint(root / "hf-k", "LlamaForCausalLM", seed=6, **K_SIZES)
    (root / "K_M").mkdir()
    files["K_M"] = write_gguf(root / "K_M" / "tiny-K_M.gguf", hf, GGML.F32, encode=k_mix)
    tied = make_checkpoint(root / "hf-tied", "LlamaForCausalLM", seed=4, tie_word_embeddings=True, **K_SIZES)
    (root / "Q4_1").mkdir()
    files["Q4_1"] = write_gguf(root / "Q4_1" / "tiny-Q4_1.gguf", tied, GGML.Q4_1)
    return files


@pytest.mark.parametrize("key", ["K_M", "Q4_1"])
def test_packed_models_give_transformers_greedy_tokens(key, packed_files):
    file = packed_files[key]
    ref = GGUFReference(file)
    llm = LLM(str(file), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.config.model.quantization == QuantConfig("gguf", '{"quant_method": "gguf"}')
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for out in outputs:
        assert out.outputs[0].token_ids == ref.greedy(out.prompt_token_ids, 8), out.prompt


def test_packed_layers_hold_no_float_weight(packed_files):
    """Every projection, and the tied table with its head, stays packed; only norms are float."""
    config = read_model_config(ensure_checkpoint(packed_files["Q4_1"], "float32"))
    model = load_model(config, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.quantized is not None for m in linears)
    assert model.lm_head.quantized is model.model.embed_tokens.quantized
    floats = sum(p.numel() for p in model.parameters())
    assert floats == config.hidden_size * (2 * config.num_layers + 1)  # the RMSNorm weights
    reference = load_model(read_model_config(ensure_checkpoint(packed_files["Q4_1"], "float32", packed=False)), "cpu")
    for ours, ref in zip(linears, [m for m in reference.modules() if isinstance(m, Linear)]):
        torch.testing.assert_close(ours.quantized.dequantize(), ref.weight, rtol=0, atol=0)


def test_tensor_parallel_cuts_packed_weights(packed_files, tmp_path):
    """Two gloo ranks serve the packed K-quant and tied Q4_1 models with the logits and greedy
    tokens of one process (tests/gpu/test_tensor_parallel.py's harness)."""
    from conveyor.gpu.parallel.group import SINGLE
    from tests.gpu.test_tensor_parallel import run_checkpoints, run_ranks

    checkpoints = {key: str(ensure_checkpoint(file, "float32")) for key, file in packed_files.items()}
    whole = run_checkpoints(SINGLE, checkpoints)
    sharded = run_ranks(2, checkpoints, tmp_path)
    for name in checkpoints:
        torch.testing.assert_close(sharded[name], whole[name], rtol=1e-4, atol=1e-4)
        assert sharded[f"{name} greedy"] == whole[f"{name} greedy"], name


ARGMAX = cpu_quant_argmax()


@pytest.mark.skipif(ARGMAX is None or not ARGMAX.kernel.has_int8, reason="no C++ kernels, or no int8 path (AVX2)")
def test_greedy_draws_that_want_only_their_token_take_the_heads_argmax(packed_files, monkeypatch):
    """Passes of 2 to 16 greedy rows that want nothing but their token (a batch, a verifying
    row's drafts) take the packed head's argmax from one plane of x (QuantArgmax) and decode
    the very tokens of the full logits; a request that wants its logprobs takes the logits."""
    calls: list[int] = []
    real = QuantArgmax.__call__
    monkeypatch.setattr(QuantArgmax, "__call__", lambda self, x, *rest: calls.append(len(x)) or real(self, x, *rest))
    engine = dict(device="cpu", num_kv_blocks=64, max_num_batched_tokens=32)
    logits = LLM(str(packed_files["Q4_1"]), **engine)
    logits.runner.model.lm_head.ops.argmax = None  # the head's product and the sampler's argmax, every pass
    # Every pass drafts: the last token four times (the random model copies nothing from its prompts).
    monkeypatch.setattr(NgramProposer, "lookup", lambda self, histories, limits: [[h[-1]] * n for h, n in zip(histories, limits)])
    drafting = {"method": "ngram", "num_speculative_tokens": 4, "draft_length": "fixed"}
    spec = LLM(str(packed_files["Q4_1"]), speculative_config=drafting, **engine)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [*PROMPTS, "one two three one two three one two"]
    want = [out.outputs[0].token_ids for out in logits.generate(prompts, params)]
    assert not calls
    for batch in ([prompts], [[p] for p in prompts]):  # together, then each alone: a pass of 2+ rows verifies drafts
        before = len(calls)
        got = [out.outputs[0].token_ids for group in batch for out in spec.generate(group, params)]
        assert got == want and len(calls) > before
    assert min(calls) >= 2
    before = len(calls)
    with_logprobs = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0))
    assert [out.outputs[0].token_ids for out in with_logprobs] == want and len(calls) == before
    assert all(out.outputs[0].cumulative_logprob is not None for out in with_logprobs)
