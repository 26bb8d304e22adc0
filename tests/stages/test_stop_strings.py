"""StopMatcher: stop strings cut the streamed text, and no part of one ever leaks before the cut."""

from __future__ import annotations

import random

import msgspec
import pytest

from conveyor.stages.detokenizer.stop_strings import StopMatcher
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.protocol import parse_completion
from conveyor.wire.messages import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams


def feed(matcher: StopMatcher, pieces: list[str], num_protected: int = 0) -> list[str]:
    """Every piece's output; the first `num_protected` pieces cannot stop; flush at the end."""
    out = []
    for i, piece in enumerate(pieces):
        out.append(matcher.add(piece, can_stop=i >= num_protected))
        if matcher.is_stopped:
            return out
    out.append(matcher.flush())
    return out


def test_stop_string_spanning_pieces_never_shows():
    matcher = StopMatcher(["###"])
    assert feed(matcher, ["Hello #", "#", "# world"]) == ["Hello ", "", ""]
    assert matcher.stop_reason == "###"


def test_held_prefix_is_released_when_the_text_diverges():
    matcher = StopMatcher(["STOP"])
    assert matcher.add("go ST") == "go "
    assert matcher.add("O") == ""
    assert matcher.add("P!") == ""
    assert matcher.stop_reason == "STOP"
    matcher = StopMatcher(["STOP"])
    assert [matcher.add("go ST"), matcher.add("OR"), matcher.add("Y")] == ["go ", "STOR", "Y"]
    assert not matcher.is_stopped


def test_held_suffix_restarts_inside_itself():
    # "aab": the held "aa" is not a prefix match as a whole, but its tail "a" still is.
    matcher = StopMatcher(["ab"])
    assert [matcher.add("a"), matcher.add("a"), matcher.add("b")] == ["", "a", ""]
    assert matcher.stop_reason == "ab"


def test_include_stop_str_in_output_cuts_after_the_match_and_holds_nothing():
    matcher = StopMatcher(["</s>"], include_in_output=True)
    assert feed(matcher, ["answer </", "s> trailing"]) == ["answer </", "s>"]
    assert matcher.stop_reason == "</s>"


def test_the_first_stop_string_to_complete_wins():
    matcher = StopMatcher(["world", "lo w", "o"])
    assert feed(matcher, ["hel", "lo world"]) == ["he", "ll"]  # "l" may begin "lo w"
    assert matcher.stop_reason == "o"
    # Same end: the longer one, which starts earlier.
    matcher = StopMatcher(["cd", "abcd"])
    assert feed(matcher, ["xabcdy"]) == ["x"]
    assert matcher.stop_reason == "abcd"


def test_text_before_min_tokens_cannot_stop_but_can_begin_a_match():
    matcher = StopMatcher(["ab"])
    assert feed(matcher, ["ab a", "b"], num_protected=1) == ["ab ", ""]
    assert matcher.stop_reason == "ab"
    matcher = StopMatcher(["ab"])
    assert feed(matcher, ["xab", "ab"], num_protected=2) == ["xab", "ab", ""]
    assert not matcher.is_stopped


def test_normal_finish_flushes_held_text():
    matcher = StopMatcher(["\n\nUser:"])
    assert feed(matcher, ["The end.", "\n\nUs"]) == ["The end.", "", "\n\nUs"]
    assert not matcher.is_stopped


def test_unicode_stop_strings():
    matcher = StopMatcher(["😊 ok", "終わり"])
    assert feed(matcher, ["東京😊", " o", "k then"]) == ["東京", "", ""]
    assert matcher.stop_reason == "😊 ok"
    matcher = StopMatcher(["終わり"])
    assert feed(matcher, ["これで終", "わ", "りです"]) == ["これで", "", ""]


def test_empty_and_duplicate_stop_strings_are_ignored():
    matcher = StopMatcher(["", "x", "x"])
    assert feed(matcher, ["abc", "dxe"]) == ["abc", "d"]
    assert matcher.stop != ["", "x", "x"] and matcher.stop == ["x"]


def test_add_after_a_match_is_an_error():
    matcher = StopMatcher(["x"])
    matcher.add("x")
    with pytest.raises(RuntimeError):
        matcher.add("y")


def reference(text: str, stop: list[str], include: bool, num_protected: int) -> tuple[str, str | None]:
    """Whole-text answer: the match with the earliest end past the protected characters."""
    matches = [(i + len(s), -len(s), s) for s in stop for i in range(len(text)) if text.startswith(s, i)]
    matches = [m for m in matches if m[0] > num_protected]
    if not matches:
        return text, None
    end, neg_len, s = min(matches)
    return text[: end if include else end + neg_len], s


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(200))
def test_streaming_matches_the_whole_text_answer_however_split(seed, include):
    rng = random.Random(seed)
    alphabet = "ab😊 "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    num_protected_pieces = rng.randint(0, len(pieces))
    num_protected = sum(len(p) for p in pieces[:num_protected_pieces])

    matcher = StopMatcher(stop, include_in_output=include)
    out = feed(matcher, pieces, num_protected_pieces)
    assert ("".join(out), matcher.stop_reason) == reference(text, stop, include, num_protected)


@pytest.mark.parametrize("seed", range(100))
def test_long_overlapping_stop_strings_match_like_the_whole_text_answer(seed):
    """Stop strings that share prefixes and overlap themselves: deep failure links and branches."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 60)))
    stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 6))]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 20)))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    matcher = StopMatcher(stop)
    out = feed(matcher, pieces)
    assert ("".join(out), matcher.stop_reason) == reference(text, stop, False, 0)


def test_a_200k_character_stop_string_takes_linear_memory():
    """A set of every prefix of a 200,000-character string would be ~20 GB; the automaton is
    a few integers per character, and the held text never exceeds the string."""
    import tracemalloc

    from conveyor.stages.detokenizer.stop_automaton import build

    rng = random.Random(0)
    stop = "".join(rng.choice("ab") for _ in range(200_000))
    build.cache_clear()
    tracemalloc.start()
    try:
        matcher = StopMatcher([stop])
        # The stop string itself, in 7-character pieces, after a near miss that must be released.
        out = [matcher.add("x" + stop[:-1] + "x")]
        out += [matcher.add(stop[i : i + 7]) for i in range(0, len(stop), 7)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        build.cache_clear()
    assert matcher.stop_reason == stop
    assert "".join(out) == "x" + stop[:-1] + "x"
    assert peak < 20 * len(stop) * 4  # ~16 MB; the prefix set took 20 GB


@pytest.mark.parametrize(
    "stop",
    [["s"] * (MAX_STOP_STRINGS + 1), "x" * (MAX_STOP_STRING_CHARS + 1), ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]],
    ids=["too-many", "too-long", "one-too-long"],
)
def test_stop_strings_are_bounded_in_number_and_length(stop):
    """Both the HTTP body (a 400 naming `stop`) and the Python API refuse what is past the bounds."""
    with pytest.raises(ApiError) as e:
        parse_completion(msgspec.json.encode({"prompt": "hi", "stop": stop}), vocab_size=100)
    assert (e.value.status, e.value.param) == (400, "stop")
    with pytest.raises(ValueError, match="^stop "):
        SamplingParams(stop=[stop] if isinstance(stop, str) else stop)
    # At the bounds exactly: accepted.
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)
