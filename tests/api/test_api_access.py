"""A locked-down ingress, over HTTP against a fake engine (ingress_fakes): the API key it asks
for (and the routes it leaves open), the CORS headers a browser sees, and /tokenize and
/detokenize, whose chat template is the server's override."""

from __future__ import annotations

import openai
import pytest
import requests

from conveyor.stages.ingress.cors import Cors
from conveyor.stages.tokenizer.encoder import PromptEncoder
from tests.ingress_fakes import MAX_MODEL_LEN
from tests.ingress_server import MODEL_NAME, assert_error, post, running_server

KEY = "sk-test-key"
GOOD_ORIGIN = "http://good.example"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
COMPLETE = "/v1/completions"


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """A server with an API key, one allowed CORS origin and a chat template override."""
    root = tmp_path_factory.mktemp("locked")
    with running_server(root, api_key=KEY, allowed_origins=(GOOD_ORIGIN,), chat_template=TEMPLATE) as running:
        yield running


def test_api_key(locked):
    url, _, _ = locked
    body = {"prompt": "a", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}, {"Authorization": KEY}):
        error = assert_error(post(url, COMPLETE, body, headers), 401, code="invalid_api_key")
        assert error["type"] == "authentication_error"
    for path in ("/v1/models", "/openapi.json"):
        assert requests.get(url + path, timeout=5).status_code == 401
    assert post(url, "/tokenize", {"prompt": "a"}).status_code == 401
    assert post(url, COMPLETE, body, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert post(url, COMPLETE, body, {"X-Api-Key": KEY}).status_code == 200
    assert requests.get(url + "/v1/models", headers={"X-Api-Key": KEY}, timeout=5).status_code == 200
    for path in ("/health", "/metrics"):
        assert requests.get(url + path, timeout=5).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2).choices[0].text == " t0 t1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_cors(locked, server):
    url, _, _ = locked
    auth = {"X-Api-Key": KEY}
    response = post(url, COMPLETE, {"prompt": "a"}, auth | {"Origin": GOOD_ORIGIN})
    assert response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN and "Origin" in response.headers["Vary"]
    response = post(url, COMPLETE, {"prompt": "a", "stream": True}, auth | {"Origin": GOOD_ORIGIN})
    assert response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN  # set before the stream's headers
    response = post(url, COMPLETE, {"prompt": "a"}, {"Origin": GOOD_ORIGIN})  # a 401 the page may read
    assert response.status_code == 401 and response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    response = requests.options(url + COMPLETE, headers=preflight | {"Origin": GOOD_ORIGIN}, timeout=5)
    assert response.status_code == 204 and response.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    allowed = {h.strip().lower() for h in response.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key"} <= allowed
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    response = requests.options(url + COMPLETE, headers=preflight | {"Origin": "http://evil.example"}, timeout=5)
    assert response.status_code == 403 and "Access-Control-Allow-Origin" not in response.headers
    response = post(url, COMPLETE, {"prompt": "a"}, auth | {"Origin": "http://evil.example"})
    assert response.status_code == 200 and "Access-Control-Allow-Origin" not in response.headers
    open_url = server[0]  # no origins configured: never a CORS header
    response = post(open_url, COMPLETE, {"prompt": "a"}, {"Origin": GOOD_ORIGIN})
    assert "Access-Control-Allow-Origin" not in response.headers
    assert Cors(("*",)).allows("http://anything.example") and not Cors(()).allows(GOOD_ORIGIN)


def test_tokenize_and_detokenize(server, locked):
    url, _, config = server
    encoder = PromptEncoder(config.model.path)
    out = post(url, "/tokenize", {"prompt": "hello world", "model": MODEL_NAME}).json()
    assert out == {"tokens": encoder.encode_prompt("hello world"), "count": len(out["tokens"]), "max_model_len": MAX_MODEL_LEN}
    back = post(url, "/detokenize", {"tokens": out["tokens"], "skip_special_tokens": True}).json()
    assert back == {"prompt": "hello world"}
    assert post(url, "/detokenize", {"tokens": out["tokens"]}).json()["prompt"] == encoder.decode(out["tokens"], False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = post(url, "/tokenize", {"messages": messages}).json()
    assert out["tokens"] == encoder.encode_chat(messages) and out["count"] == len(out["tokens"])
    # The server's chat template override is the one /tokenize (and the tokenizer stage) apply.
    locked_url = locked[0]
    out = post(locked_url, "/tokenize", {"messages": messages}, {"X-Api-Key": KEY}).json()
    assert out["tokens"] == encoder.tokenizer.encode("be brief|hi|", add_special_tokens=False).ids
