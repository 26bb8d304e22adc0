"""Passes in flight: launched on the device, their ids on their way to the host, collected in
launch order into StepResults (gpu/step/passes.py `pass_result`).

Invariant (tensor parallelism): every rank collects alike, since what it collects decides its
next passes; so with several ranks a pass counts as landed only when it has no copy to wait
for (a copy's readiness is timing, which differs between ranks), and a caller that must wait
collects by count.
"""

from __future__ import annotations

import collections

import torch

from conveyor.gpu.step.passes import LaunchedPass, pass_result
from conveyor.wire.step import StepResult


class InFlight:
    def __init__(self, eos_token_ids: tuple[int, ...], num_ranks: int) -> None:
        self.eos, self.num_ranks = eos_token_ids, num_ranks
        self.pending: collections.deque[LaunchedPass] = collections.deque()  # launched, not collected
        self.collected: list[StepResult] = []  # finished early (a pass had to wait for them)

    def add(self, launched: LaunchedPass) -> None:
        self.pending.append(launched)

    def __bool__(self) -> bool:
        """Whether anything is in flight or waits to be collected."""
        return bool(self.pending or self.collected)

    def landing_in(self) -> float | None:
        """Seconds until the oldest pass in flight has its ids on the host: 0.0 when it has (or
        results wait to be collected, or nothing is in flight); None where the device cannot say
        (a CUDA event can only be asked whether it completed)."""
        if self.collected or not self.pending or self.pending[0].copy is None:
            return 0.0
        return self.pending[0].copy.seconds_left()

    def collect_due(self) -> list[StepResult]:
        """What the worker collects when no plan came while it waited for `landing_in`: the
        oldest pass in flight, waited for, and every later one that already landed; where the
        device could not say when it lands (and one rank may decide alone), only what landed."""
        if self.num_ranks == 1 and self.landing_in() is None:
            return self.collect(keep=len(self.pending))
        return self.collect(keep=max(0, len(self.pending) - 1))

    def collect(self, keep: int = 0) -> list[StepResult]:
        """Results of launched passes, in launch order: every pass whose ids already reached the
        host, then, waiting, older ones until at most `keep` passes remain in flight."""
        results, self.collected = self.collected, []
        with torch.inference_mode():
            while self.pending and (len(self.pending) > keep or self._landed(self.pending[0])):
                results.append(pass_result(self.pending.popleft(), self.eos))
        return results

    def settle(self) -> None:
        """Collect every pass in flight now (the host needs their ids before the next launch),
        keeping the results for the caller's next `collect`."""
        self.collected = self.collect(keep=0)

    def _landed(self, launched: LaunchedPass) -> bool:
        return launched.copy is None or (self.num_ranks == 1 and launched.copy.ready())
