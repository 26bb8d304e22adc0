"""GET /openapi.json: it lists every route the app serves, it is valid OpenAPI, and requests that
schemathesis generates from it (valid bodies, and bodies broken on purpose) never get a 5xx
from the ingress, only answers the document describes."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from conveyor.stages.ingress.app import build_app
from conveyor.stages.ingress.engine_client import EngineClient
from conveyor.wire.messages import REPETITION_PENALTY_RANGE
from tests.ingress_server import running_server

ROUTES = {
    ("get", "/health"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/v1/models"),
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/v1/embeddings"),
    ("post", "/v1/load_lora_adapter"),
    ("post", "/v1/unload_lora_adapter"),
    ("post", "/v1/responses"),
    ("get", "/v1/responses/{response_id}"),
    ("delete", "/v1/responses/{response_id}"),
    ("post", "/v1/responses/{response_id}/cancel"),
    ("get", "/v1/responses/{response_id}/input_items"),
    ("post", "/v1/messages"),
    ("post", "/v1/messages/count_tokens"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def document(server) -> dict:
    url, _, _ = server
    response = requests.get(f"{url}/openapi.json", timeout=5)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("application/json")
    return response.json()


def test_lists_every_route(server, document):
    _, _, config = server
    app = build_app(config, EngineClient(0, tokenizers=[], scheduler=None))
    served = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert served == documented == ROUTES
    for path, fields in (
        ("/v1/completions", {"prompt", "temperature", "logprobs", "echo", "stop", "response_format", "guided_json"}),
        ("/v1/chat/completions", {"messages", "top_logprobs", "logit_bias", "tools", "tool_choice", "structured_outputs"}),
        ("/v1/embeddings", {"input", "dimensions", "encoding_format"}),
        ("/v1/responses", {"input", "instructions", "tools", "text", "previous_response_id", "max_output_tokens"}),
        ("/v1/messages", {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences", "top_k"}),
        ("/v1/messages/count_tokens", {"model", "messages", "system", "tools", "tool_choice"}),
        ("/tokenize", {"prompt", "messages", "tools"}),
        ("/detokenize", {"tokens"}),
    ):
        ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert fields <= set(document["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])
    # The bounds decoding enforces are the published ones.
    temperature = document["components"]["schemas"]["CompletionBody"]["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    penalty = document["components"]["schemas"]["CompletionBody"]["properties"]["repetition_penalty"]["anyOf"][0]
    assert (penalty["minimum"], penalty["maximum"]) == REPETITION_PENALTY_RANGE


def test_document_is_valid_openapi(document):
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(document)
    schema = schemathesis.openapi.from_dict(document)
    assert all(result.ok() for result in schema.get_all_operations())


def test_api_key_is_described(tmp_path):
    with running_server(tmp_path, api_key="k") as (url, _, _):
        document = requests.get(f"{url}/openapi.json", headers={"X-Api-Key": "k"}, timeout=5).json()
    assert set(document["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert "security" not in document["paths"]["/health"]["get"]
    assert document["paths"]["/tokenize"]["post"]["security"] == [{"bearer": []}, {"apiKey": []}]


# Valid requests for every route; broken ones where there is a body to break.
CAMPAIGNS = [(method, path, GenerationMode.POSITIVE) for method, path in sorted(ROUTES)] + [
    (method, path, GenerationMode.NEGATIVE)
    for method, path in sorted(ROUTES)
    if method == "post" and "{" not in path  # a POST on a stored response (cancel) has no body
]


@pytest.mark.parametrize("method, path, mode", CAMPAIGNS)
def test_schemathesis_finds_no_server_error(server, document, method, path, mode):
    url, _, _ = server
    operation = schemathesis.openapi.from_dict(document)[path][method.upper()]

    @settings(
        max_examples=25, deadline=None, database=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case):
        response = case.call(base_url=url, timeout=10)
        case.validate_response(response, checks=CHECKS)

    call()
