"""Gemma 3 with images end to end (issue 51) on the tiny checkpoint (conveyor/tiny/gemma3_vl.py), held
to transformers' Gemma3ForConditionalGeneration on the same files: the tokenizer stage's prompt ids
(against transformers' own Gemma3Processor: its chat template, the "\\n\\n" + boi + soft tokens +
eoi + "\\n\\n" framing, then the tokenizer; with Gemma3ImageProcessorPil, bit-exact pixels) and
greedy generation token for token through the offline API (transformers generating with
`token_type_ids`: its bidirectional image mask), with one image, two, none, n = 2, a token budget
that would cut an image (the chunk stops before it), a repeated image from the prefix cache (a hit
may end inside the image), preemption, the triton backend's cache layout, and a raw prompt.
tests/gpu/test_gemma3_vl_model.py holds the model-level checks (every position's logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conveyor import LLM
from conveyor.gpu.step.features.vision import VisionStep
from conveyor.stages.tokenizer.images import for_checkpoint
from conveyor.tiny.gemma3_vl import IMAGE_TOKENS, make_gemma3_vl
from conveyor.wire.images import ImageData
from conveyor.wire.messages import SamplingParams
from tests.gpu.test_tensor_parallel import gloo_rank, rank_runners, run_forked

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
POOL = dict(device="cpu", num_kv_blocks=160, block_size=4)


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return make_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"))


@pytest.fixture(scope="module")
def hf(path):
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def processor(path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    images = transformers.Gemma3ImageProcessorPil.from_pretrained(path)
    return transformers.Gemma3Processor(images, tokenizer, chat_template=tokenizer.chat_template, image_seq_length=IMAGE_TOKENS)


@pytest.fixture(scope="module")
def reference(processor, hf):
    """parts -> (prompt ids, greedy output ids) as transformers makes them from the same message."""

    def run(parts: tuple[str | Image.Image, ...], max_tokens: int = 8) -> tuple[list[int], list[int]]:
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
        messages = [{"role": "user", "content": content}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        pictures = [p for p in parts if isinstance(p, Image.Image)] or None
        inputs = processor(text=text, images=pictures, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        ids = inputs["input_ids"]
        return ids[0].tolist(), out[0, ids.shape[1] :].tolist()

    return run


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), **POOL)


def message(*parts: str | Image.Image) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p} for p in parts]
    return [{"role": "user", "content": content}]


CASES = {
    "one image": ("look at this", picture(70, 40, 1), "what is it?"),
    "two images": (picture(40, 90, 2), "and", picture(64, 48, 3), "compare them"),
    "text only": ("no picture here, just words",),
    "an image last": ("what is this?", picture(100, 60, 4)),
}


@pytest.mark.parametrize("parts", CASES.values(), ids=CASES.keys())
def test_greedy_output_equals_transformers(reference, llm, parts):
    ids, want = reference(parts)
    out = llm.chat(message(*parts), GREEDY)[0]
    assert out.prompt_token_ids == ids  # the template, the framing's newlines merged with the text, the soft tokens
    assert out.outputs[0].token_ids == want


def test_the_pixels_are_transformers(path):
    """Gemma3ImageProcessorPil's resize (bilinear), rescale and normalize, bit for bit."""
    import io

    image = picture(97, 41, 5)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    ours = for_checkpoint(path)
    assert ours is not None
    processed = ours.process(ImageData(buffer.getvalue(), "image"))
    want = transformers.Gemma3ImageProcessorPil.from_pretrained(path)(image, return_tensors="np")["pixel_values"][0]
    assert processed.pixels.dtype == np.float32 and np.array_equal(processed.pixels, want)
    assert processed.num_tokens == IMAGE_TOKENS


def test_another_image_changes_the_answer(llm):
    a = llm.chat(message(picture(60, 60, 6), "what is it?"), GREEDY)[0].outputs[0].token_ids
    b = llm.chat(message(picture(60, 60, 7), "what is it?"), GREEDY)[0].outputs[0].token_ids
    assert a != b


def test_n_2(reference, llm):
    parts = (picture(33, 77, 8), "describe")
    _, want = reference(parts)
    out = llm.chat(message(*parts), SamplingParams(temperature=0.0, max_tokens=8, n=2))[0]
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_a_chunk_stops_before_an_image_it_would_cut(path, reference):
    """A budget of 20 tokens would end the first chunk inside the 16-token image: it ends before the
    image, the next chunk takes the whole image, and the answer is transformers'."""
    parts = ("see", picture(50, 80, 9), "and tell")
    ids, want = reference(parts)
    llm = LLM(str(path), max_num_batched_tokens=20, **POOL)
    image_token = llm.config.model.vision.image_token_id
    first = ids.index(image_token)
    assert first < 20 < first + IMAGE_TOKENS  # the budget alone would cut it
    chunks: list[int] = []
    schedule = llm.core.scheduler.schedule

    def recording(*args, **kwargs):
        step = schedule(*args, **kwargs)
        chunks.extend(row.num_tokens for row in step.rows)
        return step

    llm.core.scheduler.schedule = recording
    out = llm.chat(message(*parts), GREEDY)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want
    assert chunks[:2] == [first, 20]  # up to the image, then the image and what follows to the budget


def test_an_image_longer_than_the_budget_is_refused(path):
    llm = LLM(str(path), max_num_batched_tokens=12, **POOL)
    with pytest.raises(ValueError, match="computes in one pass"):
        llm.chat(message(picture(40, 40, 10), "what?"), GREEDY)


def test_the_prefix_cache_may_end_inside_a_repeated_image(path, reference):
    """The second request's cached blocks end inside its image (blocks of 4; the image starts at
    no block boundary): its rows from there attend to the cached ones, computed with the whole
    image, and to the rest of the image in this pass."""
    parts = ("once more", picture(56, 56, 11), "what is it?")
    ids, want = reference(parts)
    llm = LLM(str(path), enable_prefix_caching=True, **POOL)
    first = llm.chat(message(*parts), GREEDY)[0]
    second = llm.chat(message(*parts), GREEDY)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == want
    assert second.num_cached_tokens >= IMAGE_TOKENS


def test_a_cached_prefix_ending_inside_the_image_resumes_in_it(path, reference):
    """Another question after the same picture: the image [9, 25) ends inside a block of 4, whose
    last tokens differ, so the second prompt's cached prefix ends inside the image (at 24) and its
    first chunk computes the image's last row, which attends to the cached rows (computed with the
    whole image) and to itself."""
    a, b = ("what", picture(56, 56, 12), "first question"), ("what", picture(56, 56, 12), "second one")
    want = [reference(parts)[1] for parts in (a, b)]
    llm = LLM(str(path), enable_prefix_caching=True, **POOL)
    outs = [llm.chat(message(*parts), GREEDY)[0] for parts in (a, b)]
    assert [o.outputs[0].token_ids for o in outs] == want
    image_token = llm.config.model.vision.image_token_id
    first = outs[1].prompt_token_ids.index(image_token)
    assert first < outs[1].num_cached_tokens < first + IMAGE_TOKENS


def test_preempted_image_prompts_are_computed_again(path, reference):
    cases = [(picture(40 + 7 * i, 60, 20 + i), f"picture {i}?") for i in range(4)]
    want = [reference(parts, max_tokens=24)[1] for parts in cases]
    llm = LLM(str(path), device="cpu", num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    outs = llm.chat([message(*parts) for parts in cases], SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.core.scheduler.num_preemptions > 0


def test_the_triton_backend_reads_its_cache_for_the_extents(path, reference):
    """The generic extents path over the triton backend's layout (its interpreter on the CPU)."""
    parts = ("and", picture(84, 56, 13), "so?")
    _, want = reference(parts, max_tokens=4)
    llm = LLM(str(path), attention_backend="triton", **POOL)
    assert llm.chat(message(*parts), SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids == want
    vision = llm.runner.feature(VisionStep)
    assert vision is not None and vision.cache.misses == 1


def test_a_raw_prompt_frames_its_marker(path, processor, hf):
    """LLM.generate with the marker in a plain prompt: the processor's ids (BOS added) and answer."""
    text = "<start_of_turn>user\nlook: <start_of_image> what?<end_of_turn>\n<start_of_turn>model\n"
    image = picture(45, 45, 14)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
    llm = LLM(str(path), **POOL)
    got = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert got.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert got.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def _tp_rank(rank: int, store: str, path: str, out: str) -> None:
    with gloo_rank(rank, 2, store) as tp, rank_runners(tp):
        llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=20, **POOL)
        outs = llm.chat([message(*parts) for parts in TP_CASES], GREEDY)
    Path(out).write_text(json.dumps([o.outputs[0].token_ids for o in outs]))


TP_CASES = [(picture(44, 70, 30), "what is it?"), ("two:", picture(60, 30, 31), picture(30, 60, 32))]


def test_two_tensor_parallel_ranks_answer_as_one(tmp_path, path, llm):
    """Each rank runs the replicated tower and its heads of the language model; the generic
    extents path attends over each rank's shard of the cache, and chunks of 20 stop before the
    images they would cut."""
    want = [o.outputs[0].token_ids for o in llm.chat([message(*parts) for parts in TP_CASES], GREEDY)]
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    run_forked(_tp_rank, [(r, str(tmp_path / "store"), str(path), str(outs[r])) for r in range(2)], 180)
    assert [json.loads(o.read_text()) for o in outs] == [want, want]
