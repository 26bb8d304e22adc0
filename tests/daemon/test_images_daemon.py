"""Images through the whole daemon (issue 51), on the tiny LLaVA: the ingress finds the bytes, a
tokenizer process decodes and patches them, the scheduler hands the pixels to the worker with the
sequence, the worker's tower embeds them. The openai SDK's chat and Responses calls, and the
anthropic SDK's, answer as the offline API does on the same weights; a bad image is a 400 naming
its part and the daemon keeps serving."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from conveyor import LLM
from conveyor.tiny.vision import make_llava
from conveyor.wire.messages import SamplingParams
from tests.conftest import Daemon

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MAX_TOKENS = 8


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8))


def png_base64(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_llava(tmp_path_factory.mktemp("llava"))
    daemon = Daemon("--model", str(path))
    try:
        yield path, daemon
    finally:
        daemon.stop()


def test_every_api_answers_with_the_image_as_the_offline_api_does(served):
    path, daemon = served
    image = picture(1)
    offline = LLM(str(path), device="cpu", num_kv_blocks=64)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "what is it?"}]}]
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0].outputs[0].text
    other = picture(2)
    messages[0]["content"][0]["image_pil"] = other
    not_want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0].outputs[0].text
    assert want != not_want  # the image decides the answer, so the comparisons below can fail

    url = "data:image/png;base64," + png_base64(image)
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens > 16  # the image's placeholders count as prompt tokens

    response = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "what is it?"}]}
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )
    assert response.output_text == want

    claude = anthropic.Anthropic(base_url=daemon.url, api_key="none")
    image_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64(image)}}
    message = claude.messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [image_block, {"type": "text", "text": "what is it?"}]}],
        extra_body={"temperature": 0, **extra},
    )
    assert message.content[0].text == want


def test_a_bad_image_is_a_400_naming_its_part_and_serving_goes_on(served):
    _, daemon = served
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                ],
            }
        ],
        "max_tokens": 2,
    }
    r = daemon.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    ok = daemon.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
