"""The edge to external commands (sbatch, squeue, scontrol, ...): a tiny interface with a real and a fake.

Executors and status commands take a `CommandRunner`; tests pass a `FakeCommands` with scripted answers
instead of patching subprocess (in the spirit of httpx's MockTransport).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from .errors import SubmitError

__all__ = ["Completed", "CommandRunner", "SubprocessCommands", "FakeCommands", "slurm_unreachable"]

# What Slurm's commands print when the controller is down: not the user's mistake, try again later.
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused")


def slurm_unreachable(message: str) -> bool:
    return any(sign in message for sign in _UNREACHABLE)


@dataclasses.dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> Completed: ...

    def which(self, name: str) -> str | None: ...


class SubprocessCommands:
    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> Completed:
        try:
            proc = subprocess.run(list(argv), cwd=cwd, env=None if env is None else dict(env),
                                  capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise SubmitError(f"{argv[0]} not found", hint="is Slurm installed here (try `which sbatch`)?") from None
        except subprocess.TimeoutExpired:
            raise SubmitError(f"{argv[0]} did not answer within {timeout:.0f} s") from None
        return Completed(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def which(self, name: str) -> str | None:
        return shutil.which(name)


class FakeCommands:
    """Records every call; answers from `handlers` (command name -> function of argv) or a default."""

    def __init__(self, handlers: Mapping[str, Callable[[Sequence[str]], Completed]] | None = None,
                 installed: Sequence[str] = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")):
        self.handlers = dict(handlers or {})
        self.installed = set(installed)
        self.calls: list[tuple[tuple[str, ...], str | None]] = []

    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> Completed:
        self.calls.append((tuple(argv), cwd))
        handler = self.handlers.get(argv[0])
        if handler is None:
            return Completed(tuple(argv), 127, "", f"{argv[0]}: command not found")
        return handler(argv)

    def which(self, name: str) -> str | None:
        return f"/usr/bin/{name}" if name in self.installed else None
