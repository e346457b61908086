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

import contextlib
import functools
import importlib.resources
import os
import re
import shlex
import signal
import stat
import threading
from pathlib import Path

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hpc_ddp import __version__
from hpc_ddp.common import rundir, secrets
from hpc_ddp.common.errors import SpecError
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.attempts import RUN_COMPLETE_EXIT_CODE
from hpc_ddp.launch import container
from hpc_ddp.launch.shellwords import bash_line
from hpc_ddp.slurm.slurmtime import format_time
from hpc_ddp.spec.jobspec import JobSpec
from hpc_ddp.spec.siteenv import bash_value

__all__ = ["check_custom_script", "directives", "refuse_secrets", "render_array", "render_sbatch", "runner_command"]

DEFAULT_TEMPLATE = "sbatch.sh.j2"
ARRAY_TEMPLATE = "sweep.sh.j2"


def directives(spec: JobSpec) -> list[str]:
    """The `#SBATCH` options, in a stable order."""
    out = [f"--job-name={_quoted(spec.job_name)}", f"--nodes={spec.nodes_text}"]
    if spec.nodes_max:
        # A node range asks for each node's CPUs as one task's: with --ntasks-per-node, Slurm fixes the job's
        # task count at MIN nodes' worth and gives it MIN nodes even where MAX are free (Slurm 22.05, measured).
        # The ranks' srun lays out the tasks itself (srun_options).
        out.append(f"--cpus-per-task={spec.tasks_per_node * (spec.cpus_per_task or 1)}")
    else:
        out.append(f"--ntasks-per-node={spec.tasks_per_node}")
    if spec.gpus:
        out.append(f"--gpus-per-node={spec.gpus}" if spec.gpu_request == "gpus-per-node" else f"--gres=gpu:{spec.gpus}")
    if spec.cpus_per_task and not spec.nodes_max:
        out.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.mem:
        out.append(f"--mem={spec.mem}")
    if spec.time:
        out.append(f"--time={format_time(spec.time)}")
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(spec, key)
        if value:
            out.append(f"--{key}={value}")
    out += [f"--output={rundir.SLURM_OUTPUT}", "--open-mode=append", "--requeue",
            f"--signal={spec.signal}@{spec.signal_lead}"]
    if spec.max_restarts and not spec.template:
        # A lost node must not end the allocation: the ranks restart on the nodes left (the shipped template's
        # loop; a site's own template has none, and its job ends on a lost node as Slurm ends it).
        out.append("--no-kill")
    if spec.after:
        out.append(f"--dependency={_dependency(spec.after)}")
    return out + container.directives(spec) + list(spec.sbatch_args)


def _dependency(after: str) -> str:
    """The spec lets only "after(ok|any):<digits>" through; checked again here, as a spec can also be
    built from a spec.json someone edited, and this lands in an #SBATCH line."""
    if not re.fullmatch(r"after(ok|any):\d+(_\d+)?", after):
        raise SpecError(f"after: {after[:60]!r} is not a dependency hpc-ddp writes",
                        hint="give --after JOB_ID|RUN_DIR[:ok|:any]")
    return after


def env_exports(spec: JobSpec) -> list[str]:
    """`NAME="value"` for each site variable: values double-quoted, only $NAME references expand (`siteenv`)."""
    return [f"{name}={bash_value(value)}" for name, value in spec.env]


NODE_SETUP_SHELL = "set -eo pipefail"  # not -u: module and activation scripts read unset variables


def node_setup_command(spec: JobSpec, *, overlap: bool = False) -> list[str]:
    """The per-node setup: its lines as one bash script, run by a step of one task on each node, before the
    ranks' step. `overlap`: started from a step's own shell (srun --pty bash), which holds the CPUs."""
    script = "\n".join([NODE_SETUP_SHELL, *spec.node_setup])
    # A node range's count is the allocation's: one task on each of its nodes, however many Slurm gave.
    count = [] if spec.nodes_max else [f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}"]
    return ["srun", *count, "--ntasks-per-node=1",
            *(["--overlap"] if overlap else []), "--kill-on-bad-exit=1", "--label", "bash", "-c", script]


def srun_options(spec: JobSpec, run_dir: str) -> list[str]:
    """Options of the ranks' srun beyond the ones every job has: the container's (pyxis), then --srun-arg."""
    ranges = [f"--ntasks-per-node={spec.tasks_per_node}"] if spec.nodes_max else []  # see directives()
    return [*ranges, *container.srun_options(spec, run_dir), *spec.srun_args]


def runner_command(spec: JobSpec, run_dir: str) -> list[str]:
    """What each rank starts: the per-rank runner, which then execs the user's program; in the container, if
    the job has one (from the run dir's copy of hpc_ddp, with the image's Python: `launch.container`)."""
    if spec.container is not None:
        return container.runner_words(spec, run_dir)
    return [spec.python, "-m", "hpc_ddp.job.runner", str(RunDir(run_dir).spec)]


def render_sbatch(spec: JobSpec, run_dir: str, *, generated_at: str, command_line: str,
                  scrubber: secrets.Scrubber | None = None) -> str:
    scrub = scrubber or secrets.current()
    container.check_image(spec, run_dir)
    env = _environment(spec.template)
    name = Path(spec.template).name if spec.template else DEFAULT_TEMPLATE
    try:
        template = env.get_template(name)
        with _time_limit(RENDER_LIMIT_S if spec.template else None):
            text = template.render(
                spec=spec, run_dir=run_dir, directives=directives(spec),
                runner=runner_command(spec, run_dir), srun_options=srun_options(spec, run_dir),
                env_exports=env_exports(spec),
                node_setup=node_setup_command(spec) if spec.node_setup else None,
                requeue_exit_code=REQUEUE_EXIT_CODE,
                version=__version__, generated_at=generated_at, command_line=scrub(command_line),
                script_name=rundir.SCRIPT, attempt_logs=rundir.attempt_logs("$SLURM_JOB_ID", "$ATTEMPT"),
                rank_log=rundir.RANK_LOG.format(rank="%t"), program=scrub(spec.program()), guard_log=rundir.GUARD_LOG,
                time_limit=format_time(spec.time) if spec.time else "none",
                run_complete_exit_code=RUN_COMPLETE_EXIT_CODE,
            )
    except jinja2.TemplateNotFound as exc:
        if exc.name != name:
            raise SpecError(f"template {name!r} includes {exc.name!r}: a custom template is one file",
                            hint="copy what it needs into the template itself") from None
        raise SpecError(f"template {spec.template!r} not found",
                        hint="give the path of your changed copy of hpc-ddp's templates/sbatch.sh.j2, or leave the "
                             "template key out to use hpc-ddp's own") from None
    except SecurityError as exc:
        raise SpecError(f"template {name!r} was stopped by the sandbox: {exc}",
                        hint="use only the variables it is given, as templates/sbatch.sh.j2 does") from None
    except jinja2.TemplateError as exc:
        raise SpecError(f"template {name!r} failed to render: {exc}",
                        hint="check the variable names against templates/sbatch.sh.j2") from None
    except RecursionError:
        raise SpecError(f"template {name!r} failed to render: it recurses without end") from None
    except _TooLong:
        raise SpecError(f"template {name!r} ran for more than {RENDER_LIMIT_S:g} s and was stopped: a job script "
                        "renders in milliseconds", hint="look for loops over large ranges in it") from None
    except OverflowError as exc:  # the sandbox's cap on range()
        raise SpecError(f"template {name!r} failed to render: {exc}") from None
    if spec.template:
        check_custom_script(text, spec, run_dir, name)
    refuse_secrets(text.splitlines(), spec, scrub)
    return text


def render_array(*, tasks, directives: list[str], max_running: int | None, generated_at: str, command_line: str,
                 scrubber: secrets.Scrubber | None = None) -> str:
    """A sweep's array script: the array's directives (task 0's: every task asks for the same allocation),
    then the task's own job script, picked by SLURM_ARRAY_TASK_ID. Only run dirs (quoted) and checked
    directives reach the shell; the tasks' values appear in comments."""
    from hpc_ddp.spec.sweep import describe

    scrub = scrubber or secrets.current()
    text = _environment(None).get_template(ARRAY_TEMPLATE).render(
        tasks=[{"index": t.index, "settings": describe(t.values), "run_dir": t.run_dir} for t in tasks],
        directives=directives, max_running=max_running, version=__version__, generated_at=generated_at,
        command_line=scrub(command_line), script_name=rundir.SCRIPT)
    refuse_secrets(text.splitlines(), tasks[0].plan.spec, scrub)
    return text


def check_custom_script(text: str, spec: JobSpec, run_dir: str, name: str = "template") -> None:
    """A site's template may change everything around the job, but not what makes it an hpc-ddp job.
    Raise a SpecError unless, in the rendered `text`:

    - the `#SBATCH` lines (leading spaces allowed, any case) are exactly `directives(spec)`, each once,
      all before the first command (sbatch reads no directive after it): no resource, array or uid
      request that the spec's checks never saw, and none of ours missing (`--requeue`, `--signal`);
    - outside comments, three lines run in this order (more where the spec asks: the container's copy of
      hpc_ddp first, the per-node setup, the srun options): one with `-m hpc_ddp.job.attempts begin` (the
      requeue policy's start of attempt), one with the runner command exactly as `{{ runner | qjoin }}`
      writes it (every rank starts hpc_ddp.job.runner on this run's spec.json), one with
      `-m hpc_ddp.job.attempts end` (the policy's decision after the step).

    The check reads text, it does not parse bash: it catches a template that forgot (or dropped) a part,
    and any directive a template or setup line adds; the sandbox is what keeps a template from running code.
    """
    lines = text.splitlines()
    first_command = next((i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")),
                         len(lines))
    expected = [f"#SBATCH {d}" for d in directives(spec)]
    found: list[str] = []
    for i, line in enumerate(lines):
        if not re.match(r"\s*#SBATCH", line, re.IGNORECASE):
            continue
        directive = line.strip()
        if directive not in expected:
            raise SpecError(f"template {name!r} writes {directive[:80]!r}, which hpc-ddp did not ask for",
                            hint="write the directives with {% for d in directives %}#SBATCH {{ d }}{% endfor %}; "
                                 "give extra sbatch options as sbatch_args")
        if i > first_command:
            raise SpecError(f"template {name!r} writes {directive[:80]!r} after the first command, "
                            "where sbatch no longer reads directives", hint="put every #SBATCH line first")
        found.append(directive)
    missing = [d for d in expected if d not in found]
    if missing or len(found) != len(set(found)):
        what = f"misses {missing[0]!r}" if missing else "repeats a directive"
        raise SpecError(f"template {name!r} {what}",
                        hint="write the directives with {% for d in directives %}#SBATCH {{ d }}{% endfor %}")
    # Lines as bash splits them (on \n only: "# x\rsrun ..." is one comment to bash).
    commands = [ln for ln in text.split("\n") if ln.strip() and not ln.lstrip().startswith("#")]
    required = []
    if spec.container is not None:  # the copy of hpc_ddp the ranks import in the container, first
        required.append(("-m hpc_ddp.job.containersrc", "`-m hpc_ddp.job.containersrc` (hpc_ddp for the container)", 1))
    required.append(("-m hpc_ddp.job.attempts begin", "the requeue policy's `-m hpc_ddp.job.attempts begin`", 1))
    if spec.node_setup:
        required.append((bash_line(node_setup_command(spec)), "the per-node setup `{{ node_setup | qline }}`", 1))
    if srun_options(spec, run_dir):  # on the runner's srun line, or a line before it (a `\` continuation)
        required.append((shlex.join(srun_options(spec, run_dir)), "the srun options `{{ srun_options | qjoin }}`", 0))
    required += [(shlex.join(runner_command(spec, run_dir)), "the per-rank runner `{{ runner | qjoin }}`", 1),
                 ("-m hpc_ddp.job.attempts end", "the requeue policy's `-m hpc_ddp.job.attempts end`", 1)]
    at, after = 0, ""
    for needle, what, step in required:
        at = next((i for i in range(at, len(commands)) if needle in commands[i]), -1)
        if at < 0:
            raise SpecError(f"template {name!r} does not run {what}{after}",
                            hint="start from templates/sbatch.sh.j2: attempts begin, srun of the runner, "
                                 "attempts end, in this order, outside comments")
        at, after = at + step, f" after {what}"


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
    name = re.match(r"export ([A-Za-z_][A-Za-z0-9_]*)=", line)
    if name and name.group(1) in dict(spec.env):
        return f"env {name.group(1)}"
    if line in spec.setup or line.strip() in spec.setup:
        return f"a setup line of profile {spec.profile!r}" if spec.profile else "a setup line"
    if spec.node_setup and bash_line(node_setup_command(spec)) in line:
        return "a node_setup line"
    if line.startswith("#SBATCH") or line in spec.sbatch_args:
        return "an sbatch option"
    if any(shlex.quote(arg) in line for arg in spec.srun_args):
        return "an srun option"
    return f"line {number} of the template"


def _hint(where: str, leak: secrets.Leak) -> str:
    name = leak.name or "NAME"
    if where in ("an sbatch option", "an srun option"):  # neither is expanded by a shell: no $NAME there
        return f"{where[3:]}s are not secret: export {name} before submitting and read it in the job instead"
    if where.startswith("env "):
        return (f"export {where[4:]} in your shell before submitting instead of writing its value in env: sbatch "
                "passes your environment to the job")
    pasted = "its value" if leak.name else f"it (export {name}=... before submitting)"
    place = {"a setup line": "the setup line", "a node_setup line": "the node_setup line"}.get(
        where.split(" of ")[0], "the template")
    return f"reference it as ${name} in {place} instead of pasting {pasted}"


MAX_TEMPLATE_BYTES = 1 << 20
RENDER_LIMIT_S = 10.0        # a custom template that runs longer (nested loops over big ranges) is stopped
MAX_PRODUCT_ITEMS = 1 << 20  # `"x" * N` or `[0] * N` in a template: at most this many characters or items


class _TooLong(Exception):
    """A custom template ran past RENDER_LIMIT_S."""


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise _TooLong in the render once `seconds` have passed (SIGALRM; the main thread only, where the
    CLI renders; elsewhere, or with None, no limit)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum, _frame):
        raise _TooLong()
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with `*` and `**` bounded: a template cannot make a string or list of
    gigabytes (`"x" * 10**10`) or a number of millions of digits."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_PRODUCT_ITEMS:
                    raise SecurityError(f"{operator!r} would make more than {MAX_PRODUCT_ITEMS:,} characters or items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError("an exponent over 64")
        return super().call_binop(context, operator, left, right)


def _environment(template: str | None) -> jinja2.Environment:
    """Every template renders in jinja2's immutable sandbox: a template (a job file or profile may name one)
    reaches only the variables it is given, never Python (`cycler.__init__.__globals__.os`)."""
    if template:
        return _sandbox(jinja2.FunctionLoader(_one_file(Path(template))))
    return _package_environment()


@functools.lru_cache(maxsize=1)
def _package_environment() -> jinja2.Environment:
    """The shipped templates', once per process: it caches their compiled form (a sweep renders hundreds)."""
    return _sandbox(jinja2.FileSystemLoader(str(importlib.resources.files("hpc_ddp.templates"))))


def _sandbox(loader: jinja2.BaseLoader) -> jinja2.Environment:
    env = _Sandbox(loader=loader, undefined=jinja2.StrictUndefined, autoescape=False,
                                        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda value: shlex.quote(str(value))
    env.filters["qjoin"] = lambda values: " ".join(shlex.quote(str(v)) for v in values)
    env.filters["comment"] = _comment
    env.filters["qline"] = bash_line
    return env


def _one_file(path: Path):
    """A loader for a custom template: that one regular file (no include/import/extends of other files),
    opened without blocking (a FIFO named x.j2 must not hang a dry run), read as UTF-8."""
    def load(name: str) -> str | None:
        if name != path.name:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SpecError(f"cannot read template {str(path)!r}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SpecError(f"template {str(path)!r} is not a regular file")
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_TEMPLATE_BYTES + 1)
        if len(data) > MAX_TEMPLATE_BYTES:
            raise SpecError(f"template {str(path)!r} is larger than {MAX_TEMPLATE_BYTES >> 20} MiB")
        try:
            return data.decode()
        except UnicodeDecodeError as exc:
            raise SpecError(f"template {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    return load


def _comment(value: object) -> str:
    """Text safe inside a `# ...` line: control characters are shown escaped, never as line breaks."""
    return "".join(c if 32 <= ord(c) != 127 else repr(c)[1:-1] for c in str(value))


def _quoted(value: str) -> str:
    return f'"{value}"' if " " in value else value
