"""json_schema_grammar: a JSON schema -> the xgrammar Grammar whose every complete output is
RFC 8259 JSON that the schema validates, or ValueError naming what cannot be held to.

xgrammar (0.2.8) converts the schema; two of its gaps are closed here. A string with minLength or
maxLength repeats a bare class [^"\\\r\n] (its issue 800): raw U+0000-U+001F get in, which strict
parsers refuse, and no escape can be written. That class is replaced by one JSON character, so a
repetition counts code points as maxLength does: a raw code point from U+0020 on but '"' and '\\',
a short escape, a \\uXXXX outside the surrogates, or a surrogate pair. Unbounded strings
(basic_string) already refuse raw control characters. Keywords it drops without a word are
refused (`unsupported`), so a client is told instead of getting output the schema rejects.
The mask is computed over a token's whole bytes, so a token holding a control byte is refused
inside a string like any other character the grammar refuses.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

# The length-bounded string's character class, as xgrammar prints it.
_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = "conveyor_json_char"
_JSON_CHAR_RULES = rf"""
{_JSON_CHAR} ::= [^\0-\x1f\"\\] | "\\" [\"\\/bfnrt] | "\\u" conveyor_json_bmp
    | "\\u" [dD] [89abAB] conveyor_hex conveyor_hex "\\u" [dD] [c-fC-F] conveyor_hex conveyor_hex
conveyor_json_bmp ::= [0-9a-cA-CeEfF] conveyor_hex conveyor_hex conveyor_hex | [dD] [0-7] conveyor_hex conveyor_hex
conveyor_hex ::= [0-9a-fA-F]
"""

# Keywords whose subschemas are checked in turn: a map of them, one, or a list.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "propertyNames", "contains")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
# xgrammar converts these as if they were absent.
_IGNORED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "maxContains")
# xgrammar keeps an enum or const and drops these beside it.
_CONSTRAINTS = (
    "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "items", "prefixItems", "properties", "required", "minProperties",
    "maxProperties", "additionalProperties", "anyOf", "oneOf", "allOf", "$ref",
)  # fmt: skip
_JSON_TYPES: dict[str, Any] = {
    "string": str,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
    "array": list,
    "object": dict,
}
# xgrammar matches a pattern against the string as written in JSON, and a '"', '\\' or control
# character the pattern names comes out raw, which ends or breaks the string: a literal one, or one
# by escape or code (classes it only excludes, and \s \W . [^...], leave them out already).
_RAW_IN_PATTERN = re.compile(r'["\x00-\x1f]|\\\\|\\(x|u00)(22|5[cC]|[01][0-9a-fA-F])|\\[tnrfv0]|\\c')


def json_schema_grammar(spec: str, max_whitespace_cnt: int) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(spec, max_whitespace_cnt=max_whitespace_cnt)  # raises on a bad schema
    unsupported(json.loads(spec))
    ebnf = str(grammar)
    if _BOUNDED_CHAR not in ebnf:
        return grammar
    assert _JSON_CHAR not in ebnf
    return xgr.Grammar.from_ebnf(ebnf.replace(_BOUNDED_CHAR, _JSON_CHAR) + _JSON_CHAR_RULES)


def unsupported(schema: Any, where: str = "#") -> None:
    """ValueError naming the first keyword (and where it is) that xgrammar would not enforce."""
    if not isinstance(schema, dict):
        return
    for key in _IGNORED:
        if key in schema:
            raise ValueError(f"{key!r} is not supported (at {where})")
    # oneOf is taken as anyOf: exact when a discriminator tells its branches apart (pydantic's
    # tagged unions); allOf as if it had only its first branch.
    if isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1 and "discriminator" not in schema:
        raise ValueError(f"'oneOf' with more than one branch is not supported without a 'discriminator' (at {where}); anyOf is")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"'allOf' with more than one branch is not supported (at {where})")
    if schema.get("uniqueItems") is True:
        raise ValueError(f"'uniqueItems' is not supported (at {where})")
    if "multipleOf" in schema and not (schema.get("type") == "integer" and _is_whole(schema["multipleOf"])):
        raise ValueError(f"'multipleOf' is supported only as a whole number on an integer (at {where})")
    for key in ("pattern", "format"):  # either one replaces the length bounds
        if key in schema and ("minLength" in schema or "maxLength" in schema):
            raise ValueError(f"{key!r} with 'minLength' or 'maxLength' is not supported (at {where})")
    if "propertyNames" in schema and "properties" in schema:  # it bounds only the undeclared names
        raise ValueError(f"'propertyNames' beside 'properties' is not supported (at {where})")
    if isinstance(schema.get("pattern"), str):
        if _RAW_IN_PATTERN.search(schema["pattern"]):
            raise ValueError(f"a 'pattern' naming a quote, a backslash or a control character is not supported (at {where})")
    _check_values(schema, where)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                unsupported(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_ONE:
        unsupported(schema.get(key), f"{where}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                unsupported(sub, f"{where}/{key}/{i}")


def _check_values(schema: dict, where: str) -> None:
    """An enum or const beside keywords that xgrammar drops: refused; beside a type: each value of it."""
    if "enum" not in schema and "const" not in schema:
        return
    for key in _CONSTRAINTS:
        if key in schema:
            raise ValueError(f"'enum' or 'const' with {key!r} is not supported (at {where})")
    types = schema.get("type")
    if types is None:
        return
    names = [types] if isinstance(types, str) else types
    values = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
    for value in values:
        if not any(_is_of_type(value, name) for name in names):
            raise ValueError(f"enum value {value!r} is not of type {types!r} (at {where})")


def _is_of_type(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return name == "boolean"
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, _JSON_TYPES.get(name, object))


def _is_whole(number: Any) -> bool:
    return isinstance(number, int) and not isinstance(number, bool) and number > 0
