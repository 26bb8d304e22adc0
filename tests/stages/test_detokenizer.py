"""IncrementalDetokenizer: streamed text adds up to decode(), and never shows half a character."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conveyor.stages.detokenizer.incremental import IncrementalDetokenizer
from conveyor.tiny.tokenizer import SPECIAL_TOKEN_IDS, train_tokenizer

EOT = SPECIAL_TOKEN_IDS["<|eot_id|>"]
TEXTS = [
    "Hello, world! How are you today?",
    "東京タワーは日本の有名な建物です。中文也可以。",
    "emoji: 😊🌄👨‍👩‍👧 flags 🇯🇵🇫🇷 done",
    "mixed: café → naïve ∑ x² ≤ 10 😊 ok\n\n\tnext line",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed `ids` in chunks of 1 (or random 1-3 with rng) and collect every step's text."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3) if rng else 1
        chunk = ids[i : i + n]
        i += n
        out.append(detok.step(chunk, final=i >= len(ids)))
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_back_exactly_without_partial_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_characters_spanning_tokens_are_held_until_complete(tok):
    ids = tok.encode("😊", add_special_tokens=False).ids
    assert len(ids) == 4  # one byte per token: the case that needs holding
    detok = IncrementalDetokenizer(tok)
    assert [detok.step([i]) for i in ids] == ["", "", "", "😊"]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_random_token_streams_add_up_to_decode(tok, seed, skip):
    """Random ids (specials and lone UTF-8 bytes included) in random chunks, after random context."""
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    tail = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    pieces = stream(IncrementalDetokenizer(tok, tail, skip_special_tokens=skip), ids, rng)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(20))
def test_random_chunks_of_real_text_never_show_replacement_chars(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(TEXTS) for _ in range(3))
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = stream(IncrementalDetokenizer(tok, rng.sample(ids, 3)), ids, rng)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi there", add_special_tokens=False).ids + [EOT]
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "Hi there"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "Hi there<|eot_id|>"


def test_final_step_flushes_held_bytes_as_decode_shows_them(tok):
    ids = tok.encode("ok 😊", add_special_tokens=False).ids[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids) == "ok "
    assert detok.step([], final=True) == "\ufffd"
    assert tok.decode(ids) == "ok \ufffd"


def test_prompt_cut_inside_a_character_does_not_leak_into_output(tok):
    ids = tok.encode("東", add_special_tokens=False).ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, prompt_tail=ids[:1])
    out = "".join(detok.step([i]) for i in ids[1:]) + detok.step([], final=True)
    assert out == tok.decode(ids[1:])


def test_prompt_tail_gives_sentencepiece_leading_space():
    """With a Metaspace decoder the first decoded token loses its leading space; the prompt
    tail as context keeps it, as the text would read after the prompt."""
    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=60, show_progress=False)
    sp.train_from_iterator(["hello world, hello there world"] * 10, trainer)
    prompt = sp.encode("hello").ids
    output = sp.encode("hello world").ids[len(prompt) :]
    assert sp.decode(output) == "world"  # decoded alone, the space is gone
    detok = IncrementalDetokenizer(sp, prompt_tail=prompt)
    assert "".join(detok.step([i]) for i in output) == " world"
