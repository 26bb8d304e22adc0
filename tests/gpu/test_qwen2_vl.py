"""Qwen2-VL and Qwen2.5-VL end to end (issue 51) on the tiny checkpoints (conveyor/tiny/qwen2_vl.py),
held to transformers' Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration on the
same files: the tokenizer stage's prompt ids (against transformers' tokenizer, chat template and
pad expansion: its Qwen2VLProcessor needs torchvision, which is not here) and greedy generation
token for token through the offline API, with one image, two, a non-square one, none, n = 2, a
prompt chunk ending inside an image, multi-step decoding, preemption, decode graphs (run without
capture on the CPU, through the Triton interpreter) and two tensor-parallel ranks. transformers
computes M-RoPE from `mm_token_type_ids`, which these build from the ids as its processor does.
tests/gpu/test_qwen2_vl_model.py holds the model-level checks (every position's logits)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conveyor import LLM
from conveyor.gpu.step.cuda_graphs import DecodeGraphs
from conveyor.gpu.step.features.vision import VisionStep
from conveyor.tiny.qwen2_vl import make_qwen2_vl
from conveyor.wire.messages import SamplingParams
from tests.gpu.test_tensor_parallel import gloo_rank, rank_runners, run_forked

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
POOL = dict(device="cpu", num_kv_blocks=160, block_size=4)
CLASSES = {"2": "Qwen2VLForConditionalGeneration", "2.5": "Qwen2_5_VLForConditionalGeneration"}


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(tmp_path_factory, version) -> Path:
    return make_qwen2_vl(tmp_path_factory.mktemp(f"qwen{version}-vl"), version=version)


@pytest.fixture(scope="module")
def hf(path, version):
    model, info = getattr(transformers, CLASSES[version]).from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # every weight of the file is one of the model's, and none missing
    return model.eval()


@pytest.fixture(scope="module")
def reference(path, hf):
    """parts -> (prompt ids, greedy output ids) as transformers makes them from the same message."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    images = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    image_token = json.loads((path / "config.json").read_text())["image_token_id"]

    def run(parts: tuple[str | Image.Image, ...], max_tokens: int = 8) -> tuple[list[int], list[int]]:
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
        pictures = [p for p in parts if isinstance(p, Image.Image)]
        inputs: dict[str, torch.Tensor] = {}
        if pictures:
            inputs = dict(images(pictures, return_tensors="pt"))
            counts = (inputs["image_grid_thw"].prod(-1) // 4).tolist()
            pieces = text.split("<|image_pad|>")
            text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:], strict=True))
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if pictures:
            inputs["mm_token_type_ids"] = (ids == image_token).int()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, max_new_tokens=max_tokens, do_sample=False)
        return ids[0].tolist(), out[0, ids.shape[1] :].tolist()

    return run


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), **POOL)


def message(*parts: str | Image.Image) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p} for p in parts]
    return [{"role": "user", "content": content}]


CASES = {
    "one image, non-square": ("look at this", picture(70, 40, 1), "what is it?"),
    "two images": (picture(40, 90, 2), "and", picture(64, 48, 3), "compare them"),
    "text only": ("no picture here, just words",),
    "an image last": ("what is this?", picture(100, 60, 4)),
}


@pytest.mark.parametrize("parts", CASES.values(), ids=CASES.keys())
def test_greedy_output_equals_transformers(reference, llm, parts):
    ids, want = reference(parts)
    out = llm.chat(message(*parts), GREEDY)[0]
    assert out.prompt_token_ids == ids  # the template, the vision markers, the pads' expansion
    assert out.outputs[0].token_ids == want


def test_another_image_changes_the_answer(llm):
    a = llm.chat(message(picture(60, 60, 5), "what is it?"), GREEDY)[0].outputs[0].token_ids
    b = llm.chat(message(picture(60, 60, 6), "what is it?"), GREEDY)[0].outputs[0].token_ids
    assert a != b


def test_n_2_forks_keep_the_images_positions(reference, llm):
    """Each fork decodes at its parent's M-RoPE positions (the layout travels with the fork)."""
    parts = (picture(33, 77, 7), "describe")
    _, want = reference(parts)
    out = llm.chat(message(*parts), SamplingParams(temperature=0.0, max_tokens=8, n=2))[0]
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_a_chunk_may_end_inside_an_image(path, reference):
    """Prompt chunks of 8 tokens cut through a 20-placeholder image: each chunk takes its rows and
    their 3-D positions."""
    parts = ("see", picture(112, 140, 8), "and tell")
    ids, want = reference(parts)
    llm = LLM(str(path), max_num_batched_tokens=8, **POOL)
    out = llm.chat(message(*parts), GREEDY)[0]
    assert out.prompt_token_ids == ids and ids.count(llm.config.model.vision.image_token_id) == 20
    assert out.outputs[0].token_ids == want
    vision = llm.runner.feature(VisionStep)
    assert vision is not None and vision.cache.misses == 1 and vision.cache.hits >= 2


def test_multi_step_windows_advance_the_positions(path, reference):
    """Windows of 4 decode passes: passes after the first take their rows' positions from the host's counts."""
    cases = [(picture(50, 50, 9), "one"), ("two", picture(90, 30, 10), "more words here")]
    want = [reference(parts, max_tokens=12)[1] for parts in cases]
    llm = LLM(str(path), num_scheduler_steps=4, **POOL)
    outs = llm.chat([message(*parts) for parts in cases], SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_preempted_image_prompts_are_computed_again(path, reference):
    cases = [(picture(40 + 7 * i, 60, 20 + i), f"picture {i}?") for i in range(4)]
    want = [reference(parts, max_tokens=24)[1] for parts in cases]
    llm = LLM(str(path), device="cpu", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    outs = llm.chat([message(*parts) for parts in cases], SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.core.scheduler.num_preemptions > 0


def test_decode_graphs_move_each_row_by_its_delta(path, reference, version):
    """The CUDA-graph path without capture (the Triton backend under its interpreter on the CPU):
    decode passes run through the graphs' static buffers, each row's position moved by its
    sequence's M-RoPE delta inside the graph; a text-only request between image ones reads 0."""
    if version != "2":
        pytest.skip("the language model is the same for both versions")
    cases = [(picture(56, 84, 11), "what?"), ("just text",), ("and", picture(84, 56, 12))]
    want = [reference(parts, max_tokens=6)[1] for parts in cases]
    llm = LLM(str(path), attention_backend="triton", **POOL)
    runner = llm.runner
    runner.graphs = DecodeGraphs.from_config(
        runner.config, runner._decode_model(), runner.attn, runner.kv_caches, scratch_block=runner.num_blocks, device=runner.device
    )
    replays = []
    run = runner.graphs.run
    runner.graphs.run = lambda *args: replays.append(args[0].shape[0]) or run(*args)
    outs = llm.chat([message(*parts) for parts in cases], SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert replays  # the decode passes took the graph path
    vision = runner.feature(VisionStep)
    assert vision is not None and vision.graph_shift is not None


def test_the_prefix_cache_hits_a_repeated_image(path, reference):
    parts = ("once more", picture(56, 56, 13), "what is it?")
    _, want = reference(parts)
    llm = LLM(str(path), enable_prefix_caching=True, **POOL)
    first = llm.chat(message(*parts), GREEDY)[0]
    second = llm.chat(message(*parts), GREEDY)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == want
    assert second.num_cached_tokens >= 16  # the image's placeholders (and what follows) came from the prefix cache


def _tp_rank(rank: int, store: str, path: str, out: str) -> None:
    with gloo_rank(rank, 2, store) as tp, rank_runners(tp):
        llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=8, **POOL)
        outs = llm.chat([message(*parts) for parts in TP_CASES], GREEDY)
    Path(out).write_text(json.dumps([o.outputs[0].token_ids for o in outs]))


TP_CASES = [(picture(44, 70, 30), "what is it?"), ("two:", picture(60, 30, 31), picture(30, 60, 32))]


def test_two_tensor_parallel_ranks_answer_as_one(tmp_path, path, llm, version):
    """Each rank runs the replicated tower and its shard of the language model, with the same
    M-RoPE positions; prompt chunks of 8 cut through the images."""
    if version != "2":
        pytest.skip("the language model is the same for both versions")
    want = [o.outputs[0].token_ids for o in llm.chat([message(*parts) for parts in TP_CASES], GREEDY)]
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    run_forked(_tp_rank, [(r, str(tmp_path / "store"), str(path), str(outs[r])) for r in range(2)], 180)
    assert [json.loads(o.read_text()) for o in outs] == [want, want]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_capture_the_delta_and_answer_as_transformers(path, reference, version):
    """On a GPU, float32, CUDA graphs captured as the worker captures them: image requests and a
    text one decode through replays whose rows move by their sequence's M-RoPE delta, and a
    repeated image hits the encoder cache; the answers are transformers' (its fp32 on the CPU)."""
    if version != "2":
        pytest.skip("the language model is the same for both versions")
    cases = [(picture(56, 84, 21), "what?"), ("just text",), ("and", picture(84, 56, 22)), (picture(56, 84, 21), "again?")]
    want = [reference(parts, max_tokens=6)[1] for parts in cases]
    llm = LLM(str(path), **dict(POOL, device="cuda", dtype="float32"))
    assert llm.runner.graphs is not None  # captured, not eager
    outs = llm.chat([message(*parts) for parts in cases], SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == want
