"""What each pass of a plan's window computes (PassWork): its rows, the tokens each computes,
which rows draw, and its inputs built from the persistent batch (gpu/step/step_inputs.py), as a
captured decode graph or an eager pass takes them.

A plan's first pass computes each row's chunk (a window's rows one token), plus the drafts a
row verifies, and the rows reaching their known tokens draw (a forking row once more per fork);
a window's later passes decode one token per row still running, and never fork.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from conveyor.gpu.backends import AttentionBackend
from conveyor.gpu.sampling.penalties import penalises_repeats
from conveyor.gpu.step.features.base import Hooks
from conveyor.gpu.step.passes import PassWork, Window
from conveyor.gpu.step.persistent_batch import PersistentBatch
from conveyor.gpu.step.step_inputs import RowSpec, first_pass_inputs, next_pass_inputs


@dataclasses.dataclass(frozen=True)
class PassBuilder:
    batch: PersistentBatch
    attn: AttentionBackend
    block_size: int
    sliding_window: int | None
    graphed: Callable[[int, bool], bool]  # (rows, every row decodes one token) -> the pass replays a captured graph
    hooks: Hooks  # the features' (features/base.py)

    def must_wait(self, window: Window, active: list[int], k: int) -> bool:
        """Whether the host must see the ids in flight before pass k of the window launches (a
        caller with passes in flight asks): a row whose penalties read its history, a forking
        row, a row whose inputs it lacks beyond the newest, or a row a feature must see settled."""
        for i in active:
            seq = window.rows[i]
            lag = seq.num_tokens - len(seq.token_ids)
            if lag == 0:
                continue
            row = window.plan.scheduled[i] if k == 0 else None
            if penalises_repeats(seq.params) or (self.hooks.must_wait and any(wait(seq, row) for wait in self.hooks.must_wait)):
                return True
            if row is not None:
                end = seq.num_computed + (1 if window.plan.num_steps > 1 else row.num_tokens)
                if row.forks or max(seq.num_computed, len(seq.token_ids)) < end - 1:
                    return True
        return False

    def first(self, window: Window) -> PassWork:
        """A plan's first pass, with the drafts the features give its rows (a single step's only)."""
        plan, rows = window.plan, window.rows
        drafts: dict[int, list[int]] = {}
        for propose in self.hooks.drafts if plan.num_steps == 1 else ():
            drafts |= propose(rows, plan.scheduled)
        specs, num_new, sampling = [], [], []
        slots, one_step = self.batch.slots, plan.num_steps == 1
        for i, (seq, row) in enumerate(zip(rows, plan.scheduled)):
            n = row.num_tokens if one_step else 1  # a window's first pass decodes
            end = seq.num_computed + n
            known, extra = seq.token_ids, len(drafts.get(i, ()))
            if extra:  # it computes its token and its drafts, and draws at each
                known = seq.token_ids + drafts[i]
                seq.verifying = True
            specs.append(RowSpec(slots[seq.seq_id], seq.num_computed, end + extra, known, end == seq.num_tokens, 1 + extra))
            num_new.append(n + extra)
            if end == seq.num_tokens:
                sampling.append(i)
        eager = not self.graphed(len(specs), max(num_new) == 1)
        inputs = first_pass_inputs(specs, self.batch, self.attn, self.block_size, self.sliding_window, eager)
        window.first = inputs
        return PassWork(inputs, rows, num_new, sampling, [plan.scheduled[i].forks for i in sampling], drafts)

    def next(self, window: Window, k: int, active: list[int]) -> PassWork:
        """Pass k > 0 of a window over its `active` rows (indices into window.rows)."""
        assert window.first is not None
        rows = [window.rows[i] for i in active]
        rows_left = None if len(active) == len(window.rows) else active
        eager = not self.graphed(len(active), True)
        inputs = next_pass_inputs(window.first, k, rows_left, self.batch, self.attn, self.block_size, self.sliding_window, eager)
        return PassWork(inputs, rows, [1] * len(rows), list(range(len(rows))), [[] for _ in rows])
