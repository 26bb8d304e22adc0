"""StopMatcher: one sequence's stop strings, matched in its streamed text across token boundaries.

The text arrives in pieces (a stop string may span tokens and steps), so a piece is not emitted
as is: the longest suffix of the text that could still grow into a stop string is held back, and
comes out only once the text diverges from every stop string, or at the end of the sequence.
A client therefore never sees part of a stop string that later ends the output. With
`include_in_output` nothing needs holding: a stop string's beginning is output either way.

The match is the stop string that is complete first in the text (the earliest end; of several
ending at the same character, the longest, which starts earliest). It is the same however the
text was split into pieces, so the output does not depend on how tokens were batched.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]  # unique, in order; "" never matches
        self.include_in_output = include_in_output
        # Proper prefixes of the stop strings: the suffixes of the text worth holding back.
        self._prefixes = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        # The last _max_held characters received (context for a match that spans pieces), of
        # which the last _num_held are not emitted yet.
        self._tail = ""
        self._num_held = 0
        self.stop_reason: str | None = None  # the stop string matched, once one has

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, text: str, *, can_stop: bool = True) -> str:
        """Take the next piece of text; return what can be emitted now. When a stop string
        completes in it, `stop_reason` is set and the return value is the last text (up to the
        match, or through it with include_in_output). `can_stop=False` (the sequence has not
        reached min_tokens yet): no stop string may end in this piece, though one may begin."""
        if self.is_stopped:
            raise RuntimeError("the sequence already stopped")
        old, text = len(self._tail), self._tail + text
        emit_from = old - self._num_held
        if can_stop:
            match = self._find(text, old)
            if match is not None:
                start, s = match
                self.stop_reason, self._tail, self._num_held = s, "", 0
                return text[emit_from : start + len(s) if self.include_in_output else start]
        self._num_held = 0 if self.include_in_output else self._longest_held_suffix(text)
        self._tail = text[max(0, len(text) - self._max_held) :]
        return text[emit_from : len(text) - self._num_held]

    def flush(self) -> str:
        """The sequence ended without a match: the held text is plain text after all."""
        text = self._tail[len(self._tail) - self._num_held :]
        self._tail, self._num_held = "", 0
        return text

    def _find(self, text: str, num_old: int) -> tuple[int, str] | None:
        """(start, stop string) of the first match ending after text[:num_old], which was
        searched before (or could not stop)."""
        best: tuple[int, int, str] | None = None  # (end, -length, string)
        for s in self.stop:
            start = text.find(s, max(0, num_old - len(s) + 1))
            if start >= 0:
                key = (start + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[0] + best[1], best[2])

    def _longest_held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_held), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0
