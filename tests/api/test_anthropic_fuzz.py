"""Bodies that schemathesis generates from /openapi.json for the Messages routes, with the served
model's name put in (test_openapi.py's campaigns name random models, so most of theirs end in a
404 before translation): every valid body is translated and answered, or refused with a 4xx in
Anthropic's shape, never a 5xx; a 200 is a message, an event stream or a token count."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance, status_code_conformance

from tests.api.anthropic_fakes import check_order, parse_events
from tests.ingress_server import MODEL_NAME

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_generated_bodies_for_the_served_model(server, path):
    url, _, _ = server
    document = requests.get(f"{url}/openapi.json", timeout=5).json()
    operation = schemathesis.openapi.from_dict(document)[path]["POST"]
    num_answered = 0

    @settings(max_examples=40, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def call(case):
        nonlocal num_answered
        case.body["model"] = MODEL_NAME
        response = case.call(base_url=url, timeout=10)
        case.validate_response(response, checks=CHECKS)
        if response.status_code != 200:
            body = response.json()
            assert 400 <= response.status_code < 500 and body["type"] == "error" and set(body["error"]) == {"type", "message"}
            return
        num_answered += 1
        if path.endswith("count_tokens"):
            assert response.json()["input_tokens"] > 0
        elif case.body.get("stream"):
            check_order(parse_events(response.text))
        else:
            message = response.json()
            assert message["type"] == "message" and message["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence")

    call()
    assert num_answered > 0  # some bodies got through translation to an answer
