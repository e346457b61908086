"""Where a run's files go, decided on the login node: the default run dir's name, and the checks that
turn a bad --run-dir (a file, a kernel filesystem, a name too long, no write access) into one line,
exit 2, before anything is written or rendered. What goes inside a run dir is `common.rundir`'s.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.procs import CommandRunner, read_pid_file
from hpc_ddp.common.rundir import RunDir, is_sweep_dir
from hpc_ddp.launch.shellwords import bash_word
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["new_run_dir", "usable_run_dir", "existing_run_dir", "on_kernel_fs", "check_kind", "check_not_live"]

def new_run_dir(spec: JobSpec, now: _dt.datetime) -> str:
    if spec.run_dir:
        return usable_run_dir(Path(spec.run_dir).expanduser())
    base = Path(spec.workdir) / "runs" / f"{spec.job_name}-{now:%Y%m%d-%H%M%S}"
    candidate, n = base, 1
    while candidate.exists():  # two submissions in one second (a sweep loop) must not share a run dir
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return usable_run_dir(candidate)


_VIRTUAL_FS = ("/proc", "/sys", "/dev")


def usable_run_dir(path: Path) -> str:
    """The absolute run dir, if it is (or can be made as) a directory of ours: checked before anything is
    written or rendered, so a dry run says what the submission would, and a bad path is one line, exit 2."""
    try:
        path = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        why = getattr(exc, "strerror", None) or exc
        raise UserError(f"run dir {str(path)!r} cannot be resolved: {why}") from None
    shown = str(path) if len(str(path)) <= 100 else str(path)[:97] + "..."
    if not str(path).isprintable():  # a newline splits every line that names it: Slurm's, the logs', ours
        raise UserError(f"run dir {shown!r} has a control character (a newline, tab, ...) in its name",
                        hint="give a --run-dir (or --job-name) of printable characters")
    if any(len(part.encode()) > 255 for part in path.parts) or len(str(path).encode()) >= 4096:
        raise UserError(f"run dir {shown!r} has a name longer than the filesystem allows (255 bytes a name)",
                        hint="use a shorter --job-name or --run-dir")
    if on_kernel_fs(path):
        raise UserError(f"run dir {shown!r} is on a kernel filesystem, not a place for files",
                        hint="give a --run-dir in your home, project or scratch space")
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing.is_file() else "exists and is not a directory"
        where = "" if existing == path else f", so the run dir {shown!r} cannot be made under it"
        raise UserError(f"{str(existing)!r} {what}{where}", hint="give --run-dir a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"run dir {shown!r} cannot be written: {str(existing)!r} is not writable by you",
                        hint="give a --run-dir where you can write")
    return str(path)


def on_kernel_fs(path: Path) -> bool:
    """Under /proc, /sys or /dev (but /dev/shm): writing there fails or does something else than a file."""
    def under(top: str) -> bool:
        return path == Path(top) or Path(top) in path.parents
    return any(under(top) for top in _VIRTUAL_FS) and not under("/dev/shm")


def check_kind(path: str, sweep: bool) -> None:
    """A run goes into a run dir (or a new dir), a sweep into a sweep dir (or a new dir), and neither inside
    another run's or sweep's dir: a sweep written over a run would replace its job script and hide it, and
    a run inside a task dir would take that task's place in `status`."""
    here = Path(path)
    _ours_or_new(here, sweep)
    if is_sweep_dir(here) and not sweep:
        raise UserError(f"{path} is a sweep's dir: a single run there would replace the sweep's array script",
                        hint="give another --run-dir, or resubmit the sweep with its --sweep values")
    if RunDir(here).spec.is_file() and sweep:
        raise UserError(f"{path} is a run dir: a sweep there would replace the run's job script",
                        hint="give the sweep a new --run-dir")
    for parent in here.parents:
        if RunDir(parent).spec.is_file() or is_sweep_dir(parent):
            kind = "sweep" if is_sweep_dir(parent) else "run"
            raise UserError(f"{path} is inside the {kind} dir {parent}", hint="give a --run-dir outside it")


def check_not_live(path: str, commands: CommandRunner | None) -> None:
    """A run dir whose job still runs (a local or srun job's process, named by its pid file) or is still
    queued or running in Slurm (any job its submissions record: a requeue keeps the id, a chain adds later
    ones) is not submitted into again: spec.json would change under the live job, and two jobs would write
    the same checkpoints. `commands`: how to ask squeue (None, or no squeue on PATH: not asked)."""
    paths = RunDir(path)
    if not paths.spec.is_file():
        return
    hint = f"wait for it to end, or `hpc-ddp cancel {bash_word(str(path))}` first; or give a new --run-dir"
    for pid_file in (paths.local_pid, paths.srun_pid):
        who, tag, _ = read_pid_file(pid_file)
        if who is not None:
            raise UserError(f"{path}: job {tag} is still running in this run dir (process {who.pid}); a second job "
                            "there would share its checkpoints", hint=hint)
    jobs = paths.job_ids()
    if jobs and commands is not None and commands.which("squeue"):
        from hpc_ddp.launch.executors.slurmctl import still_queued

        live = still_queued(list(dict.fromkeys(jobs)), commands)
        if live:
            raise UserError(f"{path}: Slurm job {', '.join(live[:4])} of this run dir is still queued or running; a "
                            "second job there would share its checkpoints", hint=hint)


def _ours_or_new(here: Path, sweep: bool) -> None:
    """hpc-ddp writes only into run dirs it made: a new or empty folder, a run dir (its spec.json one of
    ours: submitting there again resumes it) or a sweep's dir. A folder of the user's (`.`, `~`, `mine`) is
    refused before anything is written, so its files are never replaced."""
    try:
        entries = sorted(os.listdir(here)) if here.is_dir() else []
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"cannot read {str(here)!r}: {exc.strerror or exc}") from None
    if not entries or is_sweep_dir(here) or _holds_our_spec(here):
        return
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    raise UserError(f"{str(here)!r} exists and is not a {'sweep' if sweep else 'run'} dir hpc-ddp made (it holds "
                    f"{shown}): nothing is written there", hint="give --run-dir a new or empty folder; to resume a "
                                                                 "run, give the run dir it made")


def _holds_our_spec(here: Path) -> bool:
    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.spec.jobspec import load_spec

    spec = RunDir(here).spec
    if not spec.is_file() or spec.is_symlink():
        return False
    try:
        load_spec(spec)
    except HpcDdpError:
        return False
    return True


def existing_run_dir(run_dir: Path, ref: str) -> Path:
    """A run dir hpc-ddp made: a directory with its spec.json. Anything else is named, exit 2."""
    try:
        is_dir = run_dir.is_dir()
        has_spec = is_dir and RunDir(run_dir).spec.is_file()
    except OSError as exc:
        raise UserError(f"cannot read run dir {str(run_dir)!r}: {exc.strerror or exc}") from None
    if not is_dir:
        raise UserError(f"the run dir of {ref!r}, {str(run_dir)!r}, no longer exists",
                        hint="`hpc-ddp list` shows the recorded runs; scancel still takes a Slurm job id")
    if not has_spec:
        raise UserError(f"{str(run_dir)!r} is not a run dir (it has no spec.json)",
                        hint="give a run dir hpc-ddp made (runs/NAME-TIME), or a job id from `hpc-ddp list`")
    return run_dir
