"""Stop requests: signal handlers only set a flag; the training loop acts on it at a step boundary.

Saving inside a handler is fragile (the handler can run in the middle of a collective or of a save);
instead every rank reports its flag in the per-step collective and all ranks stop at the same step.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

__all__ = ["StopFlag"]


class StopFlag:
    def __init__(self, signals: Iterable[str] = ("USR2", "TERM")):
        self.signals = tuple(dict.fromkeys(signals))
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def request(self, why: str) -> None:
        self.received = self.received or why

    def _handle(self, signum: int, _frame) -> None:
        self.request(signal.Signals(signum).name)

    def install(self) -> "StopFlag":
        for name in self.signals:
            signum = getattr(signal, f"SIG{name}")
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def still_installed(self) -> list[str]:
        """Signals whose handler is no longer ours (a library replaced it): empty when all is well."""
        return [name for name in self.signals if signal.getsignal(getattr(signal, f"SIG{name}")) != self._handle]

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
