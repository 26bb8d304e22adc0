"""A prompt that cannot fit is refused after encoding about the context's worth of it, not all of it;
one that fits is encoded exactly as before."""

from __future__ import annotations

import pytest

from conveyor.engine_config import build_engine_config
from conveyor.stages.tokenizer.encoder import PromptEncoder
from conveyor.stages.tokenizer.length_limit import CHUNK_CHARS
from conveyor.stages.tokenizer.preparation import Rejected, prepare
from conveyor.tiny.checkpoint import ensure_default_model
from conveyor.wire.messages import ChatMessage, SamplingParams, TokenizeRequest

FOUR_MB = "The quick brown fox jumps over the lazy dog. " * (4 * 2**20 // 45)  # one line


class SpyTokenizer:
    """The real tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def encode_batch_fast(self, texts, **kwargs):
        self.lengths += [len(t) for t in texts]
        return self.tokenizer.encode_batch_fast(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def config():
    return build_engine_config(str(ensure_default_model()))


def request(prompt: str | None = None, content: str | None = None, **params) -> TokenizeRequest:
    messages = None if content is None else [ChatMessage("user", content)]
    return TokenizeRequest("r", 0, SamplingParams(**params), 0.0, prompt=prompt, messages=messages)


@pytest.mark.parametrize(
    "req",
    [request(FOUR_MB), request(content=FOUR_MB), request(content="<|eot_id|>" + FOUR_MB), request(FOUR_MB, max_tokens=5)],
    ids=["prompt", "chat", "chat-with-special-text", "with-max_tokens"],
)
def test_a_4mb_prompt_is_refused_having_encoded_a_bounded_prefix(config, req):
    encoder = PromptEncoder(config.model.path)
    spies = [SpyTokenizer(encoder.tokenizer), SpyTokenizer(encoder._literal_tokenizer())]
    encoder.tokenizer, encoder._literal = spies
    with pytest.raises(Rejected) as e:
        prepare(encoder, config, req)
    # The same 400 as a prompt encoded whole: param and code.
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert "maximum context length is 2048 tokens" in str(e.value)
    lengths = [n for spy in spies for n in spy.lengths]
    assert lengths and max(lengths) <= CHUNK_CHARS
    assert sum(lengths) <= 2048 * 8  # ~4 characters a token: about the context's worth, not 4 MB


def test_a_prompt_that_fits_is_encoded_exactly_as_before(config):
    # ~45 characters a token (the longest tokens are runs of dashes), so the text is far longer
    # than DIRECT_CHARS_PER_TOKEN characters per token: counted in chunks, then encoded whole.
    text = "a" + (" " + "-" * 44) * 1500
    encoder = PromptEncoder(config.model.path)
    expected = encoder.tokenizer.encode(text).ids
    assert len(text) > 6 * 2048 and len(expected) < 2048
    spy = encoder.tokenizer = SpyTokenizer(encoder.tokenizer)
    scheduled = prepare(encoder, config, request(text, max_tokens=None))
    assert scheduled.prompt_token_ids == expected
    assert scheduled.params.max_tokens == 2048 - len(expected)
    assert len(spy.lengths) > 2 and spy.lengths[-1] == len(text)  # counted in chunks, then whole

    ids = prepare(encoder, config, request(content=text, max_tokens=None)).prompt_token_ids
    assert ids == encoder.encode_chat([{"role": "user", "content": text}])  # no limit: encoded whole


def test_the_exact_message_is_kept_when_the_prompt_was_encoded_whole(config):
    """Just over the context, short enough to be encoded directly: the count is exact."""
    encoder = PromptEncoder(config.model.path)
    text = "fox " * 2100
    with pytest.raises(Rejected) as e:
        prepare(encoder, config, request(text, max_tokens=None))
    n = len(encoder.encode_prompt(text))
    assert str(e.value) == f"this model's maximum context length is 2048 tokens; the prompt has {n}"
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
