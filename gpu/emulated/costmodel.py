"""Forward-pass cost model: how long one step takes, from the shape of its batch.

    t = max(floor_s, intercept_s + per_token_s*T + per_seq_s*S + per_context_s*C + per_pair_s*P)

T: tokens in the pass. S: rows (sequences). C: KV entries read, the sum over rows of the context
length after the step. P: query-key pairs, the sum over rows of n*s + n*(n+1)/2 for n new tokens
after s cached ones. Why this shape (DeepSpeed-FastGen: flat while reading the weights dominates,
then linear in tokens), how `fit` finds it and what `scaled` assumes: docs/simulator.md, "The
cost model".

`PassCost` is all the simulator asks of a cost model (this one, or roofline.RooflineCost); the
shipped parameters are presets.py's. S, C and P are optional refinements: `fit` leaves out the
terms it is not asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

TERMS = ("tokens", "seqs", "context", "pairs")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What the cost model sees of one forward pass."""

    num_tokens: int
    num_seqs: int
    context_tokens: int  # KV entries read: sum over rows of the context after the step
    attention_pairs: int = 0  # query-key pairs: sum over rows of n*s + n*(n+1)/2

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[int, int]]) -> StepShape:
        """From (tokens cached before the step, tokens computed in it) per row."""
        rows = list(rows)
        return cls(
            num_tokens=sum(n for _, n in rows),
            num_seqs=len(rows),
            context_tokens=sum(s + n for s, n in rows),
            attention_pairs=sum(n * s + n * (n + 1) // 2 for s, n in rows),
        )

    def features(self) -> tuple[int, int, int, int]:  # in TERMS order
        return (self.num_tokens, self.num_seqs, self.context_tokens, self.attention_pairs)


class PassCost(Protocol):
    """Seconds of device time for one forward pass of a given shape."""

    @property
    def name(self) -> str: ...

    def latency(self, shape: StepShape) -> float: ...


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed forward pass: (num_tokens, num_seqs, context_tokens, seconds[, attention_pairs])."""

    num_tokens: int
    num_seqs: int
    context_tokens: int
    seconds: float
    attention_pairs: int = 0

    @property
    def shape(self) -> StepShape:
        return StepShape(self.num_tokens, self.num_seqs, self.context_tokens, self.attention_pairs)


@dataclasses.dataclass(frozen=True)
class CostModel:
    intercept_s: float  # fixed cost of any pass: launches, host-side input building
    per_token_s: float
    per_seq_s: float = 0.0
    per_context_s: float = 0.0
    per_pair_s: float = 0.0
    floor_s: float = 0.0  # no pass is faster: the weights must be read once per pass
    name: str = "custom"

    def latency(self, shape: StepShape) -> float:
        """Seconds for one pass; an empty pass (no rows) costs nothing."""
        if shape.num_tokens == 0:
            return 0.0
        t = (
            self.intercept_s
            + self.per_token_s * shape.num_tokens
            + self.per_seq_s * shape.num_seqs
            + self.per_context_s * shape.context_tokens
            + self.per_pair_s * shape.attention_pairs
        )
        return max(self.floor_s, t)

    def scaled(
        self, flops_factor: float, gpus: int = 1, *, floor_factor: float = 1.0, comm_s: float = 0.0, name: str | None = None
    ) -> CostModel:
        """This model on `flops_factor` times the work per token, split over `gpus` GPUs.

        Assumptions: the compute-bound part (per token, per context entry, per attention pair)
        scales with parameters (or layers x hidden) per GPU, i.e. by flops_factor / gpus, as
        tensor parallelism splits every matmul and the KV heads evenly. The per-pass intercept
        and per-sequence cost are launches and host work: unchanged. The floor's excess over
        the intercept (reading the weights once) scales by `floor_factor` (pass flops_factor /
        gpus to scale it with the weights per GPU; the default keeps a fixed launch floor). Each
        pass on more than one GPU pays `comm_s` more for its all-reduces.
        """
        if flops_factor <= 0 or gpus < 1:
            raise ValueError("flops_factor must be positive and gpus at least 1")
        k = flops_factor / gpus
        extra = comm_s if gpus > 1 else 0.0
        return dataclasses.replace(
            self,
            intercept_s=self.intercept_s + extra,
            per_token_s=self.per_token_s * k,
            per_context_s=self.per_context_s * k,
            per_pair_s=self.per_pair_s * k,
            floor_s=self.intercept_s + extra + max(0.0, self.floor_s - self.intercept_s) * floor_factor,
            name=name or f"{self.name}x{flops_factor:g}/{gpus}gpu",
        )

    @property
    def knee_tokens(self) -> float:
        """Tokens per pass where compute starts to dominate the floor (T alone, S=C=P=0)."""
        if self.per_token_s <= 0:
            return float("inf")
        return max(0.0, (self.floor_s - self.intercept_s) / self.per_token_s)


def fit(
    measurements: Sequence[Measurement | tuple],
    *,
    terms: Sequence[str] = TERMS,
    with_floor: bool = True,
    relative: bool = True,
    name: str = "fitted",
) -> CostModel:
    """Least-squares fit of a CostModel to timed passes.

    `relative` minimises squared relative errors ((model - measured) / measured), so a 4 ms decode
    counts as much as a 300 ms prompt and one slow outlier among the big passes cannot drag the
    small ones; otherwise squared seconds.

    Without a floor this is least squares on [1, T, S, C, P] (the chosen terms), every coefficient
    kept >= 0. With a floor it is a hinge fit: for each candidate split of the passes, sorted by
    tokens, into the flat region (the floor: their mean) and the sloped one (least squares),
    re-assign each pass to the region its fitted prediction puts it in until stable, and keep the
    best total squared error.
    """
    rows = [m if isinstance(m, Measurement) else Measurement(*m) for m in measurements]
    unknown = set(terms) - set(TERMS)
    if unknown:
        raise ValueError(f"unknown cost terms {sorted(unknown)}; choose from {TERMS}")
    if len(rows) < len(terms) + 1:
        raise ValueError(f"{len(rows)} measurements cannot fit {len(terms) + 1} parameters")
    cols = [i for i, t in enumerate(TERMS) if t in terms]
    x = np.array([[1.0, *(m.shape.features()[i] for i in cols)] for m in rows])  # [N, 1 + k]
    y = np.array([m.seconds for m in rows])  # [N]
    w = 1.0 / y if relative else np.ones_like(y)  # [N] per-sample weight on the residual
    coef, floor = _affine(x, y, w), 0.0
    best = (_sse(x, y, w, coef, floor), coef, floor)
    if with_floor:
        order = np.argsort(x[:, 1] if "tokens" in terms else y, kind="stable")
        for cut in range(1, len(rows) - x.shape[1] + 1):
            flat = np.zeros(len(rows), dtype=bool)
            flat[order[:cut]] = True
            for _ in range(20):
                if not flat.any():
                    break
                coef = _affine(x[~flat], y[~flat], w[~flat])
                floor = float((w[flat] ** 2 * y[flat]).sum() / (w[flat] ** 2).sum())  # weighted mean
                again = x @ coef < floor
                if (again == flat).all() or again.all() or (~again).sum() < x.shape[1]:
                    break
                flat = again
            sse = _sse(x, y, w, coef, floor)
            if sse < best[0] - 1e-15:
                best = (sse, coef, floor)
    _, coef, floor = best
    params = dict(zip((t for t in TERMS if t in terms), coef[1:]))
    return CostModel(
        intercept_s=float(coef[0]),
        per_token_s=float(params.get("tokens", 0.0)),
        per_seq_s=float(params.get("seqs", 0.0)),
        per_context_s=float(params.get("context", 0.0)),
        per_pair_s=float(params.get("pairs", 0.0)),
        floor_s=floor,
        name=name,
    )


def _affine(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0 (a cost cannot shrink with more work):
    solve, pin the most negative coefficient to 0, solve again without it, until none is negative."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0  # columns differ by orders of magnitude (T vs P): solve on [0, 1]
    xs, y = x / scale * w[:, None], y * w
    keep = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while keep.any():
        coef[:] = 0.0
        coef[keep] = np.linalg.lstsq(xs[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        keep[np.argmin(coef)] = False
    return coef / scale


def _sse(x: np.ndarray, y: np.ndarray, w: np.ndarray, coef: np.ndarray, floor: float) -> float:
    return float((((np.maximum(floor, x @ coef) - y) * w) ** 2).sum())
