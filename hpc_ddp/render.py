"""JobSpec -> sbatch script text, through a jinja2 template. Pure (the template is read from the package).

Safety: `#SBATCH` values were checked by the spec (no newline, NUL, `#`, quotes); paths never appear in a
directive (sbatch runs in the run dir, so log paths are relative); everything in the shell body is
shell-quoted with the `q` filter; free text in comments goes through the `comment` filter.

Secrets (`secrets`): the command line and the program's arguments appear only in comments, so they are
masked there (the ranks read their argv from spec.json, not from the script). A secret anywhere else (a
profile's setup line, an sbatch option, a custom template) makes rendering fail instead, naming the
variable: those lines run, and a masked one would break the job. Pure but for the default scrubber, which
reads the environment's secret values.
"""

from __future__ import annotations

import importlib.resources
import shlex
from pathlib import Path

import jinja2

from . import __version__, secrets
from .errors import SpecError
from .exitcodes import REQUEUE_EXIT_CODE
from .slurmtime import format_time
from .spec import JobSpec

__all__ = ["directives", "refuse_secrets", "render_sbatch", "runner_command", "SCRIPT_NAME", "SPEC_NAME"]

SCRIPT_NAME = "job.sbatch"
SPEC_NAME = "spec.json"
DEFAULT_TEMPLATE = "sbatch.sh.j2"


def directives(spec: JobSpec) -> list[str]:
    """The `#SBATCH` options, in a stable order."""
    out = [f"--job-name={_quoted(spec.job_name)}", f"--nodes={spec.nodes}",
           f"--ntasks-per-node={spec.tasks_per_node}"]
    if spec.gpus:
        out.append(f"--gpus-per-node={spec.gpus}" if spec.gpu_request == "gpus-per-node" else f"--gres=gpu:{spec.gpus}")
    if spec.cpus_per_task:
        out.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.mem:
        out.append(f"--mem={spec.mem}")
    if spec.time:
        out.append(f"--time={format_time(spec.time)}")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(spec, key)
        if value:
            out.append(f"--{key}={value}")
    out += ["--output=logs/slurm-%j.out", "--open-mode=append", "--requeue",
            f"--signal={spec.signal}@{spec.signal_lead}"]
    return out + list(spec.sbatch_args)


def runner_command(spec: JobSpec, run_dir: str) -> list[str]:
    """What each rank starts: the per-rank runner, which then execs the user's program."""
    return [spec.python, "-m", "hpc_ddp.runner", str(Path(run_dir) / SPEC_NAME)]


def render_sbatch(spec: JobSpec, run_dir: str, *, generated_at: str, command_line: str,
                  scrubber: secrets.Scrubber | None = None) -> str:
    scrub = scrubber or secrets.current()
    env = _environment(spec.template)
    name = Path(spec.template).name if spec.template else DEFAULT_TEMPLATE
    try:
        template = env.get_template(name)
        text = template.render(
            spec=spec, run_dir=run_dir, directives=directives(spec),
            runner=runner_command(spec, run_dir), requeue_exit_code=REQUEUE_EXIT_CODE,
            version=__version__, generated_at=generated_at, command_line=scrub(command_line),
            script_name=SCRIPT_NAME, program=scrub(spec.target.describe()),
            time_limit=format_time(spec.time) if spec.time else "none",
        )
    except jinja2.TemplateNotFound:
        raise SpecError(f"template {spec.template!r} not found") from None
    except jinja2.TemplateError as exc:
        raise SpecError(f"template {name!r} failed to render: {exc}",
                        hint="check the variable names against templates/sbatch.sh.j2") from None
    refuse_secrets(text.splitlines(), spec, scrub)
    return text


def refuse_secrets(lines: list[str], spec: JobSpec, scrub: secrets.Scrubber) -> None:
    """Raise a SpecError if a line of the job script would disclose a secret. Refused, not masked: these
    lines run, and `***` in place of a token would fail at run time, far from the cause. The message
    names the variable (or the kind of secret), never the value."""
    for number, line in enumerate(lines, 1):
        found = scrub.leaks(line)
        if found:
            where = _where(line, number, spec)
            raise SpecError(f"{where} would write {found[0].what} into the job script", hint=_hint(where, found[0]))


def _where(line: str, number: int, spec: JobSpec) -> str:
    if line in spec.setup or line.strip() in spec.setup:
        return f"a setup line of profile {spec.profile!r}" if spec.profile else "a setup line"
    if line.startswith("#SBATCH") or line in spec.sbatch_args:
        return "an sbatch option"
    return f"line {number} of the template"


def _hint(where: str, leak: secrets.Leak) -> str:
    name = leak.name or "NAME"
    if where == "an sbatch option":  # #SBATCH lines are not expanded by the shell: no $NAME there
        return f"sbatch options are not secret: export {name} before submitting and read it in the job instead"
    pasted = "its value" if leak.name else f"it (export {name}=... before submitting)"
    place = "the setup line" if where.startswith("a setup line") else "the template"
    return f"reference it as ${name} in {place} instead of pasting {pasted}"


def _environment(template: str | None) -> jinja2.Environment:
    if template:
        loader: jinja2.BaseLoader = jinja2.FileSystemLoader(str(Path(template).parent))
    else:
        loader = jinja2.FileSystemLoader(str(importlib.resources.files("hpc_ddp.templates")))
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, autoescape=False,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    env.filters["qjoin"] = lambda values: " ".join(shlex.quote(str(v)) for v in values)
    env.filters["comment"] = _comment
    return env


def _comment(value: object) -> str:
    """Text safe inside a `# ...` line: control characters are shown escaped, never as line breaks."""
    return "".join(c if 32 <= ord(c) != 127 else repr(c)[1:-1] for c in str(value))


def _quoted(value: str) -> str:
    return f'"{value}"' if " " in value else value
