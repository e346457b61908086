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

import ast
import io
import os
import re
import tokenize
import zipfile

from hpc_ddp.checks.finding import Finding
from hpc_ddp.checks.rankcompile import RanksVerdict
from hpc_ddp.job.devicescan import code_part
from hpc_ddp.launch.shellwords import bash_word

__all__ = ["compile_findings", "spawn_findings", "script_findings", "is_compile_finding", "is_spawn_finding"]

# Characters a copy from a web page or a word processor brings along, by name, with the plain one to use.
_LOOKALIKES = {
    "\u00a0": ("a no-break space", " "), "\u200b": ("a zero-width space", ""), "\u2009": ("a thin space", " "),
    "\u202f": ("a narrow no-break space", " "), "\ufeff": ("a zero-width no-break space", ""),
    "\u2018": ("a curly quote", "'"), "\u2019": ("a curly quote", "'"), "\u201c": ("a curly quote", '"'),
    "\u201d": ("a curly quote", '"'), "\u2013": ("an en dash", "-"), "\u2212": ("a minus sign", "-"),
}


def compile_findings(name: str, source: bytes | str, ranks: RanksVerdict | None = None) -> list[Finding]:
    """An error where `source` (the script `name`) does not compile; nothing otherwise. Given as bytes, it
    is compiled as `python -m py_compile` compiles the file: a UTF-8 BOM and a coding cookie are honoured,
    and a file in another encoding that declares none fails as it would on every rank. With `ranks` (the
    verdict of the ranks' own Python, where it is another interpreter: checks/rankcompile.py), that verdict
    is the one said, in this Python's words."""
    if ranks is not None:
        exc = ranks.error
        by = f" with the ranks' python {ranks.python} ({ranks.version})"
    else:
        exc, by = _compile_here(name, source), ""
    if exc is None:
        return []
    python = "python" if ranks is None else ranks.python
    if isinstance(exc, SyntaxError):
        if isinstance(source, bytes) and (exc.msg or "").startswith("(unicode error)") and "decode" in exc.msg:
            return [_not_utf8(name, source, exc, by, python)]
        text = source.decode("utf-8-sig", errors="replace") if isinstance(source, bytes) else source
        return [_syntax_error(name, text, exc, by, python)]
    return [Finding("error", f"{name} does not compile{by}: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                    hint=f"fix it, then check with: {bash_word(python)} -m py_compile {bash_word(name)}")]


def _compile_here(name: str, source: bytes | str) -> BaseException | None:
    try:
        compile(source, name, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # a NUL byte; nesting it gives up on
        return exc
    return None


def _not_utf8(name: str, source: bytes, exc: SyntaxError, by: str = "", python: str = "python") -> Finding:
    """A script that is not UTF-8 and names no other encoding (saved as latin-1 or cp1252 by an editor)."""
    first = next((i for i, line in enumerate(source.splitlines(), 1) if _undecodable(line)), exc.lineno or 0)
    return Finding("error", f"{name} line {first} does not compile{by}: it is not UTF-8 (Python's encoding for "
                            "source files) and names no other in a coding line",
                   hint=f"save {bash_word(name)} as UTF-8 in your editor, or put `# -*- coding: latin-1 -*-` "
                        f"(the encoding it is in) on its first line; then check with: "
                        f"{bash_word(python)} -m py_compile {bash_word(name)}")


def _undecodable(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _syntax_error(name: str, text: str, exc: SyntaxError, by: str = "", python: str = "python") -> Finding:
    line = exc.lineno or 0
    message = (exc.msg or "invalid syntax").splitlines()[0]
    # Only a look-alike outside a string literal breaks the code; inside one it is part of the string.
    outside, in_strings = _lookalikes(text)
    odd = sorted(outside)
    if odd:
        lines = [n for n, raw in enumerate(text.splitlines(), 1) if any(ch in raw for ch in odd)]
        chars = ", ".join(f"U+{ord(ch):04X} ({_LOOKALIKES[ch][0]})" for ch in odd)
        where = f"line {lines[0]}" if len(lines) == 1 else f"lines {_spans(lines)}"
        count = sum(text.count(ch) for ch in odd)
        quotes = any(_LOOKALIKES[ch][1] in ("'", '"') for ch in odd)  # no sed line that shell quoting spoils
        sed = "; ".join(f"s/{_sed_bytes(ch)}/{_LOOKALIKES[ch][1]}/g" for ch in odd)
        # sed replaces every one in the file: offered only where none of these sits inside a string literal,
        # whose meaning it would change
        fix = (f"replace {'it' if count == 1 else 'them'} with plain characters in your editor"
               + ("" if quotes or set(odd) & in_strings else f", or run: sed -i {bash_word(sed)} {bash_word(name)}"))
        times = "once" if count == 1 else f"{count} times"
        return Finding("error", f"{name} line {line} does not compile{by} ({message}): {chars}, pasted with the code "
                                f"from a web page, {times} on {where}",
                       hint=fix)
    shown = (exc.text or "").strip()
    shown = f": {shown[:60]}" if shown and shown.isprintable() else ""
    return Finding("error", f"{name} line {line} does not compile{by}: {message}{shown}",
                   hint=f"fix line {line}, then check with: {bash_word(python)} -m py_compile {bash_word(name)}")


def _lookalikes(text: str) -> tuple[set[str], set[str]]:
    """The look-alike characters of `text` outside string literals (comments count as outside: harmless,
    but a fix there changes no meaning), and those inside string literals. Tokenized as far as the text
    allows: past a point the tokenizer gives up at, every look-alike counts as outside, and as possibly
    inside a string too (what follows that point is not known)."""
    every = {ch for ch in text if ch in _LOOKALIKES}
    if not every:
        return set(), set()
    in_strings: dict[str, int] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.STRING or token.type in _FSTRING_PARTS:
                for ch in token.string:
                    if ch in _LOOKALIKES:
                        in_strings[ch] = in_strings.get(ch, 0) + 1
    except (tokenize.TokenError, SyntaxError, ValueError, IndentationError):
        # what was read up to there stands for the message; but where the rest of the file sits in strings
        # cannot be known, so each look-alike may be in one (no sed is offered)
        return {ch for ch in every if text.count(ch) > in_strings.get(ch, 0)}, every
    return {ch for ch in every if text.count(ch) > in_strings.get(ch, 0)}, set(in_strings)


_FSTRING_PARTS = {getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END",
                                                       "TSTRING_START", "TSTRING_MIDDLE", "TSTRING_END")
                  if hasattr(tokenize, name)}


def _sed_bytes(ch: str) -> str:
    return "".join(f"\\x{b:02x}" for b in ch.encode())


def _spans(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:5])
    return shown + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


# ---- mp.spawn ----

_SKIP = "; --no-preflight submits it as it is"  # its processes may not be ranks (a pool of workers)
_SPAWN_CALL = re.compile(r"\b(?:mp|multiprocessing)\.spawn\s*\(|\bstart_processes\s*\(")
_NPROCS = re.compile(r"\bnprocs\s*=\s*([A-Za-z_][\w.]*|\d+)")


# A spawn under a test of these runs only where the launcher set none of them: hpc-ddp sets them all, so a
# script that runs under torchrun and spawns its own ranks otherwise never spawns here.
_LAUNCHED = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "TORCHELASTIC_RUN_ID")


def _spawn_call(text: str) -> tuple[int, str] | None:
    """(line number, the call's text) of the first mp.spawn (or start_processes) the script calls, read from
    its syntax tree: a mention in a comment, a docstring or a string is none, nor is a call of a function of
    the script's own of that name, nor a spawn that runs only where no launcher set RANK or LOCAL_RANK
    (`_LAUNCHED`). A script that does not parse (the compile check says so) is read line by line."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return _spawn_call_in_lines(text)
    own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    modules, functions = _spawn_names(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    calls = sorted((node for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and _spawns(node.func, own, modules, functions)),
                   key=lambda node: (node.lineno, node.col_offset))
    launched = _launched_names(tree)
    for call in calls:
        if not _only_unlaunched(call, parents, launched):
            return call.lineno, " ".join((ast.get_source_segment(text, call) or "").split())
    return None


def _spawn_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names the script gives torch.multiprocessing (`mp`, `multiprocessing` and any `import
    torch.multiprocessing as X`), and its spawn functions imported by name (`from torch.multiprocessing
    import spawn as s`)."""
    modules, functions = {"mp", "multiprocessing"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == "torch.multiprocessing" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules.update(a.asname or a.name for a in node.names if a.name == "multiprocessing")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.multiprocessing"):
            functions.update(a.asname or a.name for a in node.names if a.name in ("spawn", "start_processes"))
    return modules, functions


def _spawns(func: ast.expr, own: set[str], modules: set[str], functions: set[str]) -> bool:
    """mp.spawn, multiprocessing.spawn, torch.multiprocessing.spawn (by any name the script gives it),
    start_processes; not a function of the script's own of that name."""
    if isinstance(func, ast.Name):
        return func.id not in own and (func.id == "start_processes" or func.id in functions)
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "start_processes":
        return True
    owner = func.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return func.attr == "spawn" and name in modules


def _launched_names(tree: ast.AST) -> set[str]:
    """Variables the script binds to a launcher's variable (`rank = os.environ.get("RANK")`): a test of one
    of them is a test of that variable."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = ast.unparse(node.value)
            if "environ" in value or "getenv" in value:
                if any(re.search(rf"['\"]{name}['\"]", value) for name in _LAUNCHED):
                    names.add(node.targets[0].id)
    return names


def _only_unlaunched(node: ast.AST, parents: dict[ast.AST, ast.AST], launched: set[str] = frozenset()) -> bool:
    """Does `node` run only where no launcher set its variables (the else of `if "LOCAL_RANK" in os.environ`,
    or the body of `if "RANK" not in os.environ`, or of `if rank is None` after `rank = os.environ.get("RANK")`)?
    Only a test that names one of `_LAUNCHED`, or a variable bound to one, counts."""
    child = node
    while child in parents:
        parent = parents[child]
        if isinstance(parent, (ast.If, ast.IfExp)):
            test = ast.unparse(parent.test)
            named = any(re.search(rf"\b{name}\b", test) for name in (*_LAUNCHED, *launched))
            in_else = child in (parent.orelse if isinstance(parent.orelse, list) else [parent.orelse])
            negated = " not in " in test or test.startswith("not ") or " is None" in test or "== ''" in test \
                or '== ""' in test
            if named and in_else != negated:
                return True
        child = parent
    return False


def _spawn_call_in_lines(text: str) -> tuple[int, str] | None:
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


def is_compile_finding(finding: Finding) -> bool:
    """One of compile_findings'."""
    return " does not compile" in finding.message


def is_spawn_finding(finding: Finding) -> bool:
    """One of spawn_findings' (submit --no-preflight makes them warnings)."""
    return finding.hint is not None and finding.hint.endswith(_SKIP)


def script_findings(spec, path: str, data: bytes, text: str | None,
                    ranks: RanksVerdict | None = None) -> list[Finding]:
    """Everything above for the script at `path`: its bytes `data` compiled (`ranks`: the ranks' own
    Python's verdict, where it was asked), and its text `text` read (None: too big to be read, compiled
    only). A zipapp (`python app.pyz`) is Python's to open, not compiled here."""
    name = os.path.basename(path)
    compiled = (path.endswith(".py") or spec.target.kind == "script") and not zipfile.is_zipfile(io.BytesIO(data))
    problems = compile_findings(name, data, ranks) if compiled else []
    return problems + (spawn_findings(spec, name, text) if text is not None else [])
