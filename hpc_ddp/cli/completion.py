"""Shell completion for `hpc-ddp` (bash, zsh, fish) through click's own mechanism, plus the values only
hpc-ddp knows: job ids (the run registry), run dirs, and profile names (the profiles file).

    eval "$(_HPC_DDP_COMPLETE=bash_source hpc-ddp)"                            # in ~/.bashrc
    eval "$(_HPC_DDP_COMPLETE=zsh_source hpc-ddp)"                             # in ~/.zshrc
    _HPC_DDP_COMPLETE=fish_source hpc-ddp > ~/.config/fish/completions/hpc-ddp.fish

`hpc-ddp completion SHELL` prints the same script.

Completion runs on every TAB, so it is fast (one bounded read of one file) and never fails loudly:
anything wrong with a file (missing, unreadable, a FIFO, not TOML, hostile lines) gives no completions,
not a traceback. A value is only offered when the shells' completion scripts pass it through whole: no
control characters (a newline would start another completion), whitespace, glob characters or a
leading dash. Real paths are left to the shell's own directory and file completion, which quotes them.

`install(group)` attaches the completers by parameter name, so the command modules need not know.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import click
from click.shell_completion import CompletionItem

__all__ = ["install", "complete_job", "complete_run_dir", "complete_profile", "recent_jobs", "profile_names",
           "completion_command", "COMPLETE_VAR"]

REGISTRY_TAIL = 256 * 1024    # bytes of the run registry read: its newest few hundred runs
PROFILES_LIMIT = 1024 * 1024  # a profiles file larger than this is not a profiles file
MAX_JOBS = 100
COMPLETE_VAR = "_HPC_DDP_COMPLETE"  # click's name for it: _{PROG_NAME}_COMPLETE
_UNSAFE = frozenset("*?[]'\"\\$`;&|<>(){}")

Completer = Callable[[click.Context, click.Parameter, str], list[CompletionItem]]


def _never_loud(fn: Completer) -> Completer:
    @functools.wraps(fn)
    def wrapper(ctx, param, incomplete):
        try:
            return fn(ctx, param, incomplete)
        except Exception:  # noqa: BLE001 - a TAB must never print a traceback into the user's prompt
            return []
    return wrapper


def offerable(value: str) -> bool:
    return bool(value) and value.isprintable() and not value.startswith("-") \
        and not any(c.isspace() or c in _UNSAFE for c in value)


# ---- the sources: bounded reads that give nothing rather than fail ----

def _read_tail(path: Path, limit: int) -> bytes:
    """The last `limit` bytes of a regular file (symlinks followed; a FIFO or device is never opened)."""
    real = os.path.realpath(path)
    if not stat.S_ISREG(os.stat(real).st_mode):
        return b""
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as fh:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        fh.seek(max(0, size - limit))
        data = fh.read(limit)
    return data if size <= limit else data[data.find(b"\n") + 1:]  # drop the line cut in two


def recent_jobs(env: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(job id, run dir) of this user's recent runs whose run dir still exists, newest first, each once."""
    from hpc_ddp.watch.registry import registry_path

    seen: dict[str, str] = {}
    for line in reversed(_read_tail(registry_path(env), REGISTRY_TAIL).splitlines()):
        record = _record(line)
        job_id, run_dir = str(record.get("job_id") or ""), record.get("run_dir")
        if job_id and job_id not in seen and isinstance(run_dir, str) and os.path.isdir(run_dir):
            seen[job_id] = run_dir
        if len(seen) >= MAX_JOBS:
            break
    return list(seen.items())


def _record(line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def profile_names(env: Mapping[str, str] = os.environ) -> list[str]:
    """The tables of the profiles file `--profile` reads (HPC_DDP_PROFILES, else the XDG config)."""
    from hpc_ddp.spec.config import profiles_path

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    data = _read_tail(profiles_path(env), PROFILES_LIMIT + 1)
    if len(data) > PROFILES_LIMIT:
        return []
    return sorted(name for name, table in tomllib.loads(data.decode()).items() if isinstance(table, dict))


# ---- the completers ----

def _plain(values: Iterator[tuple[str, str | None]], incomplete: str) -> list[CompletionItem]:
    """Items for the values that are offerable; a description (zsh and fish show it) only where it is
    printable: click writes value and description on lines of their own, so a newline in a run dir's name
    would add a completion of its own (`-rf`)."""
    return [CompletionItem(value, help=help_ if help_ and help_.isprintable() else None) for value, help_ in values
            if value.startswith(incomplete) and offerable(value)]


def _looks_like_path(incomplete: str) -> bool:
    return incomplete.startswith((".", "/", "~")) or "/" in incomplete


@_never_loud
def complete_job(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """A job id from the registry (its run dir's name as help), else the shell's directory completion."""
    if not _looks_like_path(incomplete):
        found = _plain(((job, Path(run_dir).name) for job, run_dir in recent_jobs()), incomplete)
        if found:
            return found
    return [CompletionItem(incomplete, type="dir")]


@_never_loud
def complete_run_dir(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The registry's run dirs under this directory (as relative paths), else the shell's directories."""
    here = Path.cwd()
    relative: dict[str, str] = {}
    for job, run_dir in recent_jobs():
        path = Path(run_dir)
        if path.is_relative_to(here) and path != here:
            relative.setdefault(str(path.relative_to(here)), f"job {job}")
    return _plain(iter(relative.items()), incomplete) or [CompletionItem(incomplete, type="dir")]


@_never_loud
def complete_profile(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return _plain(((name, None) for name in profile_names()), incomplete)


def _native(kind: str) -> Completer:
    def complete(ctx, param, incomplete):
        return [CompletionItem(incomplete, type=kind)]
    return complete


# ("argument" or "option", parameter name) -> completer
COMPLETERS: dict[tuple[str, str], Completer] = {
    ("argument", "job"): complete_job,
    ("option", "after"): complete_job,
    ("argument", "run_dir"): complete_run_dir,
    ("option", "profile"): complete_profile,
    ("option", "run_dir"): _native("dir"),
    ("option", "python"): _native("file"),
    ("option", "output"): _native("file"),
}


def install(group: click.Group) -> None:
    """Attach the completers to every command's parameters of those names (click's `shell_complete=`,
    set after the fact so the command modules stay as they are)."""
    for command in group.commands.values():
        for param in command.params:
            completer = COMPLETERS.get((param.param_type_name, param.name or ""))
            if completer is not None:
                param._custom_shell_complete = completer


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion_command(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL (job ids, run dirs and profile names complete too).

    \b
      eval "$(hpc-ddp completion bash)"                                 # in ~/.bashrc
      eval "$(hpc-ddp completion zsh)"                                  # in ~/.zshrc, after compinit
      hpc-ddp completion fish > ~/.config/fish/completions/hpc-ddp.fish
    """
    from click.shell_completion import get_completion_class

    root = ctx.find_root()
    source = get_completion_class(shell)(root.command, {}, root.info_name or "hpc-ddp", COMPLETE_VAR).source()
    click.echo(source)
