"""Verification of draft tokens: which of a row's drafts the target model accepts.

A row that verifies d drafts x_1..x_d computes d + 1 positions in one pass, and each position j
is drawn exactly as an ordinary decode would draw output n + j (gpu/sampling: the request's
penalties over the history with x_1..x_j in it, its temperature, top-k, top-p, min-p, and for a
seeded request the uniform of (seed, n + j, choice)). The row keeps draws y_0..y_a, where a is
the number of leading positions with y_j == x_{j+1}.

Why that is exact (the target distribution, not an approximation): every proposer here is
deterministic, a draft is one token with probability 1. Rejection sampling with such a draft
accepts x with probability p(x) and otherwise draws from p with x removed, renormalised. Drawing
y ~ p and accepting when y == x does the same: P(y == x) = p(x), and given y != x, y is
distributed as p without x. Then y_0..y_a is a draw from the target's own chain, token by token,
and a seeded request gets the very tokens it gets without speculation (the same uniforms at the
same output indices), up to the arithmetic of a pass of several rows. Greedy rows are the case
where every draw is the argmax: the longest matching prefix.
"""

from __future__ import annotations


def accepted_length(drafts: list[int], drawn: list[int]) -> int:
    """drafts x_1..x_d, drawn y_0..y_d (one per verified position) -> a, the drafts accepted:
    the row emits drawn[: a + 1]."""
    a = 0
    for x, y in zip(drafts, drawn):
        if x != y:
            break
        a += 1
    return a
