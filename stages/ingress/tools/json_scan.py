"""Reading JSON that is still arriving: where a value ends, and the call objects of a tool call.

The tool-call parsers scan the whole output so far after every delta. A value that has not
ended yet is reported as open (end None) with the text seen so far, which is always a prefix of
the value's final text: the streamed arguments are exactly the characters the model wrote, so
the pieces a client joins equal what the non-streamed answer holds. Strings are skipped with one
regex match, and structure characters found with a regex search, so a scan runs at C speed
between them.
"""

from __future__ import annotations

import dataclasses
import json
import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
_SPACE = re.compile(r"\s*")


@dataclasses.dataclass
class PartialCall:
    """A tool call as far as it has arrived: its name once the whole name string is there, and
    its arguments' JSON text so far (a prefix of the final text)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False  # the call's object (or its whole text, for a named call) has ended


def skip_space(text: str, i: int) -> int:
    match = _SPACE.match(text, i)
    assert match is not None  # \s* always matches
    return match.end()


def value_end(text: str, i: int, final: bool) -> int | None:
    """The end of the JSON value starting at text[i], or None while it is open (or malformed:
    the caller's final check finds that). `final`: no more text comes, so a number at the very
    end is complete."""
    if i >= len(text):
        return None
    if text[i] == '"':
        match = _STRING.match(text, i)
        return match.end() if match else None
    if text[i] in "{[":
        depth, j = 0, i
        while (found := _STRUCTURE.search(text, j)) is not None:
            j = found.start()
            if text[j] == '"':
                match = _STRING.match(text, j)
                if match is None:
                    return None
                j = match.end()
                continue
            depth += 1 if text[j] in "{[" else -1
            j += 1
            if depth == 0:
                return j
        return None
    match = _SCALAR.match(text, i)
    if match is None or (match.end() == len(text) and not final):  # "12" may become "123"
        return None
    return match.end()


def scan_call_object(text: str, i: int, argument_keys: tuple[str, ...], final: bool) -> tuple[PartialCall, int | None]:
    """The call object starting at text[i] == "{": {"name": ..., <argument key>: {...}} in any
    member order. Returns the call so far and the object's end (None while open)."""
    call, j, n = PartialCall(), skip_space(text, i + 1), len(text)
    while j < n:
        if text[j] == "}":
            call.complete = True
            return call, j + 1
        if text[j] == ",":
            j = skip_space(text, j + 1)
            continue
        key = _STRING.match(text, j)
        if key is None:
            return call, None
        j = skip_space(text, key.end())
        if j >= n or text[j] != ":":
            return call, None
        j = skip_space(text, j + 1)
        end = value_end(text, j, final)
        name = json.loads(key.group())
        if name in argument_keys and j < n:
            call.arguments = text[j : end if end is not None else n]
        if end is None:
            return call, None
        if name == "name":
            value = json.loads(text[j:end])
            call.name = value if isinstance(value, str) else None
        j = skip_space(text, end)
    return call, None


def scan_call_array(text: str, i: int, argument_keys: tuple[str, ...], final: bool) -> tuple[list[PartialCall], int | None]:
    """The array of call objects starting at text[i] == "[". Returns the calls so far and the
    array's end (None while open or malformed)."""
    calls: list[PartialCall] = []
    j, n = skip_space(text, i + 1), len(text)
    while j < n:
        if text[j] == "]":
            return calls, j + 1
        if text[j] == ",":
            j = skip_space(text, j + 1)
            continue
        if text[j] != "{":
            return calls, None
        call, end = scan_call_object(text, j, argument_keys, final)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_space(text, end)
    return calls, None


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
