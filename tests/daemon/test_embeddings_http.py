"""/v1/embeddings through the whole daemon on a tiny embedding checkpoint, driven by the official
`openai` SDK (which asks for base64 unless told otherwise), against sentence-transformers on the
same files; the refusals in OpenAI's error shape, and the daemon serving on after them."""

from __future__ import annotations

import openai
import pytest
import torch

from conveyor.tiny.embedding import make_embedding_checkpoint

sentence_transformers = pytest.importorskip("sentence_transformers")

# A daemon of its own (about 45 s on two cores): the slow group (-m slow); the in-process
# tests cover the same behaviour in the default run.
pytestmark = pytest.mark.slow
TEXTS = ["Hello there", "The quick brown fox jumps over the lazy dog " * 3, "Embeddings"]


@pytest.fixture(scope="module")
def path(checkpoints, tmp_path_factory):
    return make_embedding_checkpoint(
        checkpoints["Qwen2ForCausalLM"], tmp_path_factory.mktemp("embed") / "m", pooling="mean", matryoshka=(16,)
    )


@pytest.fixture(scope="module")
def daemon(daemon_factory, path):
    return daemon_factory("--model", str(path), "--num-kv-blocks", "256", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def test_vectors_match_sentence_transformers(client, path):
    model = client.models.list().data[0].id
    for encoding in (openai.NOT_GIVEN, "float"):  # not given: the SDK asks for base64 and decodes it
        out = client.embeddings.create(model=model, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in out.data] == [0, 1, 2] and out.usage.prompt_tokens > 0
        ours = torch.tensor([d.embedding for d in out.data])
        theirs = sentence_transformers.SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True, batch_size=1)
        cos = torch.nn.functional.cosine_similarity(ours, theirs.float(), dim=1)
        assert cos.min().item() > 1 - 1e-4, encoding
    (cut,) = client.embeddings.create(model=model, input=TEXTS[0], dimensions=16).data
    assert len(cut.embedding) == 16 and abs(torch.tensor(cut.embedding).norm().item() - 1) < 1e-5
    ids = client.embeddings.create(model=model, input=[[5, 6, 7], [8]]).data
    assert len(ids) == 2 and len(ids[0].embedding) == 64


def test_refusals_in_openai_shape(daemon):
    for body, param in [
        ({"input": ["x"] * 10_000}, "input"),
        ({"input": "x", "dimensions": 12}, "dimensions"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]:
        r = daemon.post("/v1/embeddings", body)
        assert r.status_code == 400, body
        assert r.json()["error"]["param"] == param, r.json()
    for route, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        r = daemon.post(route, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
    assert daemon.post("/v1/embeddings", {"input": "still here"}).status_code == 200
