"""One step's draws: from the logits of the step's sampling rows to what StepResult carries.

A sampling row (a sequence whose chunk reached the end of its known tokens) owns one logits row
and one draw per choice: its own, then one per fork. Its draws share its params and token
history, so penalties, bias and min_tokens edit its logits row once (penalties.py), and so does
a grammar's mask (gpu/structured/mask.py); each draw then reads its row (sampler.py). Logprobs,
sampled and top, come from the raw logits, and only for the draws that read them (`wants_logprob`:
logprobs asked, or best_of ranking); the others' sampled logprob is NaN (not computed).

The logits come in the model dtype (bfloat16 on a GPU): penalties, a mask and the sampled rows'
temperature make float32 copies of what they edit, greedy rows read them as they are, and the
logprobs upcast the rows that want them. None of that changes an id or a logprob.

A step whose every draw is greedy and wants nothing but its token (`only_argmax`: no logprobs, no
best_of ranking, nothing that edits the logits) may skip the logits: the model's head gives the
ids (CausalLM.compute_greedy) and `argmax_draws` wraps them, their logprobs NaN (not computed).

`draw_step` leaves everything on the device (DeviceSamples): the runner feeds the ids into the
next step there and copies them to the host behind an event (gpu/pass_output.py). `sample_step`
is the same followed by a wait, for callers that want host lists at once. Draws that had nothing
to draw from (non-finite logits) get a placeholder id 0, and their logprob is meaningless.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from conveyor.gpu.sampling.model_logprobs import sampled_logprobs, top_logprobs
from conveyor.gpu.sampling.params_table import DrawParams
from conveyor.gpu.sampling.penalties import apply_penalties, penalises_repeats
from conveyor.gpu.sampling.sampler import sample
from conveyor.gpu.sampling.transfer import to_device, to_host
from conveyor.wire.messages import SamplingParams
from conveyor.wire.step import TopLogprobs

if TYPE_CHECKING:
    from conveyor.gpu.structured import TokenMask


@dataclasses.dataclass
class SamplingRow:
    params: SamplingParams
    # Prompt, then the outputs so far (read, never changed). Only penalties read the ids, and a
    # caller may pass a history that lags the device (its newest ids not copied back yet) for a
    # row without repetition penalties: num_output_tokens then says how many outputs exist.
    token_ids: list[int]
    num_prompt_tokens: int
    choice_indices: list[int]  # one per draw: the sequence's own, then each fork's
    num_output_tokens: int = -1  # -1: len(token_ids) - num_prompt_tokens

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.token_ids) - self.num_prompt_tokens


@dataclasses.dataclass
class StepSamples:
    token_ids: list[int]  # one per draw, in draw order
    logprobs: list[float]  # of each sampled id under the raw logits
    top_logprobs: list[TopLogprobs]  # one per draw whose params.logprobs is not None
    failed_draws: list[int] = dataclasses.field(default_factory=list)  # draws whose logits were not finite


@dataclasses.dataclass
class DeviceSamples:
    """A step's draws, still on the device: what StepSamples holds once copied to the host."""

    token_ids: torch.Tensor  # [N] int64, in draw order
    logprobs: torch.Tensor  # [N] float32; NaN where the draw does not want it (wants_logprob)
    valid: torch.Tensor  # [N] bool: False where the logits were not finite
    top_values: torch.Tensor | None  # [R, k] float32 for the R rows that asked for logprobs
    top_ids: torch.Tensor | None  # [R, k] int64
    rows: list[SamplingRow]
    wanted: list[int]  # the R rows (indices into rows) that asked for logprobs

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.token_ids, self.logprobs, self.valid, self.top_values, self.top_ids]

    def on_host(self, host: list) -> StepSamples:
        """StepSamples from the host copies of `tensors()` (same order)."""
        token_ids, logprobs, valid, top_values, top_ids = host
        failed = (~valid).nonzero().flatten().tolist()
        tops = _tops(self.rows, self.wanted, top_values, top_ids)
        return StepSamples(token_ids.tolist(), logprobs.tolist(), tops, failed)


def sample_step(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]) -> StepSamples:
    """logits [S, V] as the model gave them (float32 or the model dtype), row i for rows[i] -> the
    step's draws on the host (one synchronisation)."""
    samples = draw_step(logits, rows, eos_token_ids)
    return samples.on_host(to_host(*samples.tensors()))


def draw_step(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    eos_token_ids: tuple[int, ...],
    draw_params: DrawParams | None = None,
    mask: TokenMask | None = None,
) -> DeviceSamples:
    """logits [S, V] as the model gave them (float32 or the model dtype), row i for rows[i] -> the
    draws, on the device (no synchronisation). draw_params: each draw's parameters already on the device, in draw order.
    mask: the grammar's, applied after the penalties (the raw logits still give the logprobs)."""
    device = logits.device
    params, output_indices, choice_indices, logit_rows = [], [], [], []
    for r, row in enumerate(rows):
        for choice in row.choice_indices:  # forks draw the same output position
            params.append(row.params)
            output_indices.append(row.num_output_tokens)
            choice_indices.append(choice)
            logit_rows.append(r)
    # [N] draw -> logits row; None when no row forks (N = S, no gather of the logits).
    draw_rows = None if len(logit_rows) == len(rows) else to_device(logit_rows, torch.int64, device)
    row_params, num_prompt = [r.params for r in rows], [r.num_prompt_tokens for r in rows]
    num_outputs = [r.num_output_tokens for r in rows]
    edited = apply_penalties(logits, row_params, [r.token_ids for r in rows], num_prompt, eos_token_ids, num_outputs)
    if mask is not None:
        edited = edited.to(torch.float32, copy=edited is logits)  # a float32 copy unless penalties made one
        mask.apply_(edited)
    token_ids, valid = sample(edited, params, output_indices, choice_indices, draw_rows, draw_params)  # [N] int64, [N] bool
    logprobs = _wanted_logprobs(logits, token_ids, draw_rows, [wants_logprob(p) for p in params])  # [N] float32

    wanted = [r for r, row in enumerate(rows) if row.params.logprobs is not None]
    k = max((rows[r].params.logprobs or 0 for r in wanted), default=0)
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    if k > 0:
        top_values, top_ids = top_logprobs(logits[to_device(wanted, torch.int64, device)], k)  # [R, k]
    return DeviceSamples(token_ids, logprobs, valid, top_values, top_ids, rows, wanted)


def wants_logprob(params: SamplingParams) -> bool:
    """Whether anything reads a draw's sampled logprob: the client's logprobs, or best_of's ranking
    by cumulative logprob (the scheduler sums them; LLM and the ingress read the sum only then)."""
    return params.logprobs is not None or params.num_samples > params.n


def only_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a draw of output `num_output_tokens` (or a later one) of a request with `params` is
    its logits' argmax and nothing more is read of them: greedy, no logprobs or best_of ranking
    (the sampled logprob), no penalties, bias or min_tokens still to apply, no grammar, no pooling."""
    return (
        params.greedy
        and not wants_logprob(params)
        and not penalises_repeats(params)
        and not params.logit_bias
        and num_output_tokens >= params.min_tokens
        and params.structured is None
        and params.pooling is None
    )


def argmax_draws(ids: torch.Tensor, valid: torch.Tensor, rows: list[SamplingRow]) -> DeviceSamples:
    """The draws of rows that each draw once (no forks) and all take `only_argmax`, from their
    argmaxes ids [S] int64 and valid [S] bool (CausalLM.compute_greedy)."""
    nan = torch.full(ids.shape, float("nan"), dtype=torch.float32, device=ids.device)
    return DeviceSamples(ids, nan, valid, None, None, rows, [])


def _wanted_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, draw_rows: torch.Tensor | None, wanted: list[bool]
) -> torch.Tensor:
    """[N] float32: draw i's sampled logprob where wanted[i], NaN elsewhere; only the wanted draws'
    rows go through log_softmax (a [S, V] pass for every row cost more than the draw itself)."""
    if all(wanted):
        return sampled_logprobs(logits, token_ids, draw_rows)
    out = torch.full(token_ids.shape, float("nan"), dtype=torch.float32, device=token_ids.device)
    if any(wanted):
        draws = to_device([i for i, w in enumerate(wanted) if w], torch.int64, token_ids.device)
        rows = draws if draw_rows is None else draw_rows[draws]
        out[draws] = sampled_logprobs(logits, token_ids[draws], rows)
    return out


def _tops(rows: list[SamplingRow], wanted: list[int], values: torch.Tensor | None, ids: torch.Tensor | None):
    """Host [R, k] top logprobs of the wanted rows -> one TopLogprobs per draw of theirs, each cut
    to its own params.logprobs, in draw order (a row's draws share one)."""
    values_list = values.tolist() if values is not None else [[]] * len(wanted)
    ids_list = ids.tolist() if ids is not None else [[]] * len(wanted)
    tops = []
    for r, row_ids, row_values in zip(wanted, ids_list, values_list, strict=True):
        k = rows[r].params.logprobs
        tops += [TopLogprobs(token_ids=row_ids[:k], logprobs=row_values[:k])] * len(rows[r].choice_indices)
    return tops
