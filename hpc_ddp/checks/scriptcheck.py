"""What the script's own text says before anything queues (submit, its --dry-run, doctor): that it compiles,
and what its own mp.spawn would start under the tasks hpc-ddp starts. Nothing is imported or run: the text
is compiled (`compile()`, as `python -m py_compile` does) and read.

- A script that does not compile would be accepted, wait in the queue, start on every node and fail with a
  SyntaxError. Refused in one line that names the file, the line, the character and the fix; the usual one
  is a no-break space (U+00A0) copied with the code from a web page.
- A script that starts its own ranks with `mp.spawn(fn, nprocs=N)` (or `start_processes`) under hpc-ddp,
  which already starts one task per GPU: with more than one task per node every task spawns its own N
  processes, all on the script's one fixed port; with N above the GPUs a task gets, `.to(rank)` names a GPU
  the process cannot see ("invalid device ordinal"). Both refused, with the two forms that work.
"""

from __future__ import annotations

import os
import re

from hpc_ddp.checks.finding import Finding
from hpc_ddp.job.devicescan import code_part

__all__ = ["compile_findings", "spawn_findings", "script_findings"]

# Characters a copy from a web page or a word processor brings along, by name, with the plain one to use.
_LOOKALIKES = {
    "\u00a0": ("a no-break space", " "), "\u200b": ("a zero-width space", ""), "\u2009": ("a thin space", " "),
    "\u202f": ("a narrow no-break space", " "), "\ufeff": ("a zero-width no-break space", ""),
    "\u2018": ("a curly quote", "'"), "\u2019": ("a curly quote", "'"), "\u201c": ("a curly quote", '"'),
    "\u201d": ("a curly quote", '"'), "\u2013": ("an en dash", "-"), "\u2212": ("a minus sign", "-"),
}


def compile_findings(name: str, text: str) -> list[Finding]:
    """An error where `text` (the script `name`) does not compile; nothing otherwise."""
    try:
        compile(text, name, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return [_syntax_error(name, text, exc)]
    except (ValueError, RecursionError, MemoryError) as exc:  # a NUL byte; nesting the compiler gives up on
        return [Finding("error", f"{name} does not compile: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                        hint=f"fix it, then check with: python -m py_compile {name}")]
    return []


def _syntax_error(name: str, text: str, exc: SyntaxError) -> Finding:
    line = exc.lineno or 0
    message = (exc.msg or "invalid syntax").splitlines()[0]
    odd = sorted({ch for ch in text if ch in _LOOKALIKES})
    if odd:
        lines = [n for n, raw in enumerate(text.splitlines(), 1) if any(ch in raw for ch in odd)]
        chars = ", ".join(f"U+{ord(ch):04X} ({_LOOKALIKES[ch][0]})" for ch in odd)
        where = f"line {lines[0]}" if len(lines) == 1 else f"lines {_spans(lines)}"
        count = sum(text.count(ch) for ch in odd)
        quotes = any(_LOOKALIKES[ch][1] in ("'", '"') for ch in odd)  # no sed line that shell quoting spoils
        sed = "; ".join(f"s/{_sed_bytes(ch)}/{_LOOKALIKES[ch][1]}/g" for ch in odd)
        fix = (f"replace {'it' if count == 1 else 'them'} with plain characters in your editor"
               + ("" if quotes else f", or run: sed -i '{sed}' {name}"))
        times = "once" if count == 1 else f"{count} times"
        return Finding("error", f"{name} line {line} does not compile ({message}): {chars}, pasted with the code "
                                f"from a web page, {times} on {where}",
                       hint=fix)
    shown = (exc.text or "").strip()
    shown = f": {shown[:60]}" if shown and shown.isprintable() else ""
    return Finding("error", f"{name} line {line} does not compile: {message}{shown}",
                   hint=f"fix line {line}, then check with: python -m py_compile {name}")


def _sed_bytes(ch: str) -> str:
    return "".join(f"\\x{b:02x}" for b in ch.encode())


def _spans(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:5])
    return shown + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


# ---- mp.spawn ----

_SKIP = "; --no-preflight submits it as it is"  # its processes may not be ranks (a pool of workers)
_SPAWN_CALL = re.compile(r"\b(?:mp|multiprocessing)\.spawn\s*\(|\bstart_processes\s*\(")
_NPROCS = re.compile(r"\bnprocs\s*=\s*([A-Za-z_][\w.]*|\d+)")


def _spawn_call(text: str) -> tuple[int, str] | None:
    """(line number, the call's text and the lines after it) of the first mp.spawn."""
    lines = text.splitlines()
    for number, raw in enumerate(lines, 1):
        found = _SPAWN_CALL.search(code_part(raw[:1000]))
        if found:
            call = " ".join(code_part(x[:1000]) for x in lines[number - 1:number + 4])
            return number, call[found.start():]
    return None


def _nprocs(call: str, text: str) -> tuple[int | None, str]:
    """The spawn's process count where the text says it (a literal, or a name bound once to one), and how
    it is written; (None, ...) where it cannot be known; 1 where nprocs is not given (spawn's default)."""
    found = _NPROCS.search(call)
    if found is None:
        return (1, "nprocs=1 (the default)") if "nprocs" not in call else (None, "nprocs")
    value = found.group(1)
    if value.isdigit():
        return int(value), f"nprocs={value}"
    bound = {int(m.group(1)) for m in re.finditer(rf"^\s*{re.escape(value)}\s*=\s*(\d+)\s*(?:#.*)?$", text, re.M)}
    if len(bound) == 1:
        n = bound.pop()
        return n, f"nprocs={value}={n}"
    return None, f"nprocs={value}"


def spawn_findings(spec, name: str, text: str) -> list[Finding]:
    """Errors where the script's own mp.spawn cannot work under the tasks hpc-ddp starts."""
    found = _spawn_call(text)
    if found is None:
        return []
    line, call = found
    n, written = _nprocs(call, text)
    tasks, gpus = spec.tasks_per_node, spec.gpus
    per_task = gpus // tasks if gpus and tasks else 0
    instead = ("submit it with --tasks-per-node 1 on one node (mp.spawn then starts the node's processes), or "
               "drop mp.spawn and let hpc-ddp start one task per GPU, as examples/spawn_mnist.py does "
               "(hpc_ddp.start() instead of its own MASTER_ADDR/PORT)" + _SKIP)
    if tasks > 1:
        each = f"{n} processes" if n is not None else "its own processes"
        return [Finding("error", f"{name} line {line} starts its own ranks with mp.spawn ({written}), and hpc-ddp "
                                 f"starts {tasks} tasks per node: each would spawn {each}, on the script's one "
                                 "MASTER_PORT", hint=instead)]
    if n is not None and gpus and n > per_task:
        return [Finding("error", f"{name} line {line} starts {n} processes with mp.spawn ({written}), but each task "
                                 f"gets {per_task} GPU{'s' if per_task != 1 else ''} (--gpus {gpus}, {tasks} task per "
                                 f"node): process {per_task} would name a GPU it cannot see (CUDA error: invalid "
                                 "device ordinal)",
                        hint=f"submit with --gpus {n} --tasks-per-node 1, or " + instead.split(", or ", 1)[1])]
    return []


def is_spawn_finding(finding: Finding) -> bool:
    """One of spawn_findings' (submit --no-preflight makes them warnings)."""
    return finding.hint is not None and finding.hint.endswith(_SKIP)


def script_findings(spec, path: str, text: str) -> list[Finding]:
    """Everything above for the script at `path` (its text `text`)."""
    name = os.path.basename(path)
    problems = compile_findings(name, text) if path.endswith(".py") or spec.target.kind == "script" else []
    return problems + spawn_findings(spec, name, text)
