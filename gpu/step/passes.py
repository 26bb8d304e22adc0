"""A plan's passes on the worker: the per-sequence state the host keeps (WorkerSeq), a plan's
window of passes (Window), what one pass computes (PassWork), a pass launched on the device
(LaunchedPass), and the StepResult a launched pass becomes once its ids reach the host
(`pass_result`): its draws keyed by sequence id, a constrained sequence's matcher taking each id
it drew, in order. gpu/step/runner.py launches them, gpu/step/in_flight.py collects them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from conveyor.gpu.sampling.draws import DeviceSamples
from conveyor.gpu.spec.draft_length import Acceptance
from conveyor.gpu.spec.verify import accepted_length
from conveyor.gpu.step.pass_clock import PassClock
from conveyor.gpu.step.step_inputs import PassInputs
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import Fork, StepPlan, StepResult, TopLogprobs
from conveyor.wire.stop_rules import stops_on

if TYPE_CHECKING:  # xgrammar loads with the first constrained sequence
    from conveyor.gpu.models.mrope import RopeLayout
    from conveyor.gpu.step.platform import ResultCopy
    from conveyor.gpu.structured import Matcher


@dataclasses.dataclass
class WorkerSeq:
    seq_id: int
    token_ids: list[int]  # prompt, then the outputs the host has seen (the device may be ahead)
    params: SamplingParams
    num_prompt_tokens: int
    num_computed: int = 0  # tokens whose KV is in the cache (or is being written by a launched pass)
    block_table: list[int] = dataclasses.field(default_factory=list)
    index: int = 0  # choice index within the request: seeded draws mix it in
    num_tokens: int = -1  # tokens known, on the host or only on the device yet (-1: len(token_ids))
    stopped: bool = False  # the host saw it draw EOS / a stop token, or fail: later draws are masked
    matcher: Matcher | None = None  # its grammar (params.structured): has taken every id in token_ids' outputs
    # A launched pass verifies drafts of it and has not been collected: num_computed and
    # num_tokens count that pass's token alone until its result says how many drafts held.
    verifying: bool = False
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)  # how its drafts fared: how many to verify
    lora_slot: int = -1  # its adapter's slot on this worker (gpu/lora/slots.py); -1: the base weights
    # Its images' M-RoPE layout (gpu/models/mrope.py; Qwen2-VL), set by the vision feature; a fork
    # shares its parent's (immutable). None: its tokens rotate by their index.
    rope_layout: RopeLayout | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


@dataclasses.dataclass
class Window:
    """One plan's passes: a single step, or a multi-step window of decode passes."""

    plan: StepPlan
    rows: list[WorkerSeq]
    passes: list[int]  # per row: the passes it takes part in (1 for a single step)
    num_passes: int
    first: PassInputs | None = None
    num_launched: int = 0

    def active(self, k: int) -> list[int]:
        """Rows pass k computes: those with more than k passes whose sequence has not stopped."""
        return [i for i, (seq, n) in enumerate(zip(self.rows, self.passes)) if n > k and not seq.stopped]


@dataclasses.dataclass
class PassWork:
    """What one pass computes: its rows, the tokens each computes, which rows draw (indices into
    rows), each drawing row's forks (a plan's first pass only) and the drafts a row verifies (by
    row index: it draws once per draft and once more, gpu/spec/verify.py)."""

    inputs: PassInputs
    rows: list[WorkerSeq]
    num_new: list[int]
    sampling: list[int]
    forks: list[list[Fork]]
    drafts: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def logit_rows(self) -> list[tuple[WorkerSeq, list[int]]]:
        """Per logits row (a sampling row's, then one per draft it verifies): its sequence and
        the drafts drawn before it."""
        rows: list[tuple[WorkerSeq, list[int]]] = []
        for i in self.sampling:
            drafts = self.drafts.get(i, [])
            rows += [(self.rows[i], drafts[:j]) for j in range(len(drafts) + 1)]
        return rows


class PassOutput(Protocol):
    """What a step feature read from a pass on the device (gpu/step/features/base.py
    `after_forward`), copied into its StepResult once the pass's ids reached the host."""

    def fill(self, result: StepResult) -> None: ...


@dataclasses.dataclass
class LaunchedPass:
    window: Window
    index: int  # pass index within the plan
    draws: list[WorkerSeq]  # the sequence of each draw the result reports, in protocol order
    computed: list[int | None]  # per reported draw: its index among the computed draws (None: skipped)
    samples: DeviceSamples | None
    copy: ResultCopy | None  # its ids on their way to the host (the platform's HostCopy or VirtualCopy)
    clock: PassClock
    # The drafts each verifying sequence's run of draws checks (by seq_id): its draws are
    # consecutive in `draws`, one per draft and one more.
    drafts: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    outputs: list[PassOutput] = dataclasses.field(default_factory=list)  # the features' (prompt logprobs, embeddings)


def pass_result(launched: LaunchedPass, eos: tuple[int, ...]) -> StepResult:
    """A launched pass whose ids reached the host -> its StepResult; the host's copies of the
    sequences take the ids, and a sequence that stops (EOS `eos`, a stop id, a failed draw) is
    masked from then on. A verifying row reports the run of draws it keeps (verify.py), cut after
    a stopping token, and its counts move past the accepted drafts."""
    window, k = launched.window, launched.index
    host = launched.samples.on_host(launched.copy.wait()) if launched.samples is not None and launched.copy else None
    out = _Draws()
    top_iter = iter(host.top_logprobs if host else [])
    failed_computed = set(host.failed_draws if host else [])
    spec_rows: list[tuple[int, int, int]] = []
    d, draws, computed, all_drafts = 0, launched.draws, launched.computed, launched.drafts
    while d < len(draws):
        seq, c = draws[d], computed[d]
        drafts: list[int] | tuple[()] = all_drafts.get(seq.seq_id, ()) if all_drafts else ()
        d += 1 + len(drafts)
        wants_top = seq.params.logprobs is not None
        out.any_top |= wants_top
        tops = [next(top_iter) for _ in range(1 + len(drafts))] if wants_top and c is not None else []
        if not drafts and c is not None and host is not None and not seq.stopped:  # the common row: one draw
            token = host.token_ids[c]
            seq.token_ids.append(token)
            out.add(seq, token, host.logprobs[c], tops[0] if tops else None)
            _follow(seq, token, c in failed_computed, out, eos)
            continue
        if c is not None and host is not None and not drafts:
            # Every id the device holds joins the host's copy, even a masked one: the next
            # plan may still name the sequence (planned before the scheduler saw it stop).
            seq.token_ids.append(host.token_ids[c])
        if c is None or host is None or seq.stopped:
            if drafts and c is not None and host is not None:  # the token its counts already hold
                seq.token_ids.append(host.token_ids[c])
            out.masked.append(len(out.ids))
            out.add(seq, 0, 0.0, None)
            seq.verifying = False
            continue
        drawn = host.token_ids[c : c + 1 + len(drafts)]
        keep = drawn
        if drafts:
            accepted = accepted_length(drafts, drawn)
            keep = drawn[: accepted + 1]
            seq.acceptance.record(len(drafts), accepted)
        for j, token in enumerate(keep):
            out.add(seq, token, host.logprobs[c + j], tops[j] if tops else None)
            if drafts:
                seq.token_ids.append(token)
            _follow(seq, token, c + j in failed_computed, out, eos)
            if seq.stopped:
                keep = keep[: j + 1]
                break
        if drafts:
            seq.num_tokens += len(keep) - 1  # the pass counted its one token; the accepted drafts join it
            seq.num_computed += len(keep) - 1
            seq.verifying = False
            spec_rows.append((seq.seq_id, len(drafts), len(keep) - 1))
    # The plan's last result: its final pass, or the last launched one when no row is left.
    last = k == window.num_passes - 1 or (window.num_launched == k + 1 and not window.active(k + 1))
    clock = launched.clock
    result = StepResult(
        step=window.plan.step,
        sampled_token_ids=out.ids,
        busy_time=clock.busy(),
        idle_time=clock.idle(),
        sampled_logprobs=out.logprobs,
        top_logprobs=_dense(out.tops, len(out.ids)) if out.any_top else [],  # empty unless a draw's sequence asked
        failed_draws=out.failed,
        pass_index=k,
        last_pass=last,
        masked_draws=out.masked,
        seq_ids=out.seq_ids,
        spec_rows=spec_rows,
    )
    for output in launched.outputs:
        output.fill(result)
    return result


@dataclasses.dataclass
class _Draws:
    """A StepResult's per-draw lists, as pass_result fills them."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    seq_ids: list[int] = dataclasses.field(default_factory=list)
    tops: dict[int, TopLogprobs] = dataclasses.field(default_factory=dict)  # by draw, where its sequence asked and it was not masked
    failed: list[int] = dataclasses.field(default_factory=list)
    masked: list[int] = dataclasses.field(default_factory=list)
    any_top: bool = False

    def add(self, seq: WorkerSeq, token: int, logprob: float, top: TopLogprobs | None) -> None:
        if top is not None:
            self.tops[len(self.ids)] = top
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.seq_ids.append(seq.seq_id)


def _follow(seq: WorkerSeq, token: int, failed: bool, out: _Draws, eos: tuple[int, ...]) -> None:
    """The sequence after its draw `token` (just added to `out`): a failed draw stops it (its id is
    the placeholder 0, as on the device); otherwise its grammar takes the token and the stop rule
    is asked."""
    if failed:
        out.failed.append(len(out.ids) - 1)
        seq.stopped = True
        return
    if seq.matcher is not None:
        seq.matcher.accept(token)
    # The scheduler's rule (wire/stop_rules.py), over the ids the host holds, `token` the last:
    # lengths need no check here, as a plan never runs a row past them.
    seq.stopped = stops_on(seq.params, token, len(seq.token_ids) - seq.num_prompt_tokens, eos)


def _dense(tops: dict[int, TopLogprobs], num_draws: int) -> list[TopLogprobs]:
    """One entry per draw: its top logprobs, or empty ones."""
    none = TopLogprobs([], [])
    return [tops.get(d, none) for d in range(num_draws)]
