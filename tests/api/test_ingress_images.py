"""Images through the real ingress, up to the TokenizeRequest the fake engine's tokenizer socket
receives (tests/ingress_fakes.py records them): chat image_url parts (also through the openai SDK),
Responses input_image parts, Anthropic image blocks (through the anthropic SDK), each request's
parts in order and its image bytes equal to the data: URL's. Refusals are 400s in the route's own
error shape naming the part, before the tokenizer sees anything, and the ingress serves on: too
many images, bad base64, a scheme that is not http(s), the counting routes, a text-only model."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest
import requests

from conveyor.config import MediaConfig
from conveyor.wire.images import ContentPart, ImageData
from conveyor.wire.messages import TokenizeRequest
from tests.ingress_server import MODEL_NAME, assert_error, post, running_server

PNGS = [b"\x89PNG\r\n\x1a\n" + bytes([i]) * 64 for i in range(4)]  # the ingress never decodes an image
MAX_IMAGES = 3


def data_url(i: int) -> str:
    return "data:image/png;base64," + base64.b64encode(PNGS[i]).decode()


def image_part(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(i)}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """An ingress whose model takes images, at most MAX_IMAGES a prompt."""
    media = MediaConfig(model_accepts_images=True, limit_mm_per_prompt=f'{{"image": {MAX_IMAGES}}}')
    with running_server(tmp_path_factory.mktemp("vision"), media=media) as running:
        yield running


def last_request(engine, num_before: int) -> TokenizeRequest:
    assert len(engine.requests) == num_before + 1
    return engine.requests[-1]


def chat(content: list, **body) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]} | body


@pytest.mark.parametrize("stream", [False, True])
def test_chat_images_reach_the_tokenizer_in_order(vision, stream):
    url, engine, _ = vision
    n = len(engine.requests)
    content = [image_part(2), text_part("left"), {"type": "image_url", "image_url": data_url(0)}, text_part("right")]
    response = post(url, "/v1/chat/completions", chat(content, stream=stream))
    assert response.status_code == 200, response.text
    req = last_request(engine, n)
    assert req.images == [ImageData(PNGS[2], "messages[1].content[0]"), ImageData(PNGS[0], "messages[1].content[2]")]
    system, user = req.messages or []
    assert system.parts is None and system.content == "be brief"
    assert user.parts == [ContentPart(image=0), ContentPart(text="left"), ContentPart(image=1), ContentPart(text="right")]
    assert user.content == "left\nright"


def test_too_many_images_is_refused_before_any_is_read(vision):
    url, engine, _ = vision
    n = len(engine.requests)
    # The fourth image is one too many; the first is broken, and is not even looked at.
    content = [{"type": "image_url", "image_url": "data:image/png;base64,@@"}, *map(image_part, range(1, 4))]
    error = assert_error(post(url, "/v1/chat/completions", chat(content)), 400, "messages[1].content[3]", "too_many_images")
    assert "at most 3" in error["message"] and "--limit-mm-per-prompt" in error["message"]
    assert len(engine.requests) == n
    assert post(url, "/v1/chat/completions", chat(content[1:])).status_code == 200  # three are fine


@pytest.mark.parametrize(
    "image_url, code",
    [
        ("data:image/png;base64,iVBO%%%", "invalid_image_url"),
        ("data:text/plain;base64,aGk=", "invalid_image_url"),
        ("file:///etc/passwd", "image_url_not_allowed"),
        ("ftp://example.com/a.png", "image_url_not_allowed"),
        ("http://169.254.169.254/latest/meta-data", "image_url_not_allowed"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(vision, image_url, code):
    url, engine, _ = vision
    n = len(engine.requests)
    content = [text_part("see"), image_part(0), {"type": "image_url", "image_url": {"url": image_url}}]
    error = assert_error(post(url, "/v1/chat/completions", chat(content)), 400, "messages[1].content[2]", code)
    assert error["message"].startswith("messages[1].content[2]: ")
    assert len(engine.requests) == n
    assert post(url, "/v1/chat/completions", chat(content[:2])).status_code == 200


def test_the_openai_sdk_sends_images_on_both_routes(vision):
    url, engine, _ = vision
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    n = len(engine.requests)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what"},
                    {"type": "image_url", "image_url": {"url": data_url(1), "detail": "high"}},
                ],
            }
        ],
    )
    assert out.choices[0].message.content
    assert last_request(engine, n).images == [ImageData(PNGS[1], "messages[0].content[1]")]
    first = client.responses.create(
        model=MODEL_NAME,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(3), "detail": "auto"},
                    {"type": "input_text", "text": "what"},
                ],
            }
        ],
    )
    req = last_request(engine, n + 1)
    assert req.images == [ImageData(PNGS[3], "input[0].content[0]")]
    assert (req.messages or [])[0].parts == [ContentPart(image=0), ContentPart(text="what")]
    listed = client.responses.input_items.list(first.id).data[0].to_dict()
    assert listed["content"][0] == {"type": "input_image", "image_url": data_url(3), "detail": "auto"}
    client.responses.create(model=MODEL_NAME, input="and now?", previous_response_id=first.id)  # the image goes again
    assert last_request(engine, n + 2).images == [ImageData(PNGS[3], "previous_response_id")]


def test_responses_refusals_name_the_input_part(vision):
    url, engine, _ = vision
    n = len(engine.requests)
    bad = {"type": "input_image", "image_url": "data:image/png;base64,!"}
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, bad]}], "background": True}
    assert_error(post(url, "/v1/responses", body), 400, "input[0].content[1]", "invalid_image_url")  # a 400, not a failed response
    file_part = {"type": "input_image", "file_id": "file-abc"}
    body = {"input": [{"role": "user", "content": [file_part]}]}
    assert_error(post(url, "/v1/responses", body), 400, "input[0].content[0]", "unsupported_image_source")
    assert len(engine.requests) == n


def test_the_anthropic_sdk_sends_image_blocks(vision):
    url, engine, _ = vision
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    n = len(engine.requests)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNGS[2]).decode()}
    out = client.messages.create(
        model=MODEL_NAME,
        max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what"}, {"type": "image", "source": source}]}],
    )
    assert out.content[0].type == "text"
    req = last_request(engine, n)
    assert req.images == [ImageData(PNGS[2], "messages[0].content[1]")]
    assert (req.messages or [])[0].parts == [ContentPart(text="what"), ContentPart(image=0)]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL_NAME,
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "image", "source": source | {"data": "not base64!"}}]}],
        )
    assert e.value.status_code == 400 and e.value.body["error"]["message"].startswith("messages[0].content[0]: ")
    assert len(engine.requests) == n + 1


def test_anthropic_refusals_take_anthropics_shape(vision):
    url, engine, _ = vision
    n = len(engine.requests)
    source = {"type": "base64", "media_type": "image/tiff", "data": "aGk="}
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}
    response = post(url, "/v1/messages", body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("messages[0].content[0]: ") and "image/tiff" in error["error"]["message"]
    count = post(
        url,
        "/v1/messages/count_tokens",
        body | {"messages": [{"role": "user", "content": [{"type": "image", "source": source | {"media_type": "image/png"}}]}]},
    )
    assert count.status_code == 400 and count.json()["error"]["message"].startswith(
        "messages[0].content[0]: count_tokens counts text only"
    )
    assert len(engine.requests) == n


def test_tokenize_counts_text_only(vision):
    url, _, _ = vision
    body = {"messages": [{"role": "user", "content": [text_part("a"), image_part(0)]}]}
    error = assert_error(post(url, "/tokenize", body), 400, "messages[0].content[1]", "images_not_supported")
    assert "/tokenize counts text only" in error["message"]
    assert post(url, "/tokenize", {"messages": [{"role": "user", "content": [text_part("a")]}]}).status_code == 200


def test_a_text_model_refuses_images_on_every_route(server):
    url, engine, config = server  # conftest's: the tiny text model
    n = len(engine.requests)
    error = assert_error(
        post(url, "/v1/chat/completions", chat([text_part("x"), image_part(0)])), 400, "messages[1].content[1]", "images_not_supported"
    )
    assert error["message"] == f"messages[1].content[1]: the model `{MODEL_NAME}` does not accept images"
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]}
    assert_error(post(url, "/v1/responses", body), 400, "input[0].content[0]", "images_not_supported")
    source = {"type": "url", "url": "https://example.com/a.png"}
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}
    response = post(url, "/v1/messages", body)
    assert response.status_code == 400 and response.json()["error"]["message"].endswith("does not accept images")
    assert len(engine.requests) == n
    assert requests.get(f"{url}/health").status_code == 200
