"""Settings declared once, on the config dataclasses' fields.

A field made with `option(default, help, ...)` is a user-facing setting: its name, type, default,
help and bound are written there and nowhere else. From it:
- `add_arguments` makes the `conveyor serve` flag (`--max-num-seqs`, its type, default and help);
- `Setting.parse` checks and converts a value given by flag or by keyword (`LLM(max_num_seqs=8)`);
- `collect` sorts `build_engine_config`'s keywords into one dict of field values per config class.

The keyword name is the flag's with underscores: the flag is the field's name unless the field
says otherwise (`policy` is `--scheduling-policy`, keyword `scheduling_policy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any

from conveyor.config.errors import ConfigError

_KEY = "conveyor.option"


@dataclasses.dataclass(frozen=True)
class Option:
    """What a field says about itself as a setting (kept in the field's metadata)."""

    help: str
    flag: str | None = None  # without the dashes; None: the field's name with dashes
    choices: tuple[str, ...] = ()  # for str fields; an enum field's choices are its values
    minimum: int | None = None  # smallest allowed value
    positive: bool = False  # must be > 0
    zero_is_unbounded: bool = False  # 0 given by the user means None (no bound); implies minimum 0
    none: str | None = None  # what a None or empty default means, for --help ("from free memory")


def option(default: Any, help: str, **details: Any) -> Any:
    """A dataclass field that is also a setting: `max_num_seqs: int = option(256, "sequences running at once",
    minimum=1)`. `details` are Option's fields."""
    return dataclasses.field(default=default, metadata={_KEY: Option(help, **details)})


@dataclasses.dataclass(frozen=True)
class Setting:
    """One option() field of one config class, with its type resolved."""

    owner: type
    field: str
    type: type  # int, float, str, bool, tuple (of str), or an enum class; Optional is unwrapped
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return self.option.flag or self.field.replace("_", "-")

    @property
    def name(self) -> str:
        """The keyword name (and argparse dest)."""
        return self.flag.replace("-", "_")

    @property
    def choices(self) -> tuple[str, ...]:
        if issubclass(self.type, enum.Enum):
            return tuple(member.value for member in self.type)
        return self.option.choices

    def parse(self, value: Any) -> Any:
        """The field value for a user's value; ConfigError (one line, naming the flag) when it is out of bounds."""
        if self.choices and value not in self.choices:
            raise ConfigError(f"--{self.flag} must be one of {', '.join(self.choices)}, got {value!r}")
        if issubclass(self.type, enum.Enum):
            return self.type(value)
        if self.type is tuple:
            return tuple(value)
        opt = self.option
        if opt.zero_is_unbounded:
            if value < 0:
                raise ConfigError(f"--{self.flag} must be 0 (no bound) or more, got {value}")
            return value or None
        if opt.minimum is not None and value < opt.minimum:
            raise ConfigError(f"--{self.flag} must be at least {opt.minimum}, got {value}")
        if opt.positive and value <= 0:
            raise ConfigError(f"--{self.flag} must be positive, got {value}")
        return value


def settings(cls: type) -> tuple[Setting, ...]:
    """The option() fields of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Setting(cls, f.name, _base_type(hints[f.name]), f.default, f.metadata[_KEY])
        for f in dataclasses.fields(cls)
        if _KEY in f.metadata
    )


def collect(classes: tuple[type, ...], options: dict[str, Any]) -> dict[type, dict[str, Any]]:
    """Keyword options -> {config class: {field: parsed value}}. A None value is "not given": the
    field keeps its default. Unknown names are a ConfigError naming them."""
    by_name = {s.name: s for cls in classes for s in settings(cls)}
    unknown = sorted(set(options) - set(by_name))
    if unknown:
        raise ConfigError(f"unknown options: {', '.join(unknown)}")
    out: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for name, value in options.items():
        if value is not None:
            s = by_name[name]
            out[s.owner][s.field] = s.parse(value)
    return out


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, items: tuple[Setting, ...]) -> None:
    """One flag per setting. A switch that is on by default gets a --no- form; one that is off is
    a plain flag. Defaults are shown by DefaultsHelpFormatter."""
    for s in items:
        text = s.option.help.replace("%", "%%")
        if s.default in (None, ()) and s.option.none:
            text += f" (default: {s.option.none})"
        kwargs: dict[str, Any] = {"dest": s.name, "help": text}
        if s.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if s.default else "store_true"
            kwargs["default"] = s.default
        elif s.type is tuple:
            kwargs.update(nargs="*", default=list(s.default))
        else:
            default = s.default.value if isinstance(s.default, enum.Enum) else s.default
            kwargs.update(type=str if s.choices else s.type, default=default)
            if s.choices:
                kwargs["choices"] = s.choices
        parser.add_argument(f"--{s.flag}", **kwargs)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the default is None or empty (the help then
    says what that means) or the help already shows it (BooleanOptionalAction adds its own)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, argparse.SUPPRESS, []) or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def _base_type(hint: Any) -> type:
    """int | None -> int; tuple[str, ...] -> tuple."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) or hint
