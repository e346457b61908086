"""The site environment: variables a profile (`env` table), a job file or `--env KEY=VALUE` sets on every rank
(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NCCL_IB_HCA, HF_HOME, ...).

Owns what a name and a value may be, the names hpc-ddp sets itself (refused, with the setting to use), the
names the batch script's own bash depends on (refused: PATH, IFS, BASH_ENV, ...; a PATH that keeps $PATH is
fine), and
one expansion grammar used in two places: `expand` in Python (the runner, on every rank) and `bash_value`
(the batch script's `export` lines, for the setup lines, the per-node setup and a container runtime). In a
value, `$NAME` and `${NAME}` expand to that variable (empty if unset) and `$$` is a `$`; nothing else is
special: no command substitution, no globbing, no word splitting. Pure, standard library only (the
runner imports it inside containers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["parse_env", "expand", "bash_value", "managed_problem"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# $$, ${NAME}, $NAME; a `$` before anything else is itself.
_REFERENCE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
MAX_VALUE = 32 * 1024

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "NODE_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR")
_MANAGED = {
    **{name: "hpc-ddp sets it on every rank from Slurm's own variables" for name in _RANK_VARIABLES},
    "MASTER_PORT": "use --master-port", "CUDA_VISIBLE_DEVICES": "use --gpu-bind auto|node|rank",
    "HPC_DDP_CUDA_DEVICE": "use --gpu-bind auto|node|rank", "HPC_DDP_GPU_BINDING": "use --gpu-bind auto|node|rank",
    "HPC_DDP_WARNING_SIGNAL": "use --signal", "HPC_DDP_EVENTS_FILE": "hpc-ddp sets it to the run dir's events file",
    "BACKEND": "set HPC_DDP_BACKEND=nccl|gloo instead", "WORKSPACE": "hpc-ddp sets it to the run dir",
    "WORKER_PER_NODE": "hpc-ddp sets it to the ranks per node", "EPOCHS": "use --epochs", "LR": "use --lr",
    "BATCH_SIZE": "use --batch-size", "PYTHONUNBUFFERED": "hpc-ddp sets it, so a killed rank's log is complete",
}
_MANAGED_PREFIXES = {
    "HPC_DDP_": "hpc-ddp's own variables are set by hpc-ddp",
    "SLURM_": "it changes what Slurm does: give the option as --sbatch-arg or --srun-arg",
    "SBATCH_": "it changes what Slurm does: give the option as --sbatch-arg",
    "SRUN_": "it changes what Slurm does: give the option as --srun-arg",
    "TORCHELASTIC_": "it would make the runner take the job for torchrun's",
}
_YOURS = ("HPC_DDP_BACKEND", "HPC_DDP_RUN_ID")  # knobs hpc-ddp reads and never sets over yours
# Names the batch script's own bash depends on (it exports the env table before its srun): set there, the
# job breaks after it was queued, before any rank starts. (why, the fix)
_BATCH_SHELL = {
    "PATH": ("the batch script would no longer find srun, bash or python",
             "add to it instead, keeping the rest: PATH=/your/bin:$PATH (or change it in a setup line)"),
    "IFS": ("it changes how the batch script's bash splits words", "set it inside your program"),
    "BASH_ENV": ("every bash the job starts (srun's steps, node_setup) would source it first",
                 "put what it does in setup or node_setup lines"),
    "ENV": ("a shell the job starts would source it first", "put what it does in setup or node_setup lines"),
    **{name: ("bash's own read-only variable: the batch script cannot export it", "remove it from env")
       for name in ("SHELLOPTS", "BASHOPTS", "BASH_VERSINFO", "UID", "EUID", "PPID")},
}
_KEEPS_PATH = re.compile(r"\$(?:\{PATH\}|PATH(?![A-Za-z0-9_]))")


def managed_problem(name: str) -> str | None:
    """Why `name` cannot be set through env (the fix), or None when it can."""
    if name in _YOURS:
        return None
    if name in _MANAGED:
        return _MANAGED[name]
    return next((why for prefix, why in _MANAGED_PREFIXES.items() if name.startswith(prefix)), None)


def parse_env(raw: Any) -> tuple[tuple[str, str], ...]:
    """A table {NAME = "value"} (profile, job file) or a list of "NAME=value" (--env) -> ((name, value), ...)."""
    if isinstance(raw, Mapping):
        pairs = [(str(k), v) for k, v in raw.items()]
    elif isinstance(raw, (list, tuple)):
        pairs = [_split(item) for item in raw]
    else:
        raise ValueError("expected a table of NAME = \"value\" (or --env NAME=VALUE)")
    out: dict[str, str] = {}
    for name, value in pairs:
        out[_checked_name(name)] = _checked_value(name, value)
        _check_batch_shell(name, out[name])
    return tuple(out.items())


def _check_batch_shell(name: str, value: str) -> None:
    """A name the batch script's bash depends on is refused (one line, with the fix), before anything is
    queued; PATH only where its value drops the PATH it extends."""
    if name not in _BATCH_SHELL or (name == "PATH" and _KEEPS_PATH.search(value.replace("$$", ""))):
        return
    from hpc_ddp.common.errors import SpecError  # standard library only: the runner imports this module

    why, fix = _BATCH_SHELL[name]
    raise SpecError(f"{name} cannot be set through env: {why}", hint=fix)


def _split(item: Any) -> tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ValueError(f"{str(item)[:60]!r} is not NAME=VALUE")
    name, _, value = item.partition("=")
    return name, value


def _checked_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name[:60]!r} is not a variable name (a letter or _, then letters, digits or _)")
    problem = managed_problem(name)
    if problem:
        raise ValueError(f"{name} cannot be set through env: {problem}")
    return name


def _checked_value(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{name}: {repr(value)[:40]} is not a string (write it in quotes)")
    text = str(value)
    if any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in text):
        raise ValueError(f"{name}: the value contains a control character (newline, NUL, ...)")
    if len(text) > MAX_VALUE:
        raise ValueError(f"{name}: the value is longer than {MAX_VALUE} characters")
    return text


def expand(value: str, env: Mapping[str, str]) -> str:
    """`value` with $NAME, ${NAME} and $$ expanded against `env`, as `bash_value` makes bash do it."""
    def one(m: re.Match) -> str:
        return "$" if m.group(1) else env.get(m.group(2) or m.group(3), "")
    return _REFERENCE.sub(one, value)


def bash_value(value: str) -> str:
    """`value` as one double-quoted bash word that expands exactly as `expand` does: references become
    ${NAME-} (empty when unset, even under `set -u`), every other character is literal."""
    out, at = ['"'], 0
    for m in _REFERENCE.finditer(value):
        out.append(_literal(value[at:m.start()]))
        out.append("\\$" if m.group(1) else f"${{{m.group(2) or m.group(3)}-}}")
        at = m.end()
    out.append(_literal(value[at:]))
    return "".join(out) + '"'


def _literal(text: str) -> str:
    """Inside double quotes only $, `, \\ and " are special (and ! in an interactive shell, not a script)."""
    return re.sub(r'([$`\\"])', r"\\\1", text)
