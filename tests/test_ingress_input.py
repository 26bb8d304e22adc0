"""Hostile or careless request bodies get a 4xx in the OpenAI error shape, never a 500.

Against the real serve() and a fake engine (ingress_fakes): too many sequences for one request,
bytes that are not UTF-8, JSON nested past the recursion limit, a corrupt gzip body, and a POST
whose Content-Type is not JSON (what a cross-site form could send).
"""

from __future__ import annotations

import pytest

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.protocol import Generation, Prompt, check_num_seqs
from conveyor.wire.messages import SamplingParams
from tests.ingress_fakes import assert_error, post, running_server

GOOD = {"/v1/completions": {"prompt": "ok"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "ok"}]},
        "/tokenize": {"prompt": "ok"}, "/detokenize": {"tokens": [1, 2]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("ingress-input")) as running:
        yield running


@pytest.mark.parametrize("body", [
    {"prompt": ["a", "b", "c"], "n": 100},  # 300 sequences > 256
    {"prompt": [[1], [2], [3]], "n": 2, "best_of": 128},
])
def test_too_many_sequences_is_a_400_naming_the_batch(server, body):
    url, engine, _ = server
    num_requests = len(engine.requests)
    assert_error(post(url, "/v1/completions", body), 400, "prompt", "too_many_sequences")
    assert len(engine.requests) == num_requests  # nothing reached the engine
    assert post(url, "/v1/completions", body | {"n": 1, "best_of": None}).status_code == 200


@pytest.mark.parametrize("num_prompts, n, best_of, param", [
    (1, 100, None, "n"), (1, 10, 100, "best_of"), (1, 100, 100, "n"), (10, 10, None, "prompt"),
])
def test_max_seqs_per_request_names_what_to_lower(num_prompts, n, best_of, param):
    gen = Generation(params=SamplingParams(n=n, best_of=best_of), prompts=[Prompt(text="a")] * num_prompts)
    check_num_seqs(gen, max_seqs=num_prompts * max(n, best_of or 0))  # exactly at the bound: fine
    with pytest.raises(ApiError) as e:
        check_num_seqs(gen, max_seqs=50)
    assert e.value.status == 400 and e.value.param == param and e.value.code == "too_many_sequences"
