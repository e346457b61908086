"""Before anything queues: can the Python the ranks will run (`spec.interpreter` chose it) run hpc-ddp's
per-rank runner? It must exist, be executable, and import hpc_ddp, as the batch script will run it: from
the job's working directory, in this shell's environment (sbatch exports it to the job).

A preflight check (`preflight.run_preflight` calls `python_findings`), so `doctor` shows it and `submit`
refuses a job whose ranks could not start: one line, exit 2, nothing queued. A job in a container runs
the image's Python, which this machine cannot see: only the rest is checked (`container_python_ok`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpc_ddp import __version__
from hpc_ddp.checks.finding import Finding
from hpc_ddp.common import verbosity
from hpc_ddp.spec.interpreter import NAMED, choose

__all__ = ["Probe", "probe", "python_findings", "installed_findings", "container_python_ok", "PROBE_TIMEOUT_S"]

# Long enough for a cold start on a network filesystem, short enough not to hold a submission up.
PROBE_TIMEOUT_S = 20.0
_PROBE_CODE = "import sys, hpc_ddp; sys.stdout.write(hpc_ddp.__version__)"
_MISSING = "No module named 'hpc_ddp'"


@dataclasses.dataclass(frozen=True)
class Probe:
    """What running `python -c 'import hpc_ddp'` said: the version it imported, or why it could not."""

    version: str | None = None
    problem: str | None = None    # one line: the last line of its stderr, or why it did not run
    missing: bool = False         # hpc_ddp is not installed there
    timed_out: bool = False


def probe(python: str, cwd: str, environ: Mapping[str, str], timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """Run `python` as the batch script will (from `cwd`, in `environ`) and ask it to import hpc_ddp."""
    argv = [python, "-c", _PROBE_CODE]
    verbosity.detail(f"checking the ranks' python: {shlex.join(argv)} (in {cwd})")
    try:
        done = subprocess.run(argv, cwd=cwd, env=dict(environ), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        return Probe(timed_out=True, problem=f"did not answer within {timeout:.0f} s")
    except OSError as exc:  # not executable, a script with a bad #!, cwd gone
        return Probe(problem=exc.strerror or str(exc))
    if done.returncode == 0:
        return Probe(version=done.stdout.strip()[:40] or "unknown")
    last = next((ln.strip() for ln in reversed(done.stderr.splitlines()) if ln.strip()), f"exit code {done.returncode}")
    return Probe(problem=last[:300], missing=_MISSING in done.stderr)


def container_python_ok(spec: Any) -> bool:
    """True for a job whose ranks run in a container: its Python is the image's, not checkable here."""
    return bool(getattr(spec, "container", None))


def python_findings(spec: Any, environ: Mapping[str, str] | None = None, executable: str | None = None,
                    run_probe: Callable[..., Probe] = probe) -> Sequence[Any]:
    """Preflight findings (`finding.Finding`) about `spec.python`: one, an error when the ranks could
    not start."""
    environ = os.environ if environ is None else environ
    who = _who(spec.python, environ, sys.executable if executable is None else executable)
    if container_python_ok(spec):
        return [Finding("ok", f"python {spec.python} runs inside the container: not checked on this machine")]
    if "/" not in spec.python and spec.setup:
        return [Finding("ok", f"python {spec.python} ({who}) is looked up on each node's PATH after the setup "
                              "lines: not checked on this machine")]
    problem = _unusable(spec.python, spec.workdir, environ)
    if problem:
        shown = spec.python if spec.python.isprintable() else repr(spec.python)
        return [Finding("error", f"python {shown} ({who}) {problem}",
                        hint="give --python with an existing interpreter, or activate the environment the job "
                             "should use")]
    return [_judge(run_probe(spec.python, spec.workdir, environ), spec.python, who)]


def installed_findings(spec: Any, environ: Mapping[str, str] | None = None,
                       executable: str | None = None) -> Sequence[Any]:
    """What `python_findings` says, for a dry run, which executes nothing (issue 30): the ranks' Python is not
    run but read: a venv or conda env whose site-packages hold no hpc_ddp (nor the job's folder, nor
    PYTHONPATH) cannot import it, said as the probe would; where that cannot be told from the files (a
    Python outside an env, one that sees the system's packages), nothing is said."""
    environ = os.environ if environ is None else environ
    if container_python_ok(spec) or ("/" not in spec.python and spec.setup):
        return []
    who = _who(spec.python, environ, sys.executable if executable is None else executable)
    problem = _unusable(spec.python, spec.workdir, environ)
    if problem:
        shown = spec.python if spec.python.isprintable() else repr(spec.python)
        return [Finding("error", f"python {shown} ({who}) {problem}",
                        hint="give --python with an existing interpreter, or activate the environment the job "
                             "should use")]
    path = os.path.join(spec.workdir, spec.python) if "/" in spec.python else \
        shutil.which(spec.python, path=environ.get("PATH", os.defpath))
    if path is None or _has_hpc_ddp(path, spec.workdir, environ) is not False:
        return []
    return [_judge(Probe(problem=_MISSING, missing=True), spec.python, who)]


def _has_hpc_ddp(python: str, workdir: str, environ: Mapping[str, str]) -> bool | None:
    """Whether `python` (its path as given, links not followed: a venv's python links to its base) can import
    hpc_ddp, as its env's files say; None where they cannot say."""
    if os.path.isfile(os.path.join(workdir, "hpc_ddp", "__init__.py")):
        return True  # `python -m hpc_ddp.job.runner` from the job's folder finds it there
    if environ.get("PYTHONPATH"):
        return None
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    try:
        with open(os.path.join(prefix, "pyvenv.cfg"), encoding="utf-8", errors="replace") as fh:
            config = fh.read(65536)
        if re.search(r"^\s*include-system-site-packages\s*=\s*true", config, re.M | re.I):
            return None
    except OSError:
        if not os.path.isdir(os.path.join(prefix, "conda-meta")):
            return None  # not an env: the system's Python, whose packages are anywhere
    folders = [d for lib in ("lib", "lib64") for d in glob.glob(os.path.join(prefix, lib, "python3*", "site-packages"))]
    if not folders:
        return None
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            return None
        if any(n == "hpc_ddp" or n.startswith(("hpc_ddp-", "__editable__.hpc_ddp", "hpc_ddp.", "hpc-ddp."))
               for n in names):
            return True
    return False


def _unusable(python: str, workdir: str, environ: Mapping[str, str]) -> str | None:
    """Why `python` cannot even be started (as the batch script would, from `workdir`), if it cannot."""
    if not python.isprintable():
        return "contains a control character"
    if "/" not in python:
        return None if shutil.which(python, path=environ.get("PATH", os.defpath)) else "is not on PATH"
    path = os.path.join(workdir, python)  # an absolute `python` stays itself
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return "is not an executable file"
    return None


def _judge(result: Probe, python: str, who: str) -> Any:
    fix = (f"install hpc-ddp into that environment ({shlex.quote(python)} -m pip install PATH, PATH a clone of "
           "hpc-ddp or the wheel its make dist builds), or give --python")
    if result.timed_out:
        return Finding("warning", f"python {python} ({who}) {result.problem} to `import hpc_ddp`: not checked",
                       hint="if the ranks cannot import hpc_ddp they fail at once; " + fix)
    if result.missing:
        return Finding("error", f"python {python} ({who}) cannot import hpc_ddp, which every rank runs", hint=fix)
    if result.problem:
        return Finding("error", f"python {python} ({who}) cannot run hpc-ddp: {result.problem}", hint=fix)
    if result.version != __version__:
        return Finding("warning", f"python {python} ({who}) has hpc-ddp {result.version}, this command is "
                                  f"{__version__}: the ranks run that one",
                       hint=f"{shlex.quote(python)} -m pip install 'hpc-ddp=={__version__}'")
    return Finding("ok", f"python {python} ({who}) imports hpc_ddp {result.version}")


def _who(python: str, environ: Mapping[str, str], executable: str) -> str:
    chosen = choose(environ, executable)
    return chosen.why if python == chosen.path else NAMED
