"""conveyor/tiny/generate.py: the benchmark checkpoint generator, run at the tiny shape (the
Llama-3-8B one is checked by its parameter count on the meta device, without weights), with its
own tokenizer or another's (--tokenizer-from) whose ids the model's vocabulary outnumbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conveyor.gpu.models.registry import read_model_config
from conveyor.tiny.generate import SHAPES, main


def test_generates_a_loadable_bfloat16_checkpoint(tmp_path):
    assert main([str(tmp_path / "bf16"), "--shape", "tiny", "--dtype", "bfloat16", "--seed", "3"]) == 0
    assert main([str(tmp_path / "fp32"), "--shape", "tiny", "--dtype", "float32", "--seed", "3"]) == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["hidden_size"] == SHAPES["tiny"]["hidden_size"]
    assert read_model_config(tmp_path / "bf16").dtype == "bfloat16"

    # Cast tensor by tensor as drawn: the same numbers as the float32 checkpoint, rounded once.
    bf16, fp32 = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(tmp_path / "fp32" / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16


def test_llama3_8b_shape_has_its_parameter_count():
    shape = {k: v for k, v in SHAPES["llama3-8b"].items() if k != "rope_theta"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def small_tokenizer(root: Path, num_added: int = 0) -> Path:
    """A checkpoint folder holding only a tokenizer: a 300-id byte-level BPE (plus `num_added`
    added tokens) and a config.json naming its special ids, as --tokenizer-from reads them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the river runs past the old mill and under the stone bridge"] * 20, trainer)
    tokenizer.add_tokens([f"<extra{i}>" for i in range(num_added)])
    root.mkdir()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return root


def test_another_tokenizer_serves_the_ids_past_its_vocabulary(tmp_path):
    """The sharegpt-500 checkpoint's case at the tiny shape: a 4096-id model over a tokenizer of
    fewer ids. With ignore_eos a random model emits ids the tokenizer has no text for; they count
    as tokens, decode to nothing (vLLM's detokenizer gives "" too) and fail no request."""
    source = small_tokenizer(tmp_path / "source")
    ckpt = tmp_path / "ckpt"
    assert main([str(ckpt), "--shape", "tiny", "--dtype", "float32", "--tokenizer-from", str(source)]) == 0
    assert (ckpt / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    assert not (ckpt / "chat_template.jinja").exists()  # the tiny model's would name tokens this one lacks
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (SHAPES["tiny"]["vocab_size"], 0, 1)
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    num_ids = tokenizer.get_vocab_size()

    from conveyor import LLM, SamplingParams

    llm = LLM(str(ckpt), device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    (out,) = llm.generate(["the river runs past the mill"], params)[0].outputs
    assert out.finish_reason == "length" and len(out.token_ids) == 48
    assert any(i >= num_ids for i in out.token_ids)  # ~93% of the model's ids have no text
    assert out.text == tokenizer.decode([i for i in out.token_ids if i < num_ids])
    assert [entry.token == "" and entry.bytes == [] for entry in out.logprobs] == [i >= num_ids for i in out.token_ids]


def test_a_tokenizer_larger_than_the_shapes_vocabulary_is_refused(tmp_path):
    source = small_tokenizer(tmp_path / "source", num_added=SHAPES["tiny"]["vocab_size"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "ckpt"), "--shape", "tiny", "--tokenizer-from", str(source)])
    assert not (tmp_path / "ckpt").exists()  # refused before any weights are written


def test_llava_tiny_is_a_vision_checkpoint_transformers_loads_offline(tmp_path):
    assert main(["--shape", "llava-tiny", "--dtype", "bfloat16", str(tmp_path)]) == 0
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index
    assert transformers.CLIPImageProcessorPil.from_pretrained(tmp_path).crop_size["height"] == model.config.vision_config.image_size
    config = read_model_config(tmp_path)
    assert config.vision is not None and config.vision.image_token_id == model.config.image_token_index
    with pytest.raises(SystemExit):
        main(["--shape", "llava-tiny", "--no-weights", str(tmp_path / "none")])
