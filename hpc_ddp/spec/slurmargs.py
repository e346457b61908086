"""Extra sbatch and srun options (--sbatch-arg, --srun-arg): which are accepted, and what never gets through.

Accepted: the options of the installed tool, read off its `--help` at the edge (`slurm.helptext`) and passed
in as `known`. That is where a site's SPANK plugins show theirs (pyxis's --container-image, Shifter's
--image). A fixed list of Slurm's own options is accepted too, since help text hides some (srun lists
--cpu-bind only where task/affinity is configured). Where the tool is not on PATH (`known` is None), a
well-formed option outside the fixed list is let through and the caller warns (`unlisted`): nothing here
can submit to Slurm without sbatch, and on the cluster sbatch refuses an unknown option before it
queues anything.

Never accepted, whatever the tool says:

- options hpc-ddp sets itself (`managed`, option -> the setting to use instead);
- options that change what the command does rather than the job (--parsable, --wait, --pty, --help);
- values that could leave the place they land in. sbatch options become `#SBATCH` lines: no control
  character (a newline would end the directive block), `#` (a comment), quote, backslash or whitespace.
  srun options are shell-quoted words on the srun line; they refuse control characters, whitespace,
  quotes, backslashes and shell syntax (`;`, `|`, `&`, `$`, backquote, `<`, `>`) too, since such a value
  is a mistake (srun would get `;` literally: no shell ever runs it). `#` is allowed there: pyxis
  spells images `nvcr.io#nvidia/pytorch:24.01-py3`.

Pure.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

__all__ = ["SBATCH", "SRUN", "SBATCH_OPTIONS", "SRUN_OPTIONS", "SRUN_MANAGED", "check_option", "directive_safe",
           "option_name", "unlisted"]

SBATCH = "sbatch"
SRUN = "srun"

# Slurm's own long options (22.05 to 24.x), so a typo is caught even where --help hides an option.
SBATCH_OPTIONS = frozenset({
    "array", "begin", "comment", "contiguous", "core-spec", "cores-per-socket", "cpu-freq", "deadline",
    "delay-boot", "dependency", "distribution", "exclude", "exclusive", "export", "get-user-env",
    "gid", "gpu-bind", "gpu-freq", "gpus", "gpus-per-socket", "gpus-per-task", "hint", "hold",
    "kill-on-invalid-dep", "licenses", "mail-type", "mail-user", "mcs-label", "mem-bind", "mem-per-cpu",
    "mem-per-gpu", "mincpus", "network", "nice", "no-kill", "nodefile", "nodelist", "ntasks-per-core",
    "ntasks-per-gpu", "ntasks-per-socket", "overcommit", "oversubscribe", "power", "priority", "profile",
    "propagate", "reservation", "sockets-per-node", "spread-job", "switches", "thread-spec",
    "threads-per-core", "time-min", "tmp", "uid", "use-min-nodes", "wait-all-nodes", "wckey",
    "cluster-constraint", "clusters", "cpus-per-gpu", "extra-node-info",
})
SRUN_OPTIONS = frozenset({
    "accel-bind", "acctg-freq", "bb", "bbf", "bcast", "bcast-exclude", "begin", "cluster-constraint", "clusters",
    "comment", "compress", "container", "contiguous", "core-spec", "cores-per-socket", "cpu-bind", "cpu-freq",
    "cpus-per-gpu", "deadline", "delay-boot", "dependency", "distribution", "epilog", "exact", "exclude",
    "exclusive", "export", "extra-node-info", "gpu-bind", "gpu-freq", "gpus", "gpus-per-socket", "gpus-per-task",
    "hint", "hold", "immediate", "label", "licenses", "mail-type", "mail-user", "mcs-label", "mem-bind",
    "mem-per-cpu", "mem-per-gpu", "mincpus", "mpi", "network", "nice", "no-kill", "nodelist", "ntasks-per-core",
    "ntasks-per-gpu", "ntasks-per-socket", "overcommit", "overlap", "oversubscribe", "power", "preserve-env",
    "priority", "profile", "prolog", "propagate", "quiet", "reboot", "reservation", "resv-ports", "send-libs",
    "slurmd-debug", "sockets-per-node", "spread-job", "switches", "task-epilog", "task-prolog", "thread-spec",
    "threads", "threads-per-core", "time-min", "tmp", "tres-per-task", "unbuffered", "use-min-nodes", "verbose",
    "wait", "wckey",
})
_FIXED = {SBATCH: SBATCH_OPTIONS, SRUN: SRUN_OPTIONS}

# srun options that hpc-ddp's srun lines set (the ranks' step, and the per-node setup's).
SRUN_MANAGED = {
    "nodes": "--nodes", "ntasks": "--nodes and --tasks-per-node", "ntasks-per-node": "--tasks-per-node",
    "cpus-per-task": "--cpus-per-task", "gpus-per-node": "--gpus", "gres": "--gpus", "mem": "--mem",
    "time": "--time", "job-name": "--job-name", "output": "--run-dir (rank logs go under it)",
    "error": "--run-dir (rank logs go under it)", "kill-on-bad-exit": "nothing (a dead rank always ends the step)",
    "signal": "--signal and --signal-lead", "chdir": "nothing (the ranks start in the submit directory)",
    "partition": "--partition (the job's)", "account": "--account (the job's)", "qos": "--qos (the job's)",
    "constraint": "--constraint (the job's)", "jobid": "nothing (the ranks run in their own job)",
}
# Options that change what the command does, not the job: hpc-ddp reads sbatch's output and waits on srun.
_NOT_FOR_JOBS = {
    SBATCH: {"help", "usage", "version", "parsable", "test-only", "wait", "quiet", "verbose", "export-file"},
    SRUN: {"help", "usage", "version", "pty", "multi-prog", "no-allocate", "test-only", "input", "disable-status",
           "quit-on-interrupt", "het-group", "relative"},
}
_SHELL_SYNTAX = set(";|&$`<>")


def option_name(arg: str) -> str:
    """'--mail-type=END' -> 'mail-type'."""
    return arg[2:].partition("=")[0]


def check_option(raw: object, tool: str, managed: Mapping[str, str], known: frozenset[str] | None) -> str:
    """`raw` as one accepted option of `tool`, or ValueError naming what is wrong (and the fix)."""
    value = str(raw).strip()
    m = re.fullmatch(r"--([a-z][a-z0-9_-]*)(?:=(.*))?", value, re.DOTALL)
    if not m:
        raise ValueError(f"{_short(raw)} is not of the form --option or --option=value (use the long form)")
    name, arg = m.group(1), m.group(2)
    if name in managed:
        raise ValueError(f"--{name} is set by hpc-ddp; use {managed[name]} instead")
    if name in _NOT_FOR_JOBS[tool]:
        raise ValueError(f"--{name} changes how {tool} itself behaves, not the job; hpc-ddp runs {tool} itself")
    accepted = _FIXED[tool] | (known or frozenset())
    if known is not None and name not in accepted:
        close = difflib.get_close_matches(name, sorted(accepted | set(managed)), n=1, cutoff=0.75)
        guess = f" (did you mean --{close[0]}?)" if close else f" (`{tool} --help` here lists no --{name})"
        raise ValueError(f"--{name} is not an {tool} option{guess}")
    if arg is not None and tool == SBATCH:
        directive_safe(arg)
        if any(c.isspace() for c in arg):
            raise ValueError("the value contains whitespace")
    elif arg is not None:
        _word_safe(name, arg)
    return value


def unlisted(args: Iterable[str], tool: str) -> list[str]:
    """The options in `args` that the fixed list does not know: unchecked where `tool` is not installed."""
    return [arg for arg in args if option_name(arg) not in _FIXED[tool]]


def directive_safe(value: str) -> str:
    """A value that can sit inside an `#SBATCH` line without ending it or starting a comment."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("contains a control character (newline, NUL, ...), which would end the #SBATCH line")
    for bad, why in (("#", "starts a comment in an #SBATCH line"), ('"', "is a quote"), ("'", "is a quote"),
                     ("\\", "is an escape character")):
        if bad in value:
            raise ValueError(f"contains {bad!r}, which {why}")
    if not value.strip():
        raise ValueError("is empty")
    return value


def _word_safe(name: str, value: str) -> None:
    """A value for a word of an srun line: quoted there, and refused where it can only be a mistake."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"--{name}: the value contains a control character (newline, NUL, ...)")
    if any(c.isspace() for c in value):
        raise ValueError(f"--{name}: the value contains whitespace (give each option as one --srun-arg)")
    for bad in ('"', "'", "\\", *sorted(_SHELL_SYNTAX)):
        if bad in value:
            why = "$NAME is not expanded" if bad == "$" else "no shell reads it"
            raise ValueError(f"--{name}: the value contains {bad!r}: srun gets it as written, {why}")


def _short(raw: object) -> str:
    text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."
