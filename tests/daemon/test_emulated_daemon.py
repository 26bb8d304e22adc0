"""The whole daemon on an emulated H100 (`--device emulated`): every stage runs for real on a
Llama-3-8B-shaped config with no weights; the device's passes are modelled.

What must hold, with a model or without: answers are deterministic per request and the same
whatever the batch, the stream, multi-step windows or tensor parallelism; lengths, n and stop
strings behave as with a model; a JSON schema still constrains the ids; and everything that shows
the device says it is emulated.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from conveyor.tiny.checkpoint import make_config
from conveyor.tiny.generate import SHAPES
from tests.conftest import Daemon, stream_events

PROMPTS = [f"Tell me about the river number {i}." for i in range(12)]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    return make_config(tmp_path_factory.mktemp("llama3-8b"), dtype="bfloat16", **SHAPES["llama3-8b"])


@pytest.fixture(scope="module")
def daemons(shape):
    started: dict[str, Daemon] = {}

    def get(name: str, *args: str) -> Daemon:
        if name not in started:
            started[name] = Daemon("--model", str(shape), "--device", "emulated", *args)
        return started[name]

    yield get
    for d in started.values():
        d.stop()


def complete(daemon: Daemon, prompt: str, **body) -> dict:
    r = daemon.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, **body})
    assert r.status_code == 200, r.text
    return r.json()


def texts(daemon: Daemon, **body) -> list[str]:
    """Each prompt's answer, the prompts sent concurrently."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(daemon, p, **body), PROMPTS))
    return [a["choices"][0]["text"] for a in answers]


def test_it_says_it_is_emulated(daemons):
    d = daemons("k1")
    complete(d, "x", max_tokens=2)
    (card,) = requests.get(f"{d.url}/v1/models", timeout=10).json()["data"]
    assert card["emulated_device"] == "h100"
    assert "EMULATED device: h100" in d.output()
    metrics = requests.get(f"{d.url}/metrics", timeout=10).text
    assert 'conveyor_worker_busy_seconds_total{device="emulated-h100",engine="0"}' in metrics


def test_answers_are_deterministic_whatever_the_batch(daemons):
    d = daemons("k1")
    alone = [complete(d, p)["choices"][0]["text"] for p in PROMPTS[:3]]
    concurrent = texts(d)
    assert concurrent[:3] == alone and len(set(concurrent)) == len(PROMPTS)
    assert texts(d) == concurrent


def test_lengths_n_and_streaming(daemons):
    d = daemons("k1")
    answer = complete(d, PROMPTS[0], n=2, max_tokens=9)
    assert answer["usage"]["completion_tokens"] == 18
    first, second = (c["text"] for c in answer["choices"])
    assert first != second and all(c["finish_reason"] == "length" for c in answer["choices"])
    assert first == complete(d, PROMPTS[0], max_tokens=9)["choices"][0]["text"]
    r = d.post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 9, "stream": True})
    events = [e for e in stream_events(r) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == first and len(events) > 1


def test_a_stop_string_ends_the_answer_where_the_text_holds_it(daemons):
    d = daemons("k1")
    full = complete(d, PROMPTS[1], max_tokens=30)["choices"][0]["text"]
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip() and full[i : i + 2] not in full[: i + 1])
    cut = complete(d, PROMPTS[1], max_tokens=30, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full[: full.index(stop)]


def test_a_json_schema_constrains_the_ids(daemons):
    d = daemons("k1")
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for prompt in PROMPTS[:4]:
        choice = complete(d, prompt, max_tokens=200, response_format=response_format)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_the_answer_waits_for_the_modelled_device(daemons):
    """24 decode passes of an 8B model on an H100 read its 16 GB of weights each: an answer
    cannot come sooner than 24 x 6 ms, however fast the host (a floor, not a speed target)."""
    d = daemons("k1")
    started = time.perf_counter()
    complete(d, "A fresh prompt, never cached.", max_tokens=24)
    assert time.perf_counter() - started >= 24 * 16.06e9 / (3.35e12 * 0.8)


@pytest.mark.parametrize("variant", [("k8", "--num-scheduler-steps", "8"), ("tp2", "--tensor-parallel-size", "2")])
def test_multi_step_and_tensor_parallel_give_the_same_answers(daemons, variant):
    name, *args = variant
    reference = texts(daemons("k1"))
    assert texts(daemons(name, *args)) == reference
    n2 = complete(daemons(name, *args), PROMPTS[0], n=2, max_tokens=9)["choices"]
    assert [c["text"] for c in n2] == [c["text"] for c in complete(daemons("k1"), PROMPTS[0], n=2, max_tokens=9)["choices"]]
