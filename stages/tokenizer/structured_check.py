"""check_structured: a request's output constraint (SamplingParams.structured) must compile.

A spec that cannot (a schema xgrammar does not take, a bad regex or EBNF, a choice that is not a
non-empty JSON array of strings) is refused here with a 400 naming the request field it came
from, before the scheduler sees it. It compiles through gpu.structured's per-process cache, the
same code the worker compiles with; gpu.structured (torch, xgrammar, transformers) is imported
only when the first constrained request arrives, so the tokenizer stage still starts fast.
"""

from __future__ import annotations

from conveyor.config.model import ModelConfig
from conveyor.stages.tokenizer.preparation import Rejected
from conveyor.wire.sampling_params import SamplingParams, StructuredKind

# The request field each kind comes from (OpenAI's response_format, vLLM's guided_*).
REQUEST_PARAMS: dict[StructuredKind, str] = {
    "json_object": "response_format",
    "json_schema": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}


def check_structured(params: SamplingParams, model: ModelConfig) -> None:
    """Raise Rejected (param: the request field) when params.structured cannot be compiled."""
    if params.structured is None:
        return
    from conveyor.gpu.structured import check

    try:
        check(params.structured, model)
    except ValueError as e:
        raise Rejected(str(e), param=params.structured.param or REQUEST_PARAMS[params.structured.kind]) from None
