"""The tokenizer stage's preparation of a request with images (stages/tokenizer/preparation.py):
each image part's marker becomes its run of placeholder tokens, at the offset its ImageInput
names, and a request the worker could not pair with its images is refused before it leaves."""

from __future__ import annotations

import pytest

from conveyor.engine_config import build_engine_config
from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.preparation import Rejected, prepare
from conveyor.tiny.vision import make_llava
from conveyor.wire.images import ContentPart, ImageData
from conveyor.wire.messages import ChatMessage, SamplingParams, TokenizeRequest
from tests.stages.image_files import encode, picture


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = make_llava(tmp_path_factory.mktemp("llava"))
    config = build_engine_config(str(path), device="cpu")
    return config, PromptEncoder.for_engine(config)


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    return encode(picture(*size, seed=seed), "PNG")


def chat(*parts: str | bytes, max_tokens: int | None = 4) -> TokenizeRequest:
    """One user message of text and images (bytes), in order."""
    images = [ImageData(p, f"messages[0].content[{i}]") for i, p in enumerate(parts) if isinstance(p, bytes)]
    content, k = [], 0
    for p in parts:
        if isinstance(p, bytes):
            content.append(ContentPart(image=k))
            k += 1
        else:
            content.append(ContentPart(text=p))
    text = "\n".join(p for p in parts if isinstance(p, str))
    message = ChatMessage("user", text, parts=content)
    return TokenizeRequest("r", 0, SamplingParams(max_tokens=max_tokens), 0.0, messages=[message], images=images)


def test_each_image_becomes_its_run_of_placeholders_at_its_offset(llava):
    config, encoder = llava
    token = encoder.images.image_token_id
    out = prepare(encoder, config, chat("look", png(1), "and", png(2), "compare"))
    assert len(out.images) == 2
    for image in out.images:
        assert image.length > 1
        assert out.prompt_token_ids[image.offset : image.offset + image.length] == [token] * image.length
    first, second = out.images
    assert first.offset + first.length < second.offset  # the text between them stays
    assert out.prompt_token_ids.count(token) == first.length + second.length
    assert first.hash != second.hash


def test_the_same_picture_gets_the_same_hash_whatever_its_encoding(llava):
    config, encoder = llava
    image = picture(40, 30, seed=3)
    a = prepare(encoder, config, chat(encode(image, "PNG"), "what is it"))
    b = prepare(encoder, config, chat(encode(image, "BMP"), "what is it"))
    assert a.images[0].hash == b.images[0].hash
    assert a.prompt_token_ids == b.prompt_token_ids


def test_a_bad_image_is_refused_naming_its_part(llava):
    config, encoder = llava
    with pytest.raises(Rejected) as e:
        prepare(encoder, config, chat("hi", b"not an image at all"))
    assert e.value.param == "messages[0].content[1]"


def test_an_image_token_with_no_image_is_refused(llava):
    config, encoder = llava
    token = encoder.images.image_token_id
    req = TokenizeRequest("r", 0, SamplingParams(max_tokens=2), 0.0, prompt_token_ids=[5, token, 6])
    with pytest.raises(Rejected) as e:
        prepare(encoder, config, req)
    assert e.value.param == "prompt"


def test_placeholders_count_against_the_context(llava):
    config, encoder = llava
    out = prepare(encoder, config, chat(png(1), "hi", max_tokens=None))
    # max_tokens filled in from what the expanded prompt leaves
    assert out.params.max_tokens == config.model.max_model_len - len(out.prompt_token_ids)
    budget = config.model.max_model_len - len(out.prompt_token_ids)
    with pytest.raises(Rejected) as e:
        prepare(encoder, config, chat(png(1), "hi", max_tokens=budget + 1))
    assert e.value.code == "context_length_exceeded"


def test_a_text_model_refuses_images(tmp_path):
    from conveyor.tiny.checkpoint import ensure_default_model

    config = build_engine_config(str(ensure_default_model()), device="cpu")
    encoder = PromptEncoder.for_engine(config)
    assert encoder.images is None
    with pytest.raises(Rejected) as e:
        prepare(encoder, config, chat("hi", png(1)))
    assert e.value.param == "messages[0].content[1]"
