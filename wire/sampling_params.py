"""SamplingParams: how to pick tokens and when to stop, as it travels with a request through every
stage; the Python API's `SamplingParams` is this struct. Its bounds are checked on construction,
and the HTTP bodies (stages/ingress/bodies.py) publish the same ones.
"""

from __future__ import annotations

import math
from typing import Literal

from conveyor.wire.struct import Struct

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
# Stop strings per request and characters per stop string (OpenAI allows 4 strings, vLLM any):
# generous for real use; at the bound the detokenizer builds a request's automaton in 161 ms on a
# 2-core Zen 3 (64 random strings of 1024 characters), typical sets in well under a millisecond.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Below this a temperature means greedy (vLLM's threshold too): dividing logits by a smaller one
# overflows float32, and a subnormal one rounds to 0 on the device.
MIN_SAMPLING_TEMPERATURE = 1e-5
# repetition_penalty divides or multiplies logits; outside this range it only overflows or
# flattens them (HF suggests about 1.2; vLLM takes any positive value).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class StructuredOutput(Struct):
    """A constraint on the output, enforced by the grammar engine (gpu/structured/) masking the
    logits at every draw. `spec` by kind: json_object: "" (any JSON object); json_schema: the
    schema as JSON text; regex: the pattern; choice: a JSON array of the allowed strings;
    grammar: EBNF (GBNF) text. Compiled grammars are cached by (kind, spec)."""

    kind: StructuredKind
    spec: str = ""
    param: str = ""  # the request field it came from, which a 400 for a spec that cannot compile names


class Pooling(Struct):
    """Pool the prompt's hidden states into one vector instead of generating text (/v1/embeddings):
    the model's own pooling (config/pooling.py), cut to `dimensions` where it allows that."""

    dimensions: int | None = None


class SamplingParams(Struct):
    """How to pick tokens and when to stop; the Python API's `SamplingParams` is this struct.

    temperature 0 (or anything below MIN_SAMPLING_TEMPERATURE) means greedy. top_k <= 0 and top_p
    == 1 disable those filters. With a seed, the draw for output token i depends only on (seed, i),
    so it is the same whatever the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until EOS or the context is full
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of every generated token
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    # CTRL/HF: logits of prompt and generated tokens divided (>0) or multiplied (<0); the
    # penalty must lie in REPETITION_PENALTY_RANGE.
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS, stop ids and stop strings are ignored (and EOS masked) before this many
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling
    logprobs: int | None = None  # return the sampled token's logprob and this many top alternatives
    # Return each prompt token's logprob (after the first: nothing predicts it), its rank, and this
    # many top alternatives, computed in the prompt's own passes (vLLM's extension; `echo` with
    # `logprobs` on the completions route asks for it too). Such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    # An embedding request: the sequence's one draw is discarded, its pooled vector is the answer.
    pooling: Pooling | None = None
    # A LoRA adapter's name (config/lora.py: --lora-modules, /v1/load_lora_adapter); None: the base weights.
    adapter: str | None = None
    stop: list[str] = []  # stop strings, matched by the detokenizer across token boundaries
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # constrained decoding (JSON schema, regex, choice, grammar)

    def __post_init__(self) -> None:
        """Raise ValueError naming the field first ("top_p must ..."): the ingress maps it to
        the 400's `param`."""
        low, high = REPETITION_PENALTY_RANGE
        checks = (
            ("n", self.n >= 1, "must be at least 1"),
            ("best_of", self.best_of is None or self.best_of >= self.n, "must be at least n"),
            ("temperature", 0 <= self.temperature < math.inf, "must be non-negative and finite"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", low <= self.repetition_penalty <= high, f"must be in [{low}, {high}]"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens, "must be at most max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS, f"must have at most {MAX_STOP_STRINGS} strings"),
            ("dimensions", self.pooling is None or (self.pooling.dimensions or 1) >= 1, "must be at least 1"),
            (
                "stop",
                all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                f"strings must be at most {MAX_STOP_STRING_CHARS} characters",
            ),
        )
        for field, ok, message in checks:
            if not ok:
                raise ValueError(f"{field} {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: best_of if given, else n."""
        return self.best_of or self.n
