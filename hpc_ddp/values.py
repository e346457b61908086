"""Value parsers shared by the job spec and the trainer's settings: raw value (a flag's string or a
TOML value) -> typed value, or ValueError with the reason. The caller adds where the value came from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["count", "number", "choice", "flag"]


def count(minimum: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ValueError(f"{raw!r} is not a whole number")
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise ValueError(f"{raw!r} is not a whole number") from None
        if value < minimum:
            raise ValueError(f"{value} is below the minimum of {minimum}")
        return value
    return parse


def number(minimum: float, *, strict: bool = False) -> Callable[[Any], float]:
    """A float >= minimum (> minimum when strict)."""
    def parse(raw: Any) -> float:
        if isinstance(raw, bool):
            raise ValueError(f"{raw!r} is not a number")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{raw!r} is not a number") from None
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"{value} must be {'greater than' if strict else 'at least'} {minimum}")
        return value
    return parse


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
