"""The detokenizer stage's Detokenizer: TokenBatch in, TextDeltas out, per ingress and per choice."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from conveyor.stages.detokenizer.main import Detokenizer
from conveyor.tiny.tokenizer import train_tokenizer
from conveyor.wire.messages import DetokSeq, FinishReason, SeqTokens, TextDelta, TokenBatch


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer()


def test_deltas_carry_counts_cached_tokens_and_cumulative_logprob(tok):
    ids = tok.encode("Hello, world! How are you today?", add_special_tokens=False).ids
    first, rest = ids[:2], ids[2:]
    detokenizer = Detokenizer(tok)
    new_seqs = [
        DetokSeq(7, "req-a", 0, ingress=1, prompt_tail=[], num_prompt_tokens=12, num_cached_tokens=8),
        DetokSeq(8, "req-a", 1, ingress=1, prompt_tail=[], num_prompt_tokens=12, num_cached_tokens=8),
        DetokSeq(9, "req-b", 0, ingress=0, prompt_tail=[], num_prompt_tokens=3),
    ]
    updates = [SeqTokens(7, first, cumulative_logprob=-0.5), SeqTokens(8, first[:1], cumulative_logprob=-0.25),
               SeqTokens(9, first, FinishReason.STOP, cumulative_logprob=-3.0)]
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
