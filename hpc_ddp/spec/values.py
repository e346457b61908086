"""Value parsers shared by the job spec and the trainer's settings: raw value (a flag's string or a
TOML value) -> typed value, or ValueError with the reason. The caller adds where the value came from."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["count", "number", "choice", "flag"]


def count(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    """A whole number >= minimum (and <= maximum: every count has a sane ceiling, so a typo of a few
    extra digits is refused here rather than by Slurm hours later, or by an overflow at run time)."""
    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"{_short(raw)} is not a whole number")
        try:
            value = raw if isinstance(raw, int) else int(raw.strip())
        except ValueError:
            raise ValueError(f"{_short(raw)!r} is not a whole number") from None
        if value < minimum:
            raise ValueError(f"{_short(value)} is below the minimum of {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{_short(value)} is above the maximum of {maximum}")
        return value
    return parse


def number(minimum: float, *, strict: bool = False, maximum: float | None = None) -> Callable[[Any], float]:
    """A finite float >= minimum (> minimum when strict, <= maximum when given). NaN and infinity are
    refused: NaN compares false with everything, so it would pass any range check and train to loss nan."""
    def parse(raw: Any) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ValueError(f"{raw!r} is not a number")
        try:
            value = float(raw)
        except OverflowError:  # an int beyond any float
            raise ValueError(f"{_short(raw)} is too large") from None
        except ValueError:
            raise ValueError(f"{_short(raw)!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{raw!r} is not a finite number")
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"{value} must be {'greater than' if strict else 'at least'} {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{value} is above the maximum of {maximum}")
        return value
    return parse


def _short(value: Any) -> str:
    """A value for a message: a 5,000-digit number is shown by its length."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except ValueError:  # an int of more digits than Python will print
        return "a number of thousands of digits"
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} characters)"


def choice(options: Sequence[str]) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        value = str(raw).strip().lower()
        if value not in options:
            raise ValueError(f"{raw!r} is not one of {', '.join(options)}")
        return value
    return parse


def flag(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not true or false")
