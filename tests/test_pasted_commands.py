"""Every command hpc-ddp prints for pasting (in a HINT, a log line, between backticks) quotes what it
interpolates (issue 53: `check with: python -m py_compile NAME` ran `touch` for a script named `x;touch
hint;.py`). The messages are walked in the source: a backticked command with an interpolation must pass it
through bash_word (or shlex), unless it is one of the few values checked to be a plain word before (a host
check_host took, a job id job_id() took, a literal)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpc_ddp"
_TOOLS = r"(?:hpc-ddp|python|python3|ssh|scancel|sbatch|srun|rm|cd|ls|cat|realpath|pip|sed|git) "
# between backticks, or after "run: ", "with: ", "then: " (how a HINT offers a command)
COMMAND = re.compile(rf"`({_TOOLS}[^`\n]*)`|(?:run|with|then): ({_TOOLS}[^\"`\n]*)")
QUOTED = ("bash_word(", "shlex.quote(", "shlex.join(", "qjoin(")
# checked to be one word before they are printed: a host (check_host), a job id (job_id), a literal choice,
# the command's own name (app.missing_extra: letters and dashes only)
PLAIN = {"{host}", "{ssh.host}", "{kind}", "{name}", "{records[0]['job_id']}", "{top}", "{extra}", "{__version__}"}


def test_every_pasted_command_quotes_what_it_interpolates():
    unquoted = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for command in (a or b for a, b in COMMAND.findall(line)):
                for field in re.findall(r"\{[^{}]*(?:\([^)]*\)[^{}]*)?\}", command):
                    if not field.startswith(tuple("{" + q for q in QUOTED)) and field not in PLAIN:
                        unquoted.append(f"{path.relative_to(PACKAGE.parent)}:{number}: `{command}`: {field}")
    assert unquoted == [], "\n".join(unquoted)


def test_the_walk_finds_an_unquoted_one():
    line = 'hint=f"wait, or `hpc-ddp cancel {path}` first"'
    ((command, _),) = COMMAND.findall(line)
    assert re.findall(r"\{[^{}]*(?:\([^)]*\)[^{}]*)?\}", command) == ["{path}"]
    ((_, hint),) = COMMAND.findall('hint=f"fix it, then check with: python -m py_compile {name}")')
    assert hint.startswith("python -m py_compile {name}")
