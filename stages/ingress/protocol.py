"""Bodies of /v1/completions and /v1/chat/completions, decoded and checked into a `Generation`.

`parse_completion` and `parse_chat` turn raw body bytes into what goes into the TokenizeRequests
(one `Prompt` each: a completion batch fans out as one engine request per prompt) plus how to
answer (stream, usage, echo, token ids). Every problem is an ApiError naming the offending
`param`: msgspec enforces the bounds declared in bodies.py, this module what needs the model (token
ids inside the vocabulary) or several fields at once, and SamplingParams has the last word. The
output constraint (structured_params.py) and a chat's tools (tool_params.py) are resolved there.
`best_of` (accepted on both routes, as vLLM does) asks for that many samples of which the `n`
most likely are returned, so it cannot stream. `check_num_seqs` bounds what one request may start,
prompts x max(n, best_of) sequences, by `config.server.max_seqs_per_request`. A chat message's
image_url parts become `Generation.image_urls`, each labelled with its part and indexed from the
message's ContentParts; media/loader.py turns them into `Generation.images` before submission.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import msgspec

from conveyor.stages.ingress.bodies import ChatBody, CompletionBody, SamplingBody
from conveyor.stages.ingress.chat_messages import chat_messages
from conveyor.stages.ingress.errors import ApiError
from conveyor.stages.ingress.media.urls import ImageUrl
from conveyor.stages.ingress.structured_params import structured_output
from conveyor.stages.ingress.tool_params import tool_choice
from conveyor.wire.images import ImageData
from conveyor.wire.messages import ChatMessage, SamplingParams, StructuredOutput

MAX_PROMPTS = 256  # prompts in one completion batch: each is an engine request of its own


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One engine request's input: text, token ids, or chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None


@dataclasses.dataclass
class Generation:
    """One validated request, ready to become one TokenizeRequest per prompt."""

    params: SamplingParams
    prompts: list[Prompt] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False
    model: str | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    # Chat tool calling: the request's `tools` (OpenAI function tools, as sent), and `tool_choice`
    # as a mode: "none", "auto", "required" or "named" (then tool_name). For "required" and
    # "named" the output is constrained (params.structured) to JSON: the named function's
    # arguments object, or for "required" an array of {"name", "parameters"} objects.
    tools: list[dict[str, Any]] | None = None
    tool_mode: str = "none"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    # max_tokens 0 (completions): one pass over each prompt, whose draw the answer leaves out.
    prompt_only: bool = False
    show_prompt_logprobs: bool = False  # the body asked for vLLM's prompt_logprobs field
    # A chat's images in request order, as the body named them (MessagePart.image indexes them),
    # and their bytes once media/loader.py has them (None until then).
    image_urls: list[ImageUrl] = dataclasses.field(default_factory=list)
    images: list[ImageData] | None = None

    def label_images(self, parts: list[str]) -> None:
        """Name the images as a route that translated its body onto a chat body (anthropic/,
        responses_api/) names their parts: `parts` in the order the chat messages hold them."""
        self.image_urls = [ImageUrl(image.url, part) for image, part in zip(self.image_urls, parts, strict=True)]


def parse_completion(data: bytes, vocab_size: int) -> Generation:
    body = decode(data, CompletionBody)
    if body.tools is not None:
        raise ApiError(400, "tools are only supported on /v1/chat/completions", param="tools")
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the legacy API's prompt log-likelihoods
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    if max_tokens == 0:  # the prompt alone: its one pass draws a token, which the answer leaves out
        if not body.echo and prompt_logprobs is None:
            raise ApiError(400, "max_tokens 0 generates nothing: it needs echo or prompt_logprobs", param="max_tokens")
        if body.min_tokens:
            raise ApiError(400, "min_tokens must be at most max_tokens", param="min_tokens")
    structured = structured_output(body)
    gen = _generation(body, max_tokens or 1, body.logprobs, vocab_size, structured, prompt_logprobs)
    gen.prompts = prompts_of(body.prompt, vocab_size)
    gen.echo = body.echo
    gen.prompt_only = max_tokens == 0
    return gen


def parse_chat(data: bytes, vocab_size: int) -> Generation:
    body = decode(data, ChatBody)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    structured = structured_output(body)
    tools = tool_choice(body)
    if tools.structured is not None and structured is not None:
        message = f"tool_choice {tools.mode!r} constrains the output to a tool call; {structured.param} cannot constrain it too"
        raise ApiError(400, message, param=structured.param)
    structured = tools.structured or structured
    gen = _generation(body, max_tokens, logprobs, vocab_size, structured)  # None: until EOS or the context is full
    messages, gen.image_urls = chat_messages(body.messages)
    gen.prompts = [Prompt(messages=messages)]
    gen.add_generation_prompt = body.add_generation_prompt
    gen.tools, gen.tool_mode, gen.tool_name = tools.tools, tools.mode, tools.name
    gen.parallel_tool_calls = body.parallel_tool_calls
    return gen


def check_num_seqs(gen: Generation, max_seqs: int) -> None:
    """Each prompt of a batch samples `num_samples` sequences, each a row of the running batch."""
    num_samples = gen.params.num_samples
    num_seqs = len(gen.prompts) * num_samples
    if num_seqs <= max_seqs:
        return
    # Blame the sample count when it alone is too many, else the batch that multiplies it.
    param = "prompt" if num_samples <= max_seqs else "best_of" if num_samples > gen.params.n else "n"
    message = (
        f"this request would start {len(gen.prompts)} prompt(s) x {num_samples} sample(s) = {num_seqs} "
        f"sequences; this server allows at most {max_seqs} per request"
    )
    raise ApiError(400, message, param=param, code="too_many_sequences")


def decode(data: bytes, type: Any) -> Any:
    """Numbers and booleans are read leniently, as the pydantic-based OpenAI-compatible servers
    read them: 5.0 or "5" is an integer, "true" a boolean; 5.5 is not an integer, "yes" no bool.
    Bytes that are not JSON are a 400 however they fail; msgspec itself refuses lone surrogates."""
    # JSON is UTF-8 (RFC 8259), but msgspec checks only the strings it keeps: an ignored field may
    # hold anything. isascii() is a fast scan; the full check runs only on bodies that need it.
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError as e:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    try:
        return msgspec.json.decode(data, type=type, strict=False)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", param=_param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec recurses per array or object level, ignored fields included
        raise ApiError(400, "request body is nested too deeply", code="json_too_deep") from None


def _param_of(message: str) -> str | None:
    """`... - at `$.messages[0].content`` -> "messages[0].content"; `$.logit_bias[...]` ->
    "logit_bias" (a dict value); a missing field names itself, under its object's path."""
    at = re.search(r"at `\$\.?(.+?)`$", message)
    path = at.group(1).replace("[...]", "") if at else ""
    if m := re.search(r"missing required field `(.+?)`", message):
        return f"{path}.{m.group(1)}" if path else m.group(1)
    return path or None


def _generation(
    body: SamplingBody,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    structured: StructuredOutput | None,
    prompt_logprobs: int | None = None,
) -> Generation:
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream set to true", param="stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if "" in stop:
        raise ApiError(400, "stop strings must not be empty", param="stop")
    _check_token_ids(body.stop_token_ids or [], vocab_size, "stop_token_ids")
    fields: dict[str, Any] = dict(
        n=body.n,
        best_of=body.best_of,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        stop_token_ids=body.stop_token_ids,
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else body.prompt_logprobs,
    )
    try:
        params = SamplingParams(
            **{k: v for k, v in fields.items() if v is not None},
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            structured=structured,
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]  # SamplingParams messages start with the field's name
        raise ApiError(400, str(e), param=field if field in SamplingParams.__struct_fields__ else None) from None
    if body.stream and params.num_samples > params.n:
        raise ApiError(400, "best_of greater than n cannot be streamed", param="best_of")
    return Generation(
        params=params,
        show_prompt_logprobs=body.prompt_logprobs is not None,
        stream=body.stream,
        include_usage=body.stream and body.stream_options is not None and body.stream_options.include_usage,
        return_token_ids=body.return_token_ids,
        model=body.model,
        priority=body.priority,
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    for key in bias:
        if not re.fullmatch(r"[0-9]{1,19}", key) or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", param="logit_bias")
    return {int(key): value for key, value in bias.items()}


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def prompts_of(prompt: str | list[Any], vocab_size: int, param: str = "prompt", max_prompts: int = MAX_PROMPTS) -> list[Prompt]:
    """A string, a list of token ids, or a batch: a list of strings or of token id lists
    (`param` names the field: a completion's prompt, an embedding's input)."""
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    if not prompt:
        raise ApiError(400, f"{param} must not be empty", param=param)
    if all(_is_token_id(p) for p in prompt):
        _check_token_ids(prompt, vocab_size, param)
        return [Prompt(token_ids=prompt)]
    if len(prompt) > max_prompts:
        raise ApiError(400, f"a batch holds at most {max_prompts} prompts; this one has {len(prompt)}", param=param)
    if all(isinstance(p, str) for p in prompt):
        return [Prompt(text=p) for p in prompt]
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        for ids in prompt:
            _check_token_ids(ids, vocab_size, param)
        return [Prompt(token_ids=ids) for ids in prompt]
    message = f"{param} must be a string, a list of strings, a list of token ids or a list of such lists"
    raise ApiError(400, message, param=param)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
