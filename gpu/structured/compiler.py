"""Grammars: StructuredOutput -> xgrammar's CompiledGrammar, compiled once per distinct spec.

Compiling walks the whole vocabulary against the grammar (milliseconds for a small schema at a
4k vocabulary, more at 150k), so each process keeps the most recently used MAX_CACHED grammars,
keyed by the StructuredOutput's (kind, spec). The tokenizer stage compiles to
validate (`check`), the worker to decode: each process compiles its own.

Specs by kind (wire/sampling_params.py): json_object is any JSON object; json_schema a schema
(strict: no properties or items beyond those it names, which keeps a model on the schema;
json_schema.py mends its strings and refuses the keywords xgrammar would not enforce);
regex and grammar (EBNF / GBNF, rule `root`) as given; choice a JSON array of strings, exactly
one of which the output must be. JSON may hold at most JSON_MAX_WHITESPACE blanks in a row
between its tokens.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
from collections.abc import Sequence

import xgrammar as xgr

from conveyor.config.model import ModelConfig
from conveyor.gpu.structured.json_schema import json_schema_grammar
from conveyor.gpu.structured.matcher import Matcher
from conveyor.gpu.structured.vocabulary import tokenizer_info
from conveyor.wire.sampling_params import StructuredOutput

MAX_CACHED = 128
# Whitespace between JSON tokens, at most: room to pretty-print a few levels deep, but a model
# unsure of itself cannot fill its whole max_tokens with blanks (xgrammar's default has no bound,
# and a small model given that freedom often takes it).
JSON_MAX_WHITESPACE = 16
# xgrammar's C++ errors open with "[time] /path/file.cc:line: " and sometimes a failed check.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_KIND_NAMES = {
    "json_object": "JSON object",
    "json_schema": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class Grammars:
    """One model's grammar compiler and its cache of compiled grammars."""

    def __init__(self, model: ModelConfig) -> None:
        self.vocab_size = model.vocab_size
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info(model), max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )  # our LRU is the cache, keyed by the spec
        # Keyed by (kind, spec): equal specs from different requests share one compiled grammar.
        self._cache: collections.OrderedDict[tuple[str, str], xgr.CompiledGrammar] = collections.OrderedDict()

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The spec's compiled grammar; ValueError naming the problem when it has none."""
        key = (structured.kind, structured.spec)
        grammar = self._cache.get(key)
        if grammar is None:
            grammar = self._compile(structured)
            self._cache[key] = grammar
            if len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return grammar

    def matcher(self, structured: StructuredOutput, outputs: Sequence[int] = ()) -> Matcher:
        """A matcher at the start of the output, then fed `outputs` (a resumed sequence's)."""
        matcher = Matcher(self.compile(structured), self.vocab_size)
        for token in outputs:
            matcher.accept(token)
        return matcher

    def _compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        kind, spec = structured.kind, structured.spec
        ebnf = choice_grammar(spec) if kind == "choice" else spec
        try:
            match kind:
                case "json_object":
                    return self.compiler.compile_json_schema(
                        '{"type": "object"}', strict_mode=False, max_whitespace_cnt=JSON_MAX_WHITESPACE
                    )
                case "json_schema":
                    return self.compiler.compile_grammar(json_schema_grammar(spec, JSON_MAX_WHITESPACE))
                case "regex":
                    return self.compiler.compile_regex(spec)
                case "choice" | "grammar":
                    return self.compiler.compile_grammar(ebnf)
        except Exception as e:  # xgrammar raises RuntimeError with its C++ location first
            message = _ERROR_PREFIX.sub("", str(e)).strip()
            raise ValueError(f"invalid {_KIND_NAMES[kind]}: {message}") from None
        raise ValueError(f"unknown structured output kind {kind!r}")


def choice_grammar(spec: str) -> str:
    """A JSON array of strings -> EBNF whose root is exactly one of them."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid choice: not JSON ({e})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("invalid choice: must be a non-empty JSON array of strings")
    # JSON string literals are EBNF string literals: \" \\ \n and \uXXXX escapes mean the same.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.cache
def grammars_for(model: ModelConfig) -> Grammars:
    """The process's Grammars for `model`, built on first use (the vocabulary is read then)."""
    return Grammars(model)


def check(structured: StructuredOutput, model: ModelConfig) -> None:
    """Raise ValueError with a message for the client when the spec cannot be compiled; a spec
    that can is compiled and cached."""
    grammars_for(model).compile(structured)
