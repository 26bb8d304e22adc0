"""StopMatcher: one sequence's stop strings, matched in its streamed text across token boundaries.

The text arrives in pieces (a stop string may span tokens and steps), so a piece is not emitted
as is: the longest suffix of the text that could still grow into a stop string is held back, and
comes out only once the text diverges from every stop string, or at the end of the sequence.
A client therefore never sees part of a stop string that later ends the output. With
`include_in_output` nothing needs holding: a stop string's beginning is output either way.

The match is the stop string that is complete first in the text (the earliest end; of several
ending at the same character, the longest, which starts earliest). It is the same however the
text was split into pieces, so the output does not depend on how tokens were batched.

The text goes through a StopAutomaton (stop_automaton.py) one character at a time, so the work
and memory are linear in the text and in the stop strings, however long these are.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.stages.detokenizer.stop_automaton import build


class StopMatcher:
    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]  # unique, in order; "" never matches
        self.include_in_output = include_in_output
        self._automaton = build(tuple(self.stop))
        self._node = 0  # the automaton's state: the text's longest suffix that begins a stop string
        self._held = ""  # the text's tail not emitted yet: at most the longest stop string
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
        automaton, node = self._automaton, self._node
        pending = self._held + text
        for i, code in enumerate(map(ord, text)):
            node = automaton.step(node, code)
            if can_stop and (s := automaton.matched(node)) is not None:
                end = len(self._held) + i + 1  # in `pending`
                self.stop_reason, self._held = s, ""
                return pending[: end if self.include_in_output else end - len(s)]
        self._node = node
        num_held = 0 if self.include_in_output else automaton.held[node]
        self._held = pending[len(pending) - num_held :]
        return pending[: len(pending) - num_held]

    def flush(self) -> str:
        """The sequence ended without a match: the held text is plain text after all."""
        text, self._held, self._node = self._held, "", 0
        return text
