"""wire/stop_rules.py: each rule at its boundaries, the order of the stop reasons, and the same
answers as the formulas the scheduler and the worker each wrote before they shared it."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from conveyor.wire.messages import FinishReason, SamplingParams
from conveyor.wire.stop_rules import stop_reason, stops_on, tokens_left

EOS = frozenset({2, 7})
PROMPT = 5  # prompt tokens in every case below


def test_tokens_left_is_the_nearer_of_max_tokens_and_the_model_length():
    # 5 prompt + 3 outputs = 8 tokens: max_tokens 10 leaves 7, a model length of 20 leaves 12.
    assert tokens_left(SamplingParams(max_tokens=10), 8, PROMPT, 20) == 7
    assert tokens_left(SamplingParams(max_tokens=10), 8, PROMPT, 12) == 4
    assert tokens_left(SamplingParams(max_tokens=None), 8, PROMPT, 12) == 4  # no max_tokens: the model's length alone
    assert tokens_left(SamplingParams(max_tokens=3), 8, PROMPT, 100) == 0  # reached
    assert tokens_left(SamplingParams(max_tokens=3), 9, PROMPT, 100) == -1  # past it (a caller counting ahead)


@pytest.mark.parametrize(
    "max_tokens, max_model_len, num_tokens, expected",
    [
        (4, 100, PROMPT + 3, False),  # one output short of max_tokens
        (4, 100, PROMPT + 4, True),  # exactly max_tokens outputs
        (None, 100, 99, False),  # one short of the model's length
        (None, 100, 100, True),  # exactly the model's length
        (50, 10, 10, True),  # the model's length first
        (1, 100, PROMPT + 1, True),  # a one-token request after its token
    ],
)
def test_length_limit_boundaries(max_tokens, max_model_len, num_tokens, expected):
    """A limit is reached when no token is left (what step_builder asks of a sequence's pending
    draws), and a draw there ends its sequence with LENGTH."""
    params = SamplingParams(max_tokens=max_tokens)
    assert (tokens_left(params, num_tokens, PROMPT, max_model_len) <= 0) is expected
    reason = stop_reason(params, 3, num_tokens, PROMPT, EOS, max_model_len)  # 3: no stop id
    assert reason is (FinishReason.LENGTH if expected else None)


def test_eos_stops_unless_ignored_and_stop_ids_stop_always():
    plain, ignoring = SamplingParams(), SamplingParams(ignore_eos=True, stop_token_ids=[9])
    assert stops_on(plain, 2, 1, EOS) and stops_on(plain, 7, 1, EOS)
    assert not stops_on(plain, 3, 1, EOS)
    assert not stops_on(ignoring, 2, 1, EOS)  # ignore_eos
    assert stops_on(ignoring, 9, 1, EOS)  # a stop token id is not EOS: ignore_eos leaves it
    assert stops_on(SamplingParams(stop_token_ids=[2]), 2, 1, ())  # no EOS ids at all
    assert stops_on(plain, 7, 1, (2, 7))  # the worker's tuple of EOS ids, the scheduler's frozenset


def test_min_tokens_counts_the_token_itself():
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    assert not stops_on(params, 2, 2, EOS) and not stops_on(params, 9, 2, EOS)  # output 2 of at least 3
    assert stops_on(params, 2, 3, EOS) and stops_on(params, 9, 3, EOS)  # output 3: from here on
    assert stops_on(SamplingParams(min_tokens=0), 2, 0, EOS)  # min_tokens 0 never holds a token back


def test_stop_reason_order():
    params = SamplingParams(max_tokens=3, min_tokens=2)
    assert stop_reason(params, 2, PROMPT + 3, PROMPT, EOS, 100) is FinishReason.STOP  # EOS on the last token: STOP
    assert stop_reason(params, 4, PROMPT + 3, PROMPT, EOS, 100) is FinishReason.LENGTH
    assert stop_reason(params, 2, PROMPT + 1, PROMPT, EOS, 100) is None  # EOS before min_tokens: goes on
    assert stop_reason(params, 4, PROMPT + 2, PROMPT, EOS, 100) is None
    assert stop_reason(params, 4, PROMPT + 2, PROMPT, EOS, PROMPT + 2) is FinishReason.LENGTH  # the model's length
    # min_tokens holds EOS back, not the length: a full model ends the sequence anyway.
    held = SamplingParams(max_tokens=None, min_tokens=4)
    assert stop_reason(held, 2, 8, PROMPT, EOS, 8) is FinishReason.LENGTH


def _old_stop_reason(params, token, num_tokens, eos, max_model_len):
    """Sequence.stop_reason and at_length_limit as the scheduler wrote them before."""
    if num_tokens - PROMPT >= params.min_tokens and ((token in eos and not params.ignore_eos) or token in params.stop_token_ids):
        return FinishReason.STOP
    max_tokens = params.max_tokens
    if num_tokens >= max_model_len or (max_tokens is not None and num_tokens - PROMPT >= max_tokens):
        return FinishReason.LENGTH
    return None


def _old_passes_left(params, num_tokens, max_passes, max_model_len):
    """windows.passes_left as written before."""
    left = max_model_len - num_tokens
    if params.max_tokens is not None:
        left = min(left, params.max_tokens - (num_tokens - PROMPT))
    return max(1, min(max_passes, left))


def _old_drafts_left(params, num_tokens, max_model_len):
    """speculation.tokens_left and SpeculationStep._limit's `left` as written before."""
    left = max_model_len - num_tokens - 1
    if params.max_tokens is not None:
        left = min(left, params.max_tokens - (num_tokens - PROMPT) - 1)
    return left


def test_same_answers_as_the_rules_each_side_wrote():
    grid = itertools.product((None, 1, 2, 4), (0, 1, 3), (False, True), ([], [4, 9]))
    for max_tokens, min_tokens, ignore_eos, stop_ids in grid:
        if max_tokens is not None and min_tokens > max_tokens:
            continue  # SamplingParams refuses it
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids)
        counts = itertools.product(range(PROMPT + 1, PROMPT + 7), (PROMPT + 2, PROMPT + 5, 64), range(10))
        for num_tokens, max_model_len, token in counts:
            case = (params, num_tokens, max_model_len, token)
            old = _old_stop_reason(params, token, num_tokens, EOS, max_model_len)
            assert stop_reason(params, token, num_tokens, PROMPT, EOS, max_model_len) == old, case
            # The worker's old check: the stop-id half alone.
            assert stops_on(params, token, num_tokens - PROMPT, EOS) == (
                _old_stop_reason(params, token, num_tokens, EOS, 1 << 30) is FinishReason.STOP
            ), case
            left = tokens_left(params, num_tokens, PROMPT, max_model_len)
            assert max(1, min(4, left)) == _old_passes_left(params, num_tokens, 4, max_model_len), case
            assert left - 1 == _old_drafts_left(params, num_tokens, max_model_len), case


def test_the_rules_and_the_scheduler_import_neither_torch_nor_zmq():
    code = (
        "import sys\n"
        "import conveyor.wire.stop_rules, conveyor.stages.scheduler.scheduler\n"
        "bad = [m for m in ('torch', 'zmq') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
