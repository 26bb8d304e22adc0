"""The Response object: its shape from the request, its end from the chat answer's.

`new_response` is what response.created carries and what a background request answers at once
(status "queued" there, "in_progress" in a stream). `finish_response` sets the end state from the
chat choice's finish reason: "length" is status "incomplete" with incomplete_details
{reason: "max_output_tokens"}, an abort "cancelled", anything else "completed"; `fail_response`
sets "failed" and the error. `usage` is the chat usage in Responses' names. Reasoning tokens are
not counted apart from the others on the chat path, so output_tokens_details.reasoning_tokens is 0.
"""

from __future__ import annotations

import time
from typing import Any

from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.responses_api.bodies import FunctionToolChoice, ResponsesBody

Response = dict[str, Any]


def new_response(response_id: str, body: ResponsesBody, model: str, status: str) -> Response:
    tools = [{k: v for k, v in (("type", "function"), *_tool_fields(t)) if v is not None} for t in body.tools or []]
    tool_choice: Any = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = {"type": "function", "name": tool_choice.name}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": body.background,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "text": {"format": _format(body)},
        "tool_choice": tool_choice,
        "tools": tools,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def _tool_fields(tool: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((f, getattr(tool, f)) for f in ("name", "description", "parameters", "strict"))


def _format(body: ResponsesBody) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return {"type": "text"}
    out = {"type": type(fmt).__struct_config__.tag}
    for field in fmt.__struct_fields__:
        out[field] = getattr(fmt, field)
    return out


def finish_response(response: Response, finish_reason: str | None, usage: dict[str, Any]) -> None:
    if finish_reason == "length":
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    elif finish_reason == "abort":
        response["status"] = "cancelled"
    else:
        response["status"] = "completed"
    response["usage"] = responses_usage(usage)


def fail_response(response: Response, error: ApiError) -> None:
    response["status"] = "failed"
    code = error.code or ("server_error" if error.status >= 500 else "invalid_prompt")  # OpenAI's codes
    response["error"] = {"code": code, "message": error.message}


def responses_usage(chat: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }
