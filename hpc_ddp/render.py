"""JobSpec -> sbatch script text, through a jinja2 template. Pure (the template is read from the package).

Safety: `#SBATCH` values were checked by the spec (no newline, NUL, `#`, quotes); paths never appear in a
directive (sbatch runs in the run dir, so log paths are relative); everything in the shell body is
shell-quoted with the `q` filter; free text in comments goes through the `comment` filter.
"""

from __future__ import annotations

import importlib.resources
import shlex
from pathlib import Path

import jinja2

from . import __version__
from .errors import SpecError
from .exitcodes import REQUEUE_EXIT_CODE
from .slurmtime import format_time
from .spec import JobSpec

__all__ = ["directives", "render_sbatch", "runner_command", "SCRIPT_NAME", "SPEC_NAME"]

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


def render_sbatch(spec: JobSpec, run_dir: str, *, generated_at: str, command_line: str) -> str:
    env = _environment(spec.template)
    name = Path(spec.template).name if spec.template else DEFAULT_TEMPLATE
    try:
        template = env.get_template(name)
        return template.render(
            spec=spec, run_dir=run_dir, directives=directives(spec),
            runner=runner_command(spec, run_dir), requeue_exit_code=REQUEUE_EXIT_CODE,
            version=__version__, generated_at=generated_at, command_line=command_line,
            script_name=SCRIPT_NAME, program=spec.target.describe(),
            time_limit=format_time(spec.time) if spec.time else "none",
        )
    except jinja2.TemplateNotFound:
        raise SpecError(f"template {spec.template!r} not found") from None
    except jinja2.TemplateError as exc:
        raise SpecError(f"template {name!r} failed to render: {exc}",
                        hint="check the variable names against templates/sbatch.sh.j2") from None


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
