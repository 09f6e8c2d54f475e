"""Settings read from environment variables: one declaration per variable, one error style.

A service declares, for each field of its config, the variable it comes from and how the
variable's text becomes a value (:class:`Setting`); :func:`load` reads them all. An unset
or empty variable keeps the field's default. Text that does not parse, or falls outside
the declared bounds, is refused naming the variable and what was expected::

    GPUSCHED_TIME_SCALE: expected a number > 0, got 'abc'

Rules that hold however a config is built (from flags, from code) stay in the config's
own checks; these parsers only turn text into typed values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: where every service looks for NATS when ``NATS_URL`` is not set
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A variable is missing or invalid; ``variable`` names it."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
        self.problem = problem


@dataclass(frozen=True)
class Parser(Generic[T]):
    """Turns a variable's text into a value; ``convert`` raises ValueError on bad text."""

    #: what the text should be, as an error says it ("an integer >= 1")
    expected: str
    convert: Callable[[str], T]

    def parse(self, variable: str, text: str) -> T:
        try:
            return self.convert(text)
        except ValueError:
            raise SettingError(variable, f"expected {self.expected}, got {text!r}") from None


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable and the parser of its text."""

    variable: str
    parser: Parser[T]

    def read(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The parsed value, or None when the variable is unset or empty."""
        env = os.environ if environ is None else environ
        text = env.get(self.variable, "").strip()
        return self.parser.parse(self.variable, text) if text else None


def load(
    settings: Mapping[str, Setting[Any]], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Field name -> parsed value, for every declared variable that is set and not empty."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field_name, setting in settings.items():
        value = setting.read(env)
        if value is not None:
            values[field_name] = value
    return values


# ---------------------------------------------------------------------- parsers


def _bounds(low: float | None, high: float | None, *, above: bool = False) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" {'>' if above else '>='} {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def _within(value: float, low: float | None, high: float | None, above: bool) -> bool:
    if low is not None and (value <= low if above else value < low):
        return False
    return high is None or value <= high


def integer(low: int | None = None, high: int | None = None) -> Parser[int]:
    def convert(text: str) -> int:
        value = int(text)
        if not _within(value, low, high, above=False):
            raise ValueError(text)
        return value

    return Parser(f"an integer{_bounds(low, high)}", convert)


def number(
    low: float | None = None, high: float | None = None, *, above: bool = False
) -> Parser[float]:
    """A finite float; ``above`` makes ``low`` exclusive (``number(0, above=True)``: > 0)."""

    def convert(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or not _within(value, low, high, above):
            raise ValueError(text)
        return value

    return Parser(f"a number{_bounds(low, high, above=above)}", convert)


def boolean() -> Parser[bool]:
    def convert(text: str) -> bool:
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(text)

    return Parser(f"one of {', '.join(_TRUE + _FALSE)}", convert)


def text() -> Parser[str]:
    return Parser("text", str)


def path() -> Parser[Path]:
    return Parser("a path", lambda raw: Path(raw).expanduser())


def one_of(*choices: str) -> Parser[str]:
    """One of ``choices``, compared without case."""

    def convert(raw: str) -> str:
        lowered = raw.lower()
        if lowered not in choices:
            raise ValueError(raw)
        return lowered

    return Parser(f"one of {', '.join(choices)}", convert)


def integers(low: int | None = None) -> Parser[tuple[int, ...]]:
    """Comma-separated integers (``0,2,3``); empty items are refused."""
    element = integer(low)

    def convert(raw: str) -> tuple[int, ...]:
        return tuple(element.convert(part.strip()) for part in raw.split(","))

    bounds = _bounds(low, None)
    return Parser(f"comma-separated integers{bounds}", convert)
