"""StepFeature: what a feature of the worker's step (LoRA, speculation, prompt logprobs, pooling,
grammars) may add to it, as hooks the step core calls at fixed points. Each hook defaults to doing
nothing, so a feature overrides only the points it meets; the core (gpu/step/runner.py) names no
feature and calls every hook of every feature in `features_for`'s order.

The points, in the order a plan meets them:
- sizing: `bytes_per_block` (KV a feature keeps beside the target's), `allocate`, `runs_eagerly`
  and `decode_model` (what CUDA graphs capture);
- applying a plan: `register` (a new, resumed or forked sequence), `drop` (finished or
  preempted), then `apply` (the plan's own parts: adapter loads, block copies);
- a pass: `drafts` (extra tokens a row computes and draws at), `must_wait` (the host needs every
  id in flight before launching), `begin_pass` (before the forward), `after_forward` (outputs
  read from the hidden states, sent with the pass's result), `mask` (the sampling rows' token
  mask).

Invariant (tensor parallelism): a hook that changes what a pass computes or which collectives
it makes (drafts, must_wait, eagerness) decides from state every rank holds; only `mask` and the
outputs may differ by rank (rank 0 samples and reports).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from conveyor.gpu.step.cuda_graphs import DecodeModel
    from conveyor.gpu.step.passes import PassOutput, PassWork, WorkerSeq
    from conveyor.gpu.structured import TokenMask
    from conveyor.wire.step import NewSeq, ScheduledSeq, StepPlan


class StepFeature:
    # --- sizing and the KV pool -----------------------------------------------------------------

    @property
    def runs_eagerly(self) -> bool:
        """Whether every pass must run eagerly (no CUDA graphs)."""
        return False

    def bytes_per_block(self) -> int:
        """Bytes the feature keeps per KV block beside the target's (all layers)."""
        return 0

    def allocate(self, num_blocks: int, kv_caches: list[torch.Tensor]) -> None:
        """The pool is sized, and `kv_caches` (the target's, `num_blocks` blocks) allocated:
        allocate the feature's share."""

    def decode_model(self, model: DecodeModel) -> DecodeModel:
        """The model as decode graphs capture and run it."""
        return model

    # --- applying a plan ------------------------------------------------------------------------

    def register(self, seq: WorkerSeq, new: NewSeq | None) -> None:
        """A sequence the worker now holds: `new` as the plan sent it, or None for a fork
        (a copy of its parent after a pass)."""

    def drop(self, seq_id: int) -> None:
        """A sequence the worker forgets (finished, preempted)."""

    def apply(self, plan: StepPlan) -> None:
        """The plan's parts the feature owns, once its sequences are registered and dropped."""

    # --- a pass ---------------------------------------------------------------------------------

    def drafts(self, rows: list[WorkerSeq], scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
        """Tokens a plan's first pass computes past each row's known ones and draws at
        (by row index; rows without any left out)."""
        return {}

    def must_wait(self, seq: WorkerSeq, row: ScheduledSeq | None) -> bool:
        """Whether the host must see `seq`'s ids in flight before the pass launches (`row`: its
        scheduled entry in a plan's first pass, None in a window's later passes)."""
        return False

    def begin_pass(self, work: PassWork) -> None:
        """Before the forward pass of `work`."""

    def after_forward(self, work: PassWork, hidden: torch.Tensor, first: bool) -> PassOutput | None:
        """After the forward pass (hidden [T, H]; `first`: a plan's first pass): what the pass's
        result reports for the feature, if anything."""
        return None

    def mask(self, work: PassWork, settle: Callable[[], None]) -> TokenMask | None:
        """The token mask of the pass's logits rows (gpu/step/passes.py `PassWork.logit_rows`),
        called once its forward is launched. `settle` collects every pass in flight first, where
        the mask needs their ids."""
        return None


class Hooks:
    """The per-pass and per-sequence hooks of a runner's features, each list holding the bound
    methods of the features that override it, in feature order: the core calls only those, so a
    hook nobody uses costs nothing per pass or per row (a decode pass of 256 rows asks
    `must_wait` of each)."""

    def __init__(self, features: list[StepFeature]) -> None:
        def overriding(name: str) -> list:
            return [getattr(f, name) for f in features if getattr(type(f), name) is not getattr(StepFeature, name)]

        self.register = overriding("register")
        self.drop = overriding("drop")
        self.apply = overriding("apply")
        self.drafts = overriding("drafts")
        self.must_wait = overriding("must_wait")
        self.begin_pass = overriding("begin_pass")
        self.after_forward = overriding("after_forward")
        self.mask = overriding("mask")
