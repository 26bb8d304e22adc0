"""Embeddings through the Python API (LLM.embed) on tiny embedding checkpoints in
sentence-transformers' layout, against sentence-transformers itself on the same files: last-token,
mean and first-token pooling, normalized or not, prompts longer than the token budget (pooled
across chunks), Matryoshka dimensions; and the refusals (a generative model asked to embed, an
embedding model asked to generate, dimensions the model was not trained for)."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config.errors import ConfigError
from conveyor.config.pooling import read_pooling
from conveyor.tiny.embedding import make_embedding_checkpoint

sentence_transformers = pytest.importorskip("sentence_transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the warm sun all day long " * 2,
    "Hello",
    "Embeddings put similar texts near each other.",
]


@pytest.fixture(scope="module")
def embedder(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding")
    made: dict[tuple, tuple] = {}

    def get(pooling: str, normalize: bool = True, matryoshka: tuple[int, ...] = ()):
        key = (pooling, normalize, matryoshka)
        if key not in made:
            path = make_embedding_checkpoint(
                checkpoints["LlamaForCausalLM"],
                root / f"{pooling}-{normalize}-{len(matryoshka)}",
                pooling=pooling,
                normalize=normalize,
                matryoshka=matryoshka,
            )
            llm = LLM(str(path), device="cpu", max_num_batched_tokens=16, num_kv_blocks=128, block_size=4)
            made[key] = (llm, sentence_transformers.SentenceTransformer(str(path), device="cpu"))
        return made[key]

    return get


def cosines(ours: list[list[float]], theirs) -> list[float]:
    a, b = torch.tensor(ours), torch.as_tensor(theirs).float()
    return torch.nn.functional.cosine_similarity(a, b, dim=1).tolist()


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("first", False), ("mean", False)])
def test_vectors_match_sentence_transformers(embedder, pooling, normalize):
    llm, reference = embedder(pooling, normalize)
    outputs = llm.embed(TEXTS)
    assert max(len(o.prompt_token_ids) for o in outputs) > 16  # the long text is pooled across chunks
    ours = [o.embedding for o in outputs]
    theirs = reference.encode(TEXTS, convert_to_tensor=True, batch_size=1)
    assert min(cosines(ours, theirs)) > 1 - 1e-4
    torch.testing.assert_close(torch.tensor(ours), theirs.float(), atol=1e-4, rtol=1e-3)
    norms = torch.tensor(ours).norm(dim=1)
    assert torch.allclose(norms, torch.ones(3), atol=1e-5) == normalize


def test_matryoshka_dimensions_cut_then_normalize(embedder):
    llm, reference = embedder("last", True, (8, 16))
    (full,) = llm.embed(TEXTS[2:])
    (cut,) = llm.embed(TEXTS[2:], dimensions=16)
    assert len(full.embedding) == 64 and len(cut.embedding) == 16
    expected = torch.nn.functional.normalize(torch.tensor(full.embedding[:16]), dim=0)
    torch.testing.assert_close(torch.tensor(cut.embedding), expected, atol=1e-5, rtol=1e-4)
    theirs = reference.encode(TEXTS[2:], convert_to_tensor=True, truncate_dim=16, normalize_embeddings=True)
    assert min(cosines([cut.embedding], theirs)) > 1 - 1e-4
    with pytest.raises(ValueError, match="one of 8, 16, 64"):
        llm.embed(TEXTS[2:], dimensions=12)


def test_refusals(embedder, checkpoints, tmp_path):
    llm, _ = embedder("last", True)
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="not trained for truncated vectors"):
        llm.embed("Hello", dimensions=8)
    generative = LLM(str(checkpoints["LlamaForCausalLM"]), device="cpu", num_kv_blocks=32)
    with pytest.raises(ValueError, match="generates text"):
        generative.embed("Hello")
    path = make_embedding_checkpoint(checkpoints["LlamaForCausalLM"], tmp_path / "max", pooling="last")
    settings = (
        (path / "1_Pooling" / "config.json").read_text().replace('"pooling_mode_max_tokens": false', '"pooling_mode_max_tokens": true')
    )
    (path / "1_Pooling" / "config.json").write_text(settings)
    with pytest.raises(ConfigError, match="pooling"):
        read_pooling(path, {})
