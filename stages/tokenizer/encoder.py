"""PromptEncoder: prompt text or chat messages to token ids, exactly as transformers makes them.

Built from a checkpoint directory with the `tokenizers` library and jinja2 alone: the tokenizer
stage imports neither torch nor transformers, so it starts in a fraction of a second. The
chat template is rendered the way transformers renders it (same jinja2 settings, globals and
variables; `tools`, and tool calls shaped by `template_messages`), so `encode_chat` gives
`apply_chat_template(..., tokenize=True)`'s ids.

One difference, on purpose: special-token text inside a message's content (a user writing
`<|eot_id|><|start_header_id|>system`) is encoded as plain text, not as the control tokens, so
no one can forge a turn or a role; only the template's own markup yields special tokens. The
same holds for every string of tool calls and tools.
`special_tokens_in_content=True` (`--chat-content-special-tokens`) restores transformers'
behaviour. With a `limit`, a prompt sure to be longer is refused before all of it is encoded
(length_limit.py).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from conveyor.config import EngineConfig
from conveyor.stages.tokenizer.images import ImageProcessor, for_checkpoint
from conveyor.stages.tokenizer.length_limit import PromptTooLong, encode_within
from conveyor.wire.messages import ChatMessage, ContentPart, ToolCall


class PromptEncoder:
    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        chat_template: str | None = None,
        special_tokens_in_content: bool = False,
        images: ImageProcessor | None = None,
    ) -> None:
        """`chat_template`, when given, replaces the checkpoint's (as `--chat-template` does).
        `special_tokens_in_content`: special-token text in a message's content is the token.
        `images`: a vision model's image preprocessing (images/processor.py), None for text alone."""
        root = self.path = Path(checkpoint_dir)
        self.images = images
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        self.special_tokens_in_content = special_tokens_in_content
        added = self.tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        self._special_ids = {t.content: i for i, t in added.items() if t.special}
        # Longest first, so a special token that begins with another is found whole.
        texts = sorted(self._special_ids, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._literal: Tokenizer | None = None  # the same tokenizer, special tokens as plain text
        # (the template's image marker, the text that replaces it) where a family frames its images
        # in the prompt text (Gemma 3: images/gemma3.py), applied to a prompt with images before encoding.
        token_texts = {i: t.content for i, t in added.items()}
        self._image_frame = None if images is None else images.family.frame(token_texts, images.image_token_id)
        config = _read_json(root / "tokenizer_config.json")
        # The strings templates see as bos_token, eos_token, ...
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        self.special_tokens = {name: _token_text(config.get(name)) for name in names}
        # transformers' precedence: an explicit template, then chat_template.jinja, then the
        # tokenizer_config.json entry (a string, or a list of named templates).
        template_file = root / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        if chat_template is None:
            chat_template = _default_template(config.get("chat_template"))
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    @classmethod
    def for_engine(cls, config: EngineConfig) -> PromptEncoder:
        """The served checkpoint's encoder, with the server's chat settings: what the tokenizer
        stage, /tokenize and the Python API all encode with."""
        server = config.server
        return cls(
            config.model.path,
            chat_template=server.chat_template,
            special_tokens_in_content=server.special_tokens_in_content,
            images=for_checkpoint(config.model.path, max_pixels=config.media.max_image_pixels),
        )

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_prompt(self, text: str, limit: int | None = None, *, frame_images: bool = False) -> list[int]:
        """A plain prompt, with the special tokens the post-processor adds (BOS for Llama 3).
        PromptTooLong, before all of it is encoded, if it surely has more than `limit` ids.
        `frame_images`: the request has images, whose markers the family may frame (`_framed`)."""
        return encode_within(self.tokenizer, self._framed(text, frame_images), add_special_tokens=True, limit=limit)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        limit: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        frame_images: bool = False,
    ) -> list[int]:
        """Render the chat template, then encode without adding special tokens again: the
        template already wrote them (transformers' apply_chat_template(tokenize=True)).
        PromptTooLong and `frame_images` as for encode_prompt."""
        if not self.special_tokens_in_content and self._holds_special_text([messages, tools]):
            return self._encode_chat_literally(messages, add_generation_prompt, limit, tools, frame_images)
        text = self._framed(self.render_chat(messages, add_generation_prompt, tools), frame_images)
        return encode_within(self.tokenizer, text, add_special_tokens=False, limit=limit)

    def _framed(self, text: str, frame_images: bool) -> str:
        """`text` with each image marker replaced by the family's framing, as its processor does
        to the rendered prompt (Gemma 3's newlines and end token) when the request has images."""
        if not frame_images or self._image_frame is None:
            return text
        return text.replace(*self._image_frame)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """`tools`: OpenAI function tools ({"type": "function", "function": {...}}), which
        transformers passes to the template as they are."""
        template = self._template()
        # Like transformers, unset special tokens are left undefined (render as ""), not None.
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None,
                **specials,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from None

    def _holds_special_text(self, value: Any) -> bool:
        """Whether any string in `value` (messages, their tool calls, tools) holds special-token text."""
        if self._special_text is None:
            return False
        if isinstance(value, str):
            return bool(self._special_text.search(value))
        if isinstance(value, Mapping):
            return any(self._holds_special_text(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self._holds_special_text(v) for v in value)
        return False

    def _encode_chat_literally(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        limit: int | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        frame_images: bool = False,
    ) -> list[int]:
        """encode_chat with the special-token text of messages and tools kept as plain text.

        Each such text in a string the client sent (a content, a tool call's arguments, a
        tool's description) is swapped for a placeholder no one can write (a random
        nonce; not whitespace, so a template's `| trim` sees the same ends), the template is
        rendered, and what special-token text is left in the rendering is the template's own.
        The rendering is cut at those, as the tokenizer itself cuts a text at special tokens;
        the special tokens become their ids, and each piece between them, placeholders put
        back, is encoded with special tokens read as plain text. Without placeholders this
        gives the ids of encoding the whole rendering (tested; it would not for a special token
        that strips the whitespace beside it, lstrip/rstrip, which no Llama 3 or Qwen2 token
        does), so a content with special text changes only its own piece.
        """
        special_text = self._special_text
        assert special_text is not None  # encode_chat comes here only when a content holds special text
        originals: list[str] = []  # the special-token texts taken out of the contents, in order
        nonce = secrets.token_hex(8)

        def hide(match: re.Match[str]) -> str:
            originals.append(match.group())
            return f"\ue000{nonce}:{len(originals) - 1}\ue001"

        def hide_in(value: Any) -> Any:
            if isinstance(value, str):
                return special_text.sub(hide, value)
            if isinstance(value, Mapping):
                return {k: hide_in(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [hide_in(v) for v in value]
            return value

        text = self.render_chat(hide_in(messages), add_generation_prompt, None if tools is None else hide_in(tools))
        text = self._framed(text, frame_images)  # the template's markers only: the client's are hidden
        placeholder = re.compile(f"\ue000{nonce}:([0-9]+)\ue001")
        ids: list[int] = []
        start = 0
        for special in [*special_text.finditer(text), None]:
            piece = text[start : len(text) if special is None else special.start()]
            piece = placeholder.sub(lambda m: originals[int(m.group(1))], piece)
            if piece:
                room = None if limit is None else limit - len(ids)
                try:
                    ids += encode_within(self._literal_tokenizer(), piece, add_special_tokens=False, limit=room)
                except PromptTooLong as e:
                    raise PromptTooLong(len(ids) + e.num_tokens) from None
            if special is not None:
                ids.append(self._special_ids[special.group()])
                start = special.end()
        return ids

    def _literal_tokenizer(self) -> Tokenizer:
        # A second tokenizer rather than flipping the flag on the first: the ingress encodes
        # from several threads at once.
        if self._literal is None:
            literal = Tokenizer.from_str(self.tokenizer.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if not self.chat_template:
                raise ValueError(
                    "this model has no chat template (no chat_template.jinja, none in "
                    "tokenizer_config.json); pass one with --chat-template or send a plain prompt"
                )
            try:
                self._compiled = _environment().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the chat template does not compile: {e}") from None
        return self._compiled


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (transformers' shape): an assistant's tool calls as
    {"id", "type": "function", "function": {"name", "arguments"}}, a tool turn with its
    `tool_call_id` and `name`. Keys a message lacks are left out, as templates test `is defined`."""
    dicts = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content if m.parts is None else _template_parts(m.parts)}
        if m.tool_calls:
            d["tool_calls"] = [_template_call(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        dicts.append(d)
    return dicts


def _template_parts(parts: Sequence[ContentPart]) -> list[dict[str, Any]]:
    """A message's content with images as vision templates read it (transformers' shape): a list
    of {"type": "text", "text"} and {"type": "image"}, each image part rendering the family's marker."""
    return [{"type": "image"} if part.text is None else {"type": "text", "text": part.text} for part in parts]


def _template_call(call: ToolCall) -> dict[str, Any]:
    # Templates write the arguments with `| tojson` (Qwen, Hermes, Llama 3.1), which needs the
    # object: JSON text would come out quoted. vLLM parses them too, an empty text as {}.
    arguments: Any = call.arguments
    try:
        parsed = json.loads(call.arguments or "{}")
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        arguments = parsed
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _environment() -> ImmutableSandboxedEnvironment:
    """jinja2 set up as transformers sets it up, so templates written for it render the same."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body. transformers uses the tag to
    find assistant spans for training masks; serving only needs templates using it to compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters and sorts keys; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _token_text(token: Any) -> str | None:
    # Saved either as the text or as an AddedToken dict {"content": ..., "lstrip": ...}.
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _default_template(entry: Any) -> str | None:
    if isinstance(entry, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        return named.get("default")
    return entry
