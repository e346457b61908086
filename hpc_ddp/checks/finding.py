"""One answer of a check before the queue: a level and one line with its fix. Made by the preflight
(preflight.py) and the checks it calls (hostcheck.py, interpreter_check.py), so it lives below all of them."""

from __future__ import annotations

import dataclasses

__all__ = ["Finding"]


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str  # "error" (cannot run as asked) | "warning" (may not do what you mean) | "ok"
    message: str
    hint: str | None = None

    def line(self) -> str:
        return f"{self.level}: {self.message}" + (f" HINT: {self.hint}" if self.hint else "")
