"""LLaVA-1.5 (issue 51) on the tiny checkpoint (conveyor/tiny/vision.py), held to transformers on
the same files: the tower and projector (`encode_images`), the tokenizer stage's prompt and pixels
(against transformers' LlavaProcessor), and greedy generation token for token through the offline
API, with one image, two, none, a prompt chunk ending inside an image, n = 2, and the encoder and
prefix caches hitting on a repeated image."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from conveyor import LLM
from conveyor.gpu.step.features.vision import VisionStep
from conveyor.tiny.vision import make_llava
from conveyor.wire.messages import SamplingParams
from tests.gpu.test_tensor_parallel import gloo_rank, rank_runners, run_forked

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
POOL = dict(device="cpu", num_kv_blocks=128, block_size=4)


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return make_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(path):
    return transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def processor(path):
    """transformers' own LLaVA processor, with the PIL image processor (torchvision is not here)."""
    return transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessorPil.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=(path / "chat_template.jinja").read_text(),
    )


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), **POOL)


def message(*parts: str | Image.Image) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p} for p in parts]
    return [{"role": "user", "content": content}]


def reference(hf, processor, parts: tuple[str | Image.Image, ...], max_tokens: int = 8) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) as transformers makes them from the same message."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [p for p in parts if isinstance(p, Image.Image)] or None
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids) :].tolist()


def test_the_tower_and_projector_equal_transformers(path, hf, llm):
    images = transformers.CLIPImageProcessorPil.from_pretrained(path)
    pixels = images([picture(70, 40, 1), picture(56, 56, 2)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=pixels)
        want = want.pooler_output if hasattr(want, "pooler_output") else want
        got = llm.runner.model.encode_images(list(pixels), [[], []])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.reshape(g.shape), atol=1e-5, rtol=1e-5)


CASES = {
    "one image, non-square": ("look at this", picture(70, 40, 1), "what is it?"),
    "two images": (picture(40, 90, 2), "and", picture(64, 48, 3), "compare them"),
    "text only": ("no picture here, just words",),
}


@pytest.mark.parametrize("parts", CASES.values(), ids=CASES.keys())
def test_greedy_output_equals_transformers(hf, processor, llm, parts):
    ids, want = reference(hf, processor, parts)
    out = llm.chat(message(*parts), GREEDY)[0]
    assert out.prompt_token_ids == ids  # the template, the markers' expansion
    assert out.outputs[0].token_ids == want


def test_another_image_changes_the_answer(llm):
    a = llm.chat(message(picture(60, 60, 4), "what is it?"), GREEDY)[0].outputs[0].token_ids
    b = llm.chat(message(picture(60, 60, 5), "what is it?"), GREEDY)[0].outputs[0].token_ids
    assert a != b


def test_a_chunk_may_end_inside_an_image(path, hf, processor):
    """Prompt chunks of 8 tokens cut through the image's 16 placeholders: it is encoded once and
    each chunk takes its rows."""
    parts = ("see", picture(50, 80, 6), "and tell")
    ids, want = reference(hf, processor, parts)
    llm = LLM(str(path), max_num_batched_tokens=8, **POOL)
    out = llm.chat(message(*parts), GREEDY)[0]
    assert out.outputs[0].token_ids == want
    vision = llm.runner.feature(VisionStep)
    assert vision is not None and (vision.cache.misses, vision.cache.hits) == (1, 2)  # 16 rows over three chunks


def test_n_2_draws_the_same_greedy_answer_twice(hf, processor, llm):
    parts = (picture(33, 77, 7), "describe")
    _, want = reference(hf, processor, parts)
    out = llm.chat(message(*parts), SamplingParams(temperature=0.0, max_tokens=8, n=2))[0]
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_a_repeated_image_hits_the_encoder_and_prefix_caches(path, hf, processor):
    parts = ("once more", picture(48, 48, 8), "what is it?")
    _, want = reference(hf, processor, parts)
    llm = LLM(str(path), enable_prefix_caching=True, **POOL)
    first = llm.chat(message(*parts), GREEDY)[0]
    second = llm.chat(message(*parts), GREEDY)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == want
    assert second.num_cached_tokens >= 16  # the image's placeholders came from the prefix cache
    other = llm.chat(message("once more", picture(48, 48, 9), "what is it?"), GREEDY)[0]
    # Another picture shares the text before it, not the image's blocks.
    assert other.num_cached_tokens < first.prompt_token_ids.index(llm.config.model.vision.image_token_id) + 4


def test_the_module_layout_loads_the_same(tmp_path, path, llm):
    """transformers' module names (model.language_model.*, model.vision_tower.*, lm_head.*) load
    as its save names do."""
    renamed = tmp_path / "module-layout"
    renamed.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    names = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
        "vision_tower.vision_model.": "model.vision_tower.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    out = {}
    for k, v in tensors.items():
        new = next((n + k[len(o) :] for o, n in names.items() if k.startswith(o)), k)
        out[new] = v
    save_file(out, renamed / "model.safetensors")
    parts = (picture(45, 45, 10), "hi")
    want = llm.chat(message(*parts), GREEDY)[0].outputs[0].token_ids
    assert LLM(str(renamed), **POOL).chat(message(*parts), GREEDY)[0].outputs[0].token_ids == want


def test_generate_takes_vllms_prompt_dict(hf, processor, llm):
    image = picture(52, 61, 11)
    ids, want = reference(hf, processor, (image, "what is it?"))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}], add_generation_prompt=True
    )
    text = text.removeprefix("<|begin_of_text|>")  # a plain prompt gets its BOS from the tokenizer, as in vLLM
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == want
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": text, "multi_modal_data": {"audio": b"x"}}, GREEDY)
    with pytest.raises(ValueError, match="not URLs"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}], GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": b"not an image"}]}], GREEDY)


def test_preempted_image_prompts_are_computed_again_from_their_pixels(path, hf, processor):
    """A pool too small for every request at once: sequences are preempted and recomputed, their
    images re-sent with them (NewSeq.images) and re-embedded."""
    cases = [(picture(40 + 7 * i, 60, 20 + i), f"picture {i}?") for i in range(4)]
    want = [reference(hf, processor, parts, max_tokens=24)[1] for parts in cases]
    llm = LLM(str(path), device="cpu", num_kv_blocks=26, block_size=4, max_num_batched_tokens=64)
    outs = llm.chat([message(*parts) for parts in cases], SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.core.scheduler.num_preemptions > 0


def _tp_rank(rank: int, store: str, path: str, out: str) -> None:
    with gloo_rank(rank, 2, store) as tp, rank_runners(tp):
        llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=8, **POOL)
        outs = llm.chat([message(*parts) for parts in TP_CASES], GREEDY)
    Path(out).write_text(json.dumps([o.outputs[0].token_ids for o in outs]))


TP_CASES = [(picture(44, 70, 30), "what is it?"), ("two:", picture(60, 30, 31), picture(30, 60, 32))]


def test_two_tensor_parallel_ranks_answer_as_one(tmp_path, path, llm):
    """Each rank runs the replicated tower and its shard of the language model; prompt chunks of
    8 cut through the images."""
    want = [o.outputs[0].token_ids for o in llm.chat([message(*parts) for parts in TP_CASES], GREEDY)]
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    run_forked(_tp_rank, [(r, str(tmp_path / "store"), str(path), str(outs[r])) for r in range(2)], 180)
    assert [json.loads(o.read_text()) for o in outs] == [want, want]
