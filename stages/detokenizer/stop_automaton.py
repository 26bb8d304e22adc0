"""StopAutomaton: an Aho–Corasick automaton over a set of stop strings, built once and shared.

StopMatcher (stop_strings.py) feeds it text one character at a time (`step`). Its state is the
longest suffix of the text so far that is a prefix of some stop string (a node of the trie of
stop strings), and from the state alone come both answers the matcher needs: the longest stop
string that ends at this character (`matched`), and how much of the text's tail could still grow
into a stop string (`held`: what must be held back).

Invariants: memory and time are linear in the total length of the stop strings (the node
numbering that makes it so: `StopAutomaton`); automata are cached by their stop strings
(`build`), so every sample of a request (n, best_of) and every request with the same stop strings
share one, and nothing in one changes after it is built.
"""

from __future__ import annotations

import functools
from array import array
from collections import deque

_NO_CHAR = 0x110000  # past the last code point: `chain` value of a node with no chain child
_ROOT = 0


class StopAutomaton:
    """Nodes are numbered so that almost no edge needs storing: each stop string adds its own chain
    of nodes, numbered consecutively, so a node's child along its chain is the next number, reached
    by the character `chain[node]`. Only the first edge of each chain (where a string leaves the
    part of the trie it shares with earlier strings) is stored, in `branch`; there are at most as
    many as strings. Per node, five 4-byte integers: a 200,000-character stop string is 4 MB, not
    the 20 GB a set of its prefixes would take."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        """`stop`: unique non-empty stop strings."""
        self.stop = stop
        self.depth = array("i", [0])  # [num_nodes] length of the prefix a node stands for
        self.chain = array("i", [_NO_CHAR])  # [num_nodes] code point of the edge to node + 1, the next of its chain
        self.branch: dict[int, int] = {}  # node << 21 | code point -> child; one per string at most
        # [num_nodes] 1 + index in `stop` of the longest stop string ending at this node; 0: none
        self.match = array("i", [0])
        for index, s in enumerate(stop):
            self._insert(index, s)
        self.fail, self.held = self._links()

    def step(self, node: int, code: int) -> int:
        """The state after one more character (its code point)."""
        chain, branch, fail = self.chain, self.branch, self.fail
        while True:
            if chain[node] == code:
                return node + 1
            child = branch.get(node << 21 | code)
            if child is not None:
                return child
            if node == _ROOT:
                return _ROOT
            node = fail[node]

    def matched(self, node: int) -> str | None:
        """The longest stop string that ends where the text reached `node`."""
        index = self.match[node]
        return self.stop[index - 1] if index else None

    def _child(self, node: int, code: int) -> int | None:
        if self.chain[node] == code:
            return node + 1
        return self.branch.get(node << 21 | code)

    def _insert(self, index: int, s: str) -> None:
        node, depth = _ROOT, 0
        # Walk what earlier strings share with this one; the characters left start a new chain.
        while depth < len(s) and (child := self._child(node, ord(s[depth]))) is not None:
            node, depth = child, depth + 1
        if depth < len(s):
            first = len(self.depth)
            self.branch[node << 21 | ord(s[depth])] = first
            self.depth.extend(range(depth + 1, len(s) + 1))
            self.chain.extend(map(ord, s[depth + 1 :]))
            self.chain.append(_NO_CHAR)
            self.match.frombytes(bytes(4 * (len(s) - depth)))
            node = len(self.depth) - 1
        self.match[node] = index + 1  # unique strings: no node ends two of them

    def _links(self) -> tuple[array, array]:
        """Failure links (the next shorter suffix that is a node) in breadth-first order, so the
        shallower nodes a link points to are done first; with them, the longest stop string ending
        at each node and `held`: the depth of the longest suffix that is a proper prefix of a
        stop string (a node with a child), the text a matcher must not emit yet."""
        num_nodes = len(self.depth)
        depth, chain, match, child_of = self.depth, self.chain, self.match, self._child
        fail, held = array("i", bytes(4 * num_nodes)), array("i", bytes(4 * num_nodes))
        branches: dict[int, list[tuple[int, int]]] = {}  # node -> [(code point, child)]
        for key, child in self.branch.items():
            branches.setdefault(key >> 21, []).append((key & 0x1FFFFF, child))
        queue = deque([_ROOT])
        while queue:
            node = queue.popleft()
            children = branches.get(node, [])
            if chain[node] != _NO_CHAR:
                children = [*children, (chain[node], node + 1)]
            held[node] = depth[node] if children else held[fail[node]]
            for code, child in children:
                queue.append(child)
                if node == _ROOT:
                    continue  # fail[child] = _ROOT
                link = fail[node]
                while (target := child_of(link, code)) is None and link != _ROOT:
                    link = fail[link]
                if target is not None:
                    fail[child] = target
                    if not match[child]:
                        match[child] = match[target]
        return fail, held


@functools.lru_cache(maxsize=16)
def build(stop: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stop)
