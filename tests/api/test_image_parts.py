"""Image parts read from each API's body, without a server: data: URLs decoded or refused, http(s)
URLs checked against the allowed hosts and the public-address rule, and every route's image parts
collected in order, labelled as that route's body names them (stages/ingress/media/urls.py,
chat_messages.py, anthropic/translate.py, responses_api/items.py)."""

from __future__ import annotations

import base64
import json

import pytest

from conveyor.stages.ingress.anthropic.bodies import MessagesBody
from conveyor.stages.ingress.anthropic.translate import generation
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.media.urls import ImageUrl, data_url_bytes, fetch_target, host_listed, is_public
from conveyor.stages.ingress.protocol import decode, parse_chat
from conveyor.stages.ingress.responses_api.bodies import ResponsesBody
from conveyor.stages.ingress.responses_api.items import chat_request, input_items
from conveyor.wire.images import ContentPart

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3  # the ingress never decodes an image: any bytes do
B64 = base64.b64encode(PNG).decode()
AT = "messages[0].content[1]"


def data_url(data: str = B64, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{data}"


def refusal(call, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        call(*args)
    assert e.value.status == 400
    return e.value


def test_a_data_url_gives_its_bytes():
    assert data_url_bytes(ImageUrl(data_url(), AT), 10**6) == PNG
    wrapped = "\n".join(B64[i : i + 76] for i in range(0, len(B64), 76))  # MIME line breaks
    assert data_url_bytes(ImageUrl(data_url(wrapped), AT), 10**6) == PNG
    assert data_url_bytes(ImageUrl(data_url(B64.rstrip("=")), AT), 10**6) == PNG  # padding left out
    assert data_url_bytes(ImageUrl(data_url(media_type="image/jpeg;charset=x"), AT), len(PNG)) == PNG  # exactly at the cap


@pytest.mark.parametrize(
    "url, code, words",
    [
        (data_url(B64[:40] + "*" + B64[41:]), "invalid_image_url", "does not decode"),
        (data_url(B64[:-8] + "====" + B64[-4:]), "invalid_image_url", "does not decode"),
        (f"data:image/png,{B64}", "invalid_image_url", "must be base64"),
        (data_url(media_type="text/html"), "invalid_image_url", "must hold an image"),
        (data_url(""), "invalid_image_url", "no bytes"),
        (data_url(base64.b64encode(PNG + b"x").decode()), "image_too_large", "--max-image-bytes"),
        (data_url(B64 * 4), "image_too_large", "--max-image-bytes"),
    ],
)
def test_a_bad_data_url_is_a_400_naming_its_part(url, code, words):
    error = refusal(data_url_bytes, ImageUrl(url, AT), len(PNG))
    assert (error.param, error.code) == (AT, code)
    assert error.message.startswith(f"{AT}: ") and words in error.message


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://example.com/", "x", "javascript:alert(1)", "http:///a.png"],
)
def test_only_http_urls_are_fetched(url):
    error = refusal(fetch_target, ImageUrl(url, AT), ())
    assert (error.param, error.code) == (AT, "image_url_not_allowed")


def test_allowed_domains_match_a_host_or_its_subdomains():
    domains = ("example.com", "127.0.0.1")
    for url in ("https://example.com/a.png", "http://img.EXAMPLE.com./a.png", "http://a.b.example.com:8080/x", "http://127.0.0.1:9/"):
        assert fetch_target(ImageUrl(url, AT), domains).scheme in ("http", "https")
    for url in ("https://notexample.com/a.png", "https://example.com.evil.org/a.png", "http://localhost/a.png"):
        error = refusal(fetch_target, ImageUrl(url, AT), domains)
        assert error.code == "image_url_not_allowed" and "--allowed-media-domains" in error.message
    assert host_listed("img.example.com", ("example.com",)) and not host_listed("example.com", ("img.example.com",))


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "[::1]", "[::ffff:127.0.0.1]", "[fe80::1]", "0.0.0.0"]
)
def test_an_address_that_is_not_public_is_fetched_only_when_listed(host):
    url = f"http://{host}:8080/a.png"
    error = refusal(fetch_target, ImageUrl(url, AT), ())
    assert error.code == "image_url_not_allowed" and "not a public address" in error.message
    assert fetch_target(ImageUrl(url, AT), (host.strip("[]"),)).port == 8080


def test_public_addresses():
    assert is_public("93.184.215.14") and is_public("2606:4700::1111")
    assert not any(map(is_public, ["127.0.0.1", "10.0.0.1", "100.64.0.1", "224.0.0.1", "::1", "::ffff:10.0.0.1"]))


# --- each route's parts, in order --------------------------------------------------------------


def test_chat_image_parts_keep_their_order_and_name_their_index():
    url = "https://example.com/b.png"
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": data_url()}}],
            },
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": url},  # the string shorthand
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": data_url(), "detail": "low"}},
                ],
            },
        ]
    }
    gen = parse_chat(json.dumps(body).encode(), 1000)
    messages = gen.prompts[0].messages
    assert messages is not None and [m.parts for m in messages[::2]] == [None, None]  # text alone: no parts
    assert messages[1].parts == [ContentPart(text="compare"), ContentPart(image=0)] and messages[1].content == "compare"
    assert messages[3].parts == [ContentPart(image=1), ContentPart(text="and"), ContentPart(image=2)]
    assert messages[3].content == "and"
    assert gen.image_urls == [
        ImageUrl(data_url(), "messages[1].content[1]"),
        ImageUrl(url, "messages[3].content[0]"),
        ImageUrl(data_url(), "messages[3].content[2]"),
    ]
    assert gen.images is None  # until the loader has them


@pytest.mark.parametrize(
    "part, param",
    [
        ({"type": "image_url"}, "messages[0].content[0]"),
        ({"type": "image_url", "image_url": {"detail": "low"}}, "messages[0].content[0].image_url.url"),
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0]"),
        ({"type": "text"}, "messages[0].content[0]"),
    ],
)
def test_a_bad_chat_part_is_named(part, param):
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert refusal(parse_chat, json.dumps(body).encode(), 1000).param == param


def anthropic_gen(messages: list, **body):
    return generation(decode(json.dumps({"model": "m", "max_tokens": 5, "messages": messages} | body).encode(), MessagesBody), 1000)


def b64_block(media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": B64}}


def test_anthropic_image_blocks_become_chat_image_parts_named_as_anthropic_names_them():
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "seen"}, b64_block("image/webp")]}
    url_block = {"type": "image", "source": {"type": "url", "url": "https://example.com/c.gif"}}
    gen = anthropic_gen(
        [
            {"role": "user", "content": [b64_block(), {"type": "text", "text": "look"}]},
            call,
            {"role": "user", "content": [result, url_block, {"type": "text", "text": "and this"}]},
        ],
        system="be brief",
    )
    assert gen.image_urls == [
        ImageUrl(data_url(), "messages[0].content[0]"),
        ImageUrl(data_url(media_type="image/webp"), "messages[2].content[0].content[1]"),
        ImageUrl("https://example.com/c.gif", "messages[2].content[1]"),
    ]
    messages = gen.prompts[0].messages
    assert messages is not None and [m.role for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[1].parts == [ContentPart(image=0), ContentPart(text="look")]
    assert messages[3].parts == [ContentPart(text="seen"), ContentPart(image=1)] and messages[3].content == "seen"
    assert messages[4].parts == [ContentPart(image=2), ContentPart(text="and this")]


@pytest.mark.parametrize(
    "block, param, words",
    [
        (b64_block("image/bmp"), "messages[0].content[0].source.media_type", "image/bmp"),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "messages[0].content[0].source.type", "file"),
        ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "messages[0].content[0].source.data", "data"),
        ({"type": "image", "source": {"type": "url"}}, "messages[0].content[0].source.url", "url"),
        ({"type": "image"}, "messages[0].content[0].source.type", "base64 or url"),
    ],
)
def test_a_bad_anthropic_image_block_is_named(block, param, words):
    error = refusal(anthropic_gen, [{"role": "user", "content": [block]}])
    assert error.param == param and error.message.startswith("messages[0].content[0]: ") and words in error.message


def test_responses_input_images_are_named_by_input_item_and_kept_for_the_next_turn():
    first = decode(
        json.dumps(
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "what"}, {"type": "input_image", "image_url": data_url()}],
                    }
                ]
            }
        ).encode(),
        ResponsesBody,
    )
    stored = input_items(first)
    assert stored[0]["content"] == [
        {"type": "input_text", "text": "what"},
        {"type": "input_image", "image_url": data_url(), "detail": "auto"},
    ]
    chat, parts = chat_request(first, stored)
    assert parts == ["input[0].content[1]"]
    assert chat["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": data_url(), "detail": "auto"}}
    # The next turn goes on from the first: its image is sent again, named by previous_response_id.
    image = {"type": "input_image", "image_url": "https://example.com/d.png"}
    second = decode(json.dumps({"input": [{"role": "user", "content": [image]}]}).encode(), ResponsesBody)
    _, parts = chat_request(second, stored + input_items(second), num_previous=1)
    assert parts == ["previous_response_id", "input[0].content[0]"]


@pytest.mark.parametrize(
    "part, code",
    [({"type": "input_image", "file_id": "file-1"}, "unsupported_image_source"), ({"type": "input_image"}, None)],
)
def test_responses_image_without_url_is_refused(part, code):
    body = decode(json.dumps({"input": [{"role": "user", "content": [part]}]}).encode(), ResponsesBody)
    error = refusal(input_items, body)
    assert (error.param, error.code) == ("input[0].content[0]", code)
