"""Which tool-call format the served model writes, when --tool-call-parser does not say.

Read once at ingress start from the chat template the tokenizer stage renders: the server's
`chat_template` override, else the checkpoint's chat_template.jinja, else tokenizer_config.json's
`chat_template`. Every named template of a list is read (the tool markup often lives in a
"tool_use" template beside "default"), so this does not reuse PromptEncoder, which keeps only
the default and would load the whole tokenizer. A template that writes tool calls shows their
markup: `<tool_call>` is hermes, `[TOOL_CALLS]` mistral, `<|python_tag|>` or the "ipython" role
llama3_json; none of them: auto tool calls are not parsed and content stays plain.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from conveyor.config import EngineConfig
from conveyor.stages.ingress.tools import TOOL_PARSERS

log = logging.getLogger(__name__)

MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))


def guess_tool_format(template: str) -> str | None:
    return next((name for marker, name in MARKERS if marker in template), None)


def chat_template_text(config: EngineConfig) -> str:
    if config.server.chat_template is not None:
        return config.server.chat_template
    root = Path(config.model.path)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        entry = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return ""
    if isinstance(entry, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        return "\n".join(str(t.get("template", "")) for t in entry if isinstance(t, dict))
    return entry if isinstance(entry, str) else ""


def tool_format(config: EngineConfig) -> str | None:
    """The configured format (checked), else the guess from the chat template."""
    name = config.server.tool_call_parser
    if name is not None:
        if name not in TOOL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
        return name
    guess = guess_tool_format(chat_template_text(config))
    log.info("tool calls in auto mode: %s", f"{guess} format, from the chat template" if guess else "not parsed")
    return guess
