"""The detokenizer stage's Detokenizer: TokenBatch in, TextDeltas out, per ingress and per choice;
stop strings cut the text and name the sequences to finish; logprobs come back as token text."""

from __future__ import annotations

import logging
import random

import pytest
from tokenizers import Tokenizer

from conveyor.stages.detokenizer.detokenizer import STOPPED_MEMORY_STEPS, Detokenizer
from conveyor.stages.detokenizer.token_texts import byte_level_decoding_table
from conveyor.tiny.checkpoint import make_checkpoint
from conveyor.tiny.tokenizer import SPECIAL_TOKEN_IDS
from conveyor.wire.messages import DetokSeq, FinishReason, SeqTokens, TextDelta, TokenBatch, TokenLogprob


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    root = make_checkpoint(
        tmp_path_factory.mktemp("tiny"),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Tokenizer.from_file(str(root / "tokenizer.json"))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def seq(seq_id: int, ingress: int = 0, **kwargs) -> DetokSeq:
    return DetokSeq(seq_id, f"req-{seq_id}", 0, ingress=ingress, prompt_tail=[], num_prompt_tokens=5, **kwargs)


def run_steps(detokenizer: Detokenizer, steps: list[TokenBatch], num_ingress: int = 1):
    """Process each batch; return every delta per ingress and the stopped ids of each batch."""
    deltas: list[list[TextDelta]] = [[] for _ in range(num_ingress)]
    stopped = []
    for batch in steps:
        stopped.append(detokenizer.process(batch, deltas))
    return deltas, stopped


def test_deltas_carry_counts_cached_tokens_and_cumulative_logprob(tok):
    ids = tok.encode("Hello, world! How are you today?", add_special_tokens=False).ids
    first, rest = ids[:2], ids[2:]
    detokenizer = Detokenizer(tok)
    new_seqs = [
        DetokSeq(7, "req-a", 0, ingress=1, prompt_tail=[], num_prompt_tokens=12, num_cached_tokens=8),
        DetokSeq(8, "req-a", 1, ingress=1, prompt_tail=[], num_prompt_tokens=12, num_cached_tokens=8),
        DetokSeq(9, "req-b", 0, ingress=0, prompt_tail=[], num_prompt_tokens=3),
    ]
    updates = [
        SeqTokens(7, first, cumulative_logprob=-0.5),
        SeqTokens(8, first[:1], cumulative_logprob=-0.25),
        SeqTokens(9, first, FinishReason.STOP, cumulative_logprob=-3.0),
    ]
    out: list[list[TextDelta]] = [[], []]
    detokenizer.process(TokenBatch(0, new_seqs, updates), out)

    [b] = out[0]
    assert (b.request_id, b.index, b.finish_reason, b.token_ids) == ("req-b", 0, FinishReason.STOP, first)
    assert (b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens, b.cumulative_logprob) == (3, 2, 0, -3.0)
    a0, a1 = out[1]
    assert (a0.request_id, a0.index, a1.index) == ("req-a", 0, 1)
    assert (a0.num_output_tokens, a0.num_cached_tokens, a0.cumulative_logprob) == (2, 8, -0.5)
    assert (a1.num_output_tokens, a1.num_cached_tokens, a1.cumulative_logprob) == (1, 8, -0.25)
    assert 9 not in detokenizer.seqs  # finished: forgotten

    out = [[], []]
    detokenizer.process(TokenBatch(1, [], [SeqTokens(7, rest, FinishReason.LENGTH, cumulative_logprob=-4.5)]), out)
    [a0_last] = out[1]
    assert a0_last.num_output_tokens == len(ids) and a0_last.num_cached_tokens == 8
    assert a0_last.cumulative_logprob == -4.5 and a0_last.finish_reason is FinishReason.LENGTH
    assert a0.text + a0_last.text == tok.decode(ids)
    assert set(detokenizer.seqs) == {8}


TEXT = "The answer is 42. END OF ANSWER and more"  # " END OF" is the tokens " E", "N", "D", " OF"


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_across_batches_never_leaks_and_finishes_the_sequence(tok, seed, caplog):
    ids = encode(tok, TEXT)
    rng = random.Random(seed)
    steps, i = [TokenBatch(0, [seq(3, stop=[" END OF", "zzz"]), seq(4, ingress=1)], [])], 0
    while i < len(ids):  # random chunks, then the tokens the scheduler sampled before it heard
        n = rng.randint(1, 3)
        steps.append(TokenBatch(len(steps), [], [SeqTokens(3, ids[i : i + n]), SeqTokens(4, ids[i : i + n])]))
        i += n
    steps.append(TokenBatch(len(steps), [], [SeqTokens(3, [], FinishReason.LENGTH)]))
    detokenizer = Detokenizer(tok)
    with caplog.at_level(logging.ERROR):
        (deltas, others), stopped = run_steps(detokenizer, steps, num_ingress=2)

    assert "".join(d.text for d in deltas) == "The answer is 42."
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [FinishReason.STOP]
    assert deltas[-1].stop_reason == " END OF"
    assert encode(tok, " OF")[0] in deltas[-1].token_ids  # the text is cut, the ids stay
    assert [s for s in stopped if s] == [[3]]  # once, in the batch that matched
    assert "".join(d.text for d in others) == TEXT[: len("".join(d.text for d in others))]  # unaffected
    assert not caplog.records  # the tokens in flight after the stop are dropped silently
    assert 3 not in detokenizer.seqs and 3 not in detokenizer.stopped  # forgotten after its last update


def test_sequences_stopping_together_are_reported_together(tok):
    ids = encode(tok, TEXT)
    detokenizer = Detokenizer(tok)
    new = [seq(1, stop=["42"]), seq(2, stop=["answer"]), seq(5, stop=["more"])]
    deltas, stopped = run_steps(detokenizer, [TokenBatch(0, new, [SeqTokens(k, ids[:12]) for k in (1, 2, 5)])])
    assert stopped == [[1, 2]]
    assert [(d.text, d.finish_reason, d.stop_reason) for d in deltas[0]] == [
        ("The answer is ", FinishReason.STOP, "42"),
        ("The ", FinishReason.STOP, "answer"),
        ("The answer is 42. EN", None, None),
    ]


def test_include_stop_str_and_a_stop_in_the_last_update(tok):
    ids = encode(tok, TEXT)
    detokenizer = Detokenizer(tok)
    new = [seq(1, stop=["42."], include_stop_str_in_output=True), seq(2, stop=["ANSWER"])]
    updates = [SeqTokens(1, ids), SeqTokens(2, ids, FinishReason.LENGTH)]
    deltas, stopped = run_steps(detokenizer, [TokenBatch(0, new, updates)])
    assert [(d.text, d.finish_reason, d.stop_reason) for d in deltas[0]] == [
        ("The answer is 42.", FinishReason.STOP, "42."),
        ("The answer is 42. END OF ", FinishReason.STOP, "ANSWER"),  # outranks length
    ]
    assert stopped == [[1]]  # the scheduler already finished 2 on length
    assert not detokenizer.stopped.keys() - {1}


@pytest.mark.parametrize(
    "min_tokens, expected",
    [
        (0, "Hello,"),
        (2, "Hello,"),
        (3, "Hello, world! Hello,"),
        (7, "Hello, world! Hello,"),
        (8, "Hello, world! Hello, world!"),
    ],
)
def test_min_tokens_text_cannot_stop(tok, min_tokens, expected):
    ids = encode(tok, "Hello, world! Hello, world!")  # " world" is the 3rd token and the 8th
    assert tok.decode(ids[:3]) == "Hello, world"
    detokenizer = Detokenizer(tok)
    new = [seq(1, stop=[" world"], min_tokens=min_tokens)]
    deltas, _ = run_steps(detokenizer, [TokenBatch(0, new, [SeqTokens(1, ids, FinishReason.LENGTH)])])
    [delta] = deltas[0]
    assert delta.text == expected


def test_held_text_comes_out_at_a_normal_finish(tok):
    ids = encode(tok, "Hello, world!")
    detokenizer = Detokenizer(tok)
    eot = SPECIAL_TOKEN_IDS["<|eot_id|>"]
    steps = [
        TokenBatch(0, [seq(1, stop=["!!!"])], [SeqTokens(1, ids)]),
        TokenBatch(1, [], [SeqTokens(1, [eot], FinishReason.STOP)]),
    ]
    (deltas,), _ = run_steps(detokenizer, steps)
    assert [d.text for d in deltas] == ["Hello, world", "!"]
    assert deltas[-1].stop_reason is None


def test_an_abort_flushes_the_decoder_and_the_stop_matcher(tok):
    ids = encode(tok, "ok 😊")
    detokenizer = Detokenizer(tok)
    steps = [
        TokenBatch(0, [seq(1, stop=["\ufffd!"]), seq(2)], [SeqTokens(1, ids[:-2]), SeqTokens(2, ids[:-2])]),
        TokenBatch(1, [], [SeqTokens(1, [], FinishReason.ABORT), SeqTokens(2, [], FinishReason.ABORT)]),
    ]
    (deltas,), _ = run_steps(detokenizer, steps)
    assert [d.text for d in deltas] == ["ok ", "ok ", "\ufffd", "\ufffd"]  # as decode() shows 2 of 4 bytes
    assert [d.finish_reason for d in deltas[2:]] == [FinishReason.ABORT] * 2 and not detokenizer.seqs


def test_logprob_tokens_round_trip_to_the_text_bytes(tok):
    text = "emoji 😊 done, café"
    ids = [*encode(tok, text), SPECIAL_TOKEN_IDS["<|eot_id|>"]]
    entries = [TokenLogprob(-0.5 * i, [t, ids[0]], [-0.25 * i, -9.0]) for i, t in enumerate(ids)]
    detokenizer = Detokenizer(tok)
    updates = [SeqTokens(1, ids[:6], logprobs=entries[:6]), SeqTokens(2, ids[:6])]
    steps = [
        TokenBatch(0, [seq(1, logprobs=True), seq(2)], updates),
        TokenBatch(1, [], [SeqTokens(1, ids[6:], FinishReason.STOP, logprobs=entries[6:])]),
    ]
    (deltas,), _ = run_steps(detokenizer, steps)
    [first, plain, last] = deltas
    assert plain.logprobs == []
    logprobs = first.logprobs + last.logprobs
    assert len(logprobs) == len(ids) and [lp.logprob for lp in logprobs] == [e.logprob for e in entries]
    assert b"".join(bytes(lp.bytes) for lp in logprobs[:-1]) == text.encode()
    assert (logprobs[-1].token, logprobs[-1].bytes) == ("<|eot_id|>", list(b"<|eot_id|>"))
    escaped = [lp.token for lp in logprobs if "\\x" in lp.token]
    assert escaped == ["\\xf0", "\\x9f", "\\x98", "\\x8a"]  # the emoji: one byte per token, shown escaped
    for i, lp in zip(ids, logprobs):
        if "\\x" not in lp.token:
            assert lp.token == tok.decode([i], skip_special_tokens=False)
        assert [(t.token, t.bytes) for t in lp.top] == [(lp.token, lp.bytes), (logprobs[0].token, logprobs[0].bytes)]


def test_stopped_ids_are_forgotten_after_a_while(tok):
    detokenizer = Detokenizer(tok)
    run_steps(detokenizer, [TokenBatch(0, [seq(1, stop=["The"])], [SeqTokens(1, encode(tok, TEXT)[:2])])])
    assert list(detokenizer.stopped) == [1]
    run_steps(detokenizer, [TokenBatch(STOPPED_MEMORY_STEPS - 1, [], [])])
    assert list(detokenizer.stopped) == [1]
    run_steps(detokenizer, [TokenBatch(STOPPED_MEMORY_STEPS, [], [])])
    assert not detokenizer.stopped


def test_byte_level_table_is_a_bijection_onto_bytes():
    table = byte_level_decoding_table()
    assert sorted(table.values()) == list(range(256)) and table["Ġ"] == ord(" ") and table["A"] == ord("A")


def test_a_restarted_engine_drops_only_its_own_sequences(tok):
    """Data parallelism: engine e of 2 numbers its sequences e, e + 2, ...; EngineStarted(e) means
    its previous process died, so its sequences get no more tokens; the other engine's go on."""
    ids = encode(tok, TEXT)
    detokenizer = Detokenizer(tok)
    run_steps(detokenizer, [TokenBatch(0, [seq(2)], [SeqTokens(2, ids[:2])], engine=0)])
    run_steps(detokenizer, [TokenBatch(0, [seq(3)], [SeqTokens(3, ids[:2])], engine=1)])
    detokenizer.drop_engine(0, num_engines=2)
    assert set(detokenizer.seqs) == {3}
    deltas, _ = run_steps(detokenizer, [TokenBatch(1, [], [SeqTokens(3, ids[2:4])], engine=1)])
    assert [d.request_id for d in deltas[0]] == ["req-3"]


def test_stop_string_memory_counts_each_engines_own_steps(tok):
    """A sequence that stopped on engine 1 at its step 5 is remembered while engine 0, far ahead
    in its own steps, keeps sending: its late updates are expected, not unknown."""
    ids = encode(tok, TEXT)
    detokenizer = Detokenizer(tok)
    run_steps(detokenizer, [TokenBatch(5, [seq(1, stop=["answer"])], [SeqTokens(1, ids[:12])], engine=1)])
    assert set(detokenizer.stopped) == {1}
    run_steps(detokenizer, [TokenBatch(5 + STOPPED_MEMORY_STEPS + 10, [seq(2)], [SeqTokens(2, ids[:1])], engine=0)])
    assert set(detokenizer.stopped) == {1}
    run_steps(detokenizer, [TokenBatch(5 + STOPPED_MEMORY_STEPS, [], [], engine=1)])
    assert detokenizer.stopped == {}
