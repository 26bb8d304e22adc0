"""Sampling on the device: one step's logits rows -> one token per draw, plus logprobs.

draws.py drives a step. Per logits row, penalties.py applies repetition, presence and frequency
penalties, logit_bias and min_tokens; per draw, sampler.py applies temperature and filters.py's
top_k, top_p and min_p, then draws (greedy: argmax of the edited logits). model_logprobs.py
reads the raw logits. Rows with default params skip every edit and filter they do not use.
"""

from conveyor.gpu.sampling.draws import SamplingRow, StepSamples, sample_step
from conveyor.gpu.sampling.model_logprobs import sampled_logprobs, top_logprobs
from conveyor.gpu.sampling.penalties import apply_penalties
from conveyor.gpu.sampling.sampler import sample, seed_for

__all__ = [
    "SamplingRow",
    "StepSamples",
    "apply_penalties",
    "sample",
    "sample_step",
    "sampled_logprobs",
    "seed_for",
    "top_logprobs",
]
