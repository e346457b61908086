"""The srun executor: the ranks as a job step of the Slurm allocation this shell is in (after `salloc`, or
inside a batch job), run in the foreground, for fast iteration and debugging.

It owns:

- planning against the allocation (allocation.py: what its SLURM_* variables say, and the job fitted to
  it), where the plan is made: outside an allocation `--dry-run` is refused too;
- the exact srun command line (`srun_argv`), which the plan shows with the requeue policy's
  `attempts begin/end` around it, as the sbatch plan shows its script;
- running it like the local executor runs its ranks: the run dir, the submission record, `srun.pid`
  (so `hpc-ddp status/cancel/preempt` from another shell on this machine find it), attempts and the
  requeue policy, every rank's log in the same files as under sbatch (srun writes them; they are echoed
  here, prefixed by rank, secrets masked).

Signals: srun itself forwards USR1/USR2 to the tasks, but turns SIGTERM and SIGHUP into SIGKILL, and a
first Ctrl-C only prints the tasks' status. So srun runs in a session of its own (the terminal's Ctrl-C
reaches only us), and every signal for the ranks goes to the step through `scancel --signal NAME
JOB.STEP`, which signals the tasks without cancelling the step. Ctrl-C (or `hpc-ddp cancel`) sends
SIGTERM: the ranks checkpoint and stop, no attempt starts after it, the run ends CANCELLED; a second
Ctrl-C, or KILL_WAIT_S without an exit, sends srun SIGTERM, which kills the tasks at once. srun dies
with us (PDEATHSIG), and Slurm ends a step whose srun is gone.

The job id is the allocation's id, `-srun-`, this process's pid and start time (`1234-srun-5678-1763790000`):
known before srun starts, so the logs can be named after it; the step's own id (`1234.5`) is looked
up by its name (srun --job-name=<job id>) in `squeue --steps`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_ddp.common import rundir, secrets
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands, die_with_parent_preexec
from hpc_ddp.common.rundir import RANK_LOG, RunDir
from hpc_ddp.job import attempts
from hpc_ddp.job.containersrc import ensure_source
from hpc_ddp.job.distenv import port_for_job
from hpc_ddp.job.runner import site_environment
from hpc_ddp.launch import container
from hpc_ddp.launch.executors.allocation import (  # noqa: F401
    ALLOCATION_HINT,
    Allocation,
    allocation_from_env,
    fit_to_allocation,
    sizes_given_on_command_line,
)
from hpc_ddp.launch.executors.base import Plan, Submission, write_run_dir
from hpc_ddp.launch.executors.foreground import CANCELLED_EXIT_CODE, ForegroundControl
from hpc_ddp.launch.executors.foreground import say as _say
from hpc_ddp.launch.executors.local import bash_word, comment_text
from hpc_ddp.launch.render import env_exports, node_setup_command, runner_command, srun_options
from hpc_ddp.launch.shellwords import bash_line
from hpc_ddp.slurm.slurmtime import format_time
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["Allocation", "SrunExecutor", "allocation_from_env", "fit_to_allocation", "srun_argv",
           "output_pattern", "ALLOCATION_HINT"]

NAME = "srun"
KILL_WAIT_S = 30          # after a cancel, how long the ranks have to checkpoint before they are killed
KILL_GRACE_S = 10         # how long srun has to end the step after it was told to kill it
STEP_LOOKUP_S = 20        # how long signals wait for the step's id before going through srun itself
_POLL_S = 0.2
_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP)


# ---- the srun command line (pure) ----

def output_pattern(run_dir: str, job_id: str, attempt: int) -> str:
    """srun's --output for every rank's log: RUN_DIR/logs/job-<id>/attempt-<n>/rank-%t.log, with a `%`
    of the run dir's own written `%%`, so srun expands only the rank."""
    folder = str(RunDir(run_dir).attempt_logs(job_id, attempt)).replace("%", "%%")
    return f"{folder}/{RANK_LOG.format(rank='%t')}"


def gpu_options(spec: JobSpec, alloc: Allocation) -> list[str]:
    """The step's GPU request. A step gets all of the job's GPUs unless it asks; SLURM_GPUS_PER_NODE (which
    salloc --gpus-per-node exports) is read by srun as --gpus-per-node, so no GPUs is asked as 0 of them."""
    if spec.gpus:
        return [f"--gpus-per-node={spec.gpus}" if spec.gpu_request == "gpus-per-node" else f"--gres=gpu:{spec.gpus}"]
    if alloc.gpus_per_node_variable:
        return ["--gpus-per-node=0"]
    if alloc.gpus_per_node:
        return ["--gres=none"]
    return []


def srun_argv(spec: JobSpec, run_dir: str, job_id: str, attempt: int, alloc: Allocation) -> list[str]:
    """srun's argv for one attempt. Every size is explicit: salloc exports SLURM_NTASKS and the like, which
    srun would otherwise read as its own options (salloc -n4, then 2 nodes x 1 task, launches 4)."""
    argv = ["srun", f"--job-name={job_id}", f"--nodes={spec.nodes}", f"--ntasks={spec.world_size}",
            f"--ntasks-per-node={spec.tasks_per_node}"]
    if spec.cpus_per_task:  # since Slurm 22.05 srun does not inherit it from the allocation
        argv.append(f"--cpus-per-task={spec.cpus_per_task}")
    argv += gpu_options(spec, alloc)
    if spec.mem:
        argv.append(f"--mem={spec.mem}")
    if spec.time:
        argv.append(f"--time={format_time(spec.time)}")
    if alloc.step:  # run from a step's shell: without it, the new step waits for the CPUs that shell holds
        argv.append("--overlap")
    argv += ["--kill-on-bad-exit=1", f"--output={output_pattern(run_dir, job_id, attempt)}",
             *srun_options(spec, run_dir)]
    return argv + runner_command(spec, run_dir)


def step_environment(spec: JobSpec, job_id: str, attempt: int, deadline: float | None) -> dict[str, str]:
    """What the ranks get on top of this shell's environment (srun passes it on). The port is this run's
    and attempt's: two runs in one allocation (or an attempt right after another) must not meet on one."""
    env = {"MASTER_PORT": str(spec.master_port or port_for_job(f"{job_id}-{attempt}")),
           "HPC_DDP_RESTART_COUNT": str(attempt)}
    if deadline is not None:
        env["HPC_DDP_DEADLINE"] = f"{deadline:.3f}"
    return env


# What the allocation decides, so the srun executor leaves it alone.
_IGNORED = (("partition", "--partition"), ("account", "--account"), ("qos", "--qos"), ("constraint", "--constraint"),
            ("sbatch_args", "--sbatch-arg"), ("template", "template"), ("setup", "a profile's setup lines"))


def ignored_settings(spec: JobSpec) -> list[str]:
    return [flag for key, flag in _IGNORED if getattr(spec, key)]


PLAN_FIRST_LINE = "# hpc-ddp srun plan:"


def plan_text(spec: JobSpec, run_dir: str, job_id: str, alloc: Allocation, scrubber: secrets.Scrubber) -> str:
    """What --dry-run prints: the commands `submit` runs for attempt 0, as bash would read them (every value
    one word); comments say what was taken from the allocation and what it leaves out."""
    q = bash_word
    gpus = f"{alloc.gpus_per_node} GPU(s)" if alloc.gpus_per_node is not None else "GPUs not known"
    cpus = f"{alloc.cpus_per_node} CPU(s)" if alloc.cpus_per_node is not None else "CPUs not known"
    per_node = f", {spec.gpus} GPU(s) per node" if spec.gpus else ""
    head = [(f"{PLAN_FIRST_LINE} the ranks run as a step of allocation {alloc.job_id} ({alloc.nodes} node(s) "
             f"{comment_text(alloc.nodelist)}; {gpus} and {cpus} per node), in the foreground."),
            f"# {spec.nodes} node(s) x {spec.tasks_per_node} task(s) = {spec.world_size} rank(s){per_node}.",
            f"# Each rank runs: {comment_text(scrubber(spec.program()))}",
            ("# Left out: srun.pid, the echo of the rank logs here, signal forwarding (Ctrl-C: the ranks checkpoint "
             "and stop) and the requeues that `submit` adds around these commands.")]
    ignored = ignored_settings(spec)
    if ignored:
        head.append(f"# Ignored (the allocation's own): {', '.join(ignored)}.")
    # The policy keys its records by HPC_DDP_JOB_ID only where SLURM_JOB_ID (the allocation's) is not set.
    policy = f"env -u SLURM_JOB_ID HPC_DDP_JOB_ID={q(job_id)} {q(spec.python)} -m hpc_ddp.job.attempts"
    env = " ".join(f"{k}={q(v)}" for k, v in step_environment(spec, job_id, 0, None).items())
    body = ["# The commands of attempt 0 (submit writes the run dir and its spec.json first):",
            f"cd {q(spec.workdir)}", *(f"export {export}" for export in env_exports(spec)),
            f"{policy} begin {q(run_dir)} 0"]
    if spec.node_setup:
        body.append(f"HPC_DDP_RUN_DIR={q(run_dir)} {bash_line(node_setup_command(spec, overlap=bool(alloc.step)))} &&")
    body += [f"{env} {' '.join(q(a) for a in srun_argv(spec, run_dir, job_id, 0, alloc))}",
             f"{policy} end {q(run_dir)} 0 \"$?\""]
    return "\n".join(head + body) + "\n"


# ---- the executor ----

class SrunExecutor(ForegroundControl):
    name = NAME
    queues = False  # the allocation is already there: no preflight, no accounting of a queued job
    not_running_hint = ("a run started on another machine is not seen here: run it where the run was started, "
                        "or scancel the allocation")

    pid_name = rundir.SRUN_PID

    def __init__(self, commands: CommandRunner | None = None, *, environ: Mapping[str, str] | None = None,
                 given: frozenset[str] | None = None, echo: bool = True, job_id: str | None = None, **_ignored):
        self.commands = commands or SubprocessCommands()
        self.environ = dict(os.environ if environ is None else environ)
        self.given = given if given is not None else sizes_given_on_command_line()
        self.echo = echo
        alloc_id = (self.environ.get("SLURM_JOB_ID") or "").strip()
        self.job_id = job_id or f"{alloc_id or 'none'}-srun-{os.getpid()}-{int(time.time())}"
        self.ctrl_c = _Cancel()

    def allocation(self) -> Allocation:
        return allocation_from_env(self.environ)

    def plan(self, spec: JobSpec, run_dir: str) -> Plan:
        alloc = self.allocation()
        if "\\" in run_dir:  # srun expands no % at all in a name with a backslash: every rank would share one log
            raise UserError(f"run dir {run_dir!r} contains a backslash, which srun's --output cannot take",
                            hint="give a --run-dir without one")
        fitted = fit_to_allocation(spec, alloc, self.given)
        container.check_image(fitted, run_dir)
        return Plan(NAME, fitted, run_dir, None,
                    summary=plan_text(fitted, run_dir, self.job_id, alloc, secrets.current()))

    def check(self, plan: Plan):
        """Refusals before anything is written (the snapshot included): a stale SLURM_JOB_ID, no srun.
        Returns the allocation and its end."""
        alloc = self.allocation()
        ends = self._allocation_end(alloc)
        if not self.commands.which("srun"):
            raise UserError("srun is not on PATH", hint="load Slurm (`module load slurm`), or use --executor local")
        return alloc, ends

    def submit(self, plan: Plan, on_job_id=None) -> Submission:
        alloc, ends = self.check(plan)
        if on_job_id is not None:  # before it runs: it may run for hours
            on_job_id(self.job_id)
        run_dir = write_run_dir(plan)
        if plan.spec.container is not None:
            ensure_source(run_dir)
        for flag in ignored_settings(plan.spec):
            _say(f"{flag} is ignored inside an allocation (the allocation's own applies)")
        return self.run_here(run_dir, lambda: self._attempts(plan.spec, run_dir, alloc, ends))

    def _allocation_end(self, alloc: Allocation) -> float | None:
        """When the allocation ends (None: no limit, or squeue cannot say), refusing one that is not running
        (a shell can outlive its allocation, or inherit a stale SLURM_JOB_ID). Where squeue cannot answer
        at all, srun will say what is wrong."""
        from hpc_ddp.job.deadline import parse_slurm_timestamp

        if not self.commands.which("squeue"):
            return None
        done = self.commands.run(["squeue", "--noheader", f"--jobs={alloc.job_id}", "--format=%T|%e"], timeout=30)
        state, _, end = done.stdout.strip().partition("|")
        if (done.returncode == 0 and not state) or "Invalid job id" in done.stderr:
            raise UserError(f"allocation {alloc.job_id} (SLURM_JOB_ID) has ended", hint=ALLOCATION_HINT)
        if done.returncode == 0 and state not in ("RUNNING", "CONFIGURING"):
            raise UserError(f"allocation {alloc.job_id} is {state}, not running", hint=ALLOCATION_HINT)
        return parse_slurm_timestamp(end) if done.returncode == 0 else None

    def _attempts(self, spec: JobSpec, run_dir: Path, alloc: Allocation, alloc_end: float | None) -> int:
        policy_env = {"HPC_DDP_JOB_ID": self.job_id, "SLURM_JOB_NODELIST": alloc.nodelist}
        attempt = 0
        while True:
            if self.ctrl_c.requested:  # between two attempts: start no other
                return self._cancelled(run_dir, attempt, None)
            ok, reason = attempts.begin(run_dir, attempt, env=policy_env)
            if not ok:
                _say(f"not starting attempt {attempt}: {reason}")
                return attempts.NOT_ADMITTED_EXIT_CODE
            if self.ctrl_c.requested:
                return self._cancelled(run_dir, attempt, CANCELLED_EXIT_CODE, began=True)
            RunDir(run_dir).attempt_logs(self.job_id, attempt).mkdir(parents=True, exist_ok=True)
            deadline = time.time() + spec.time if spec.time else None
            ends = _earliest(deadline, alloc_end)
            received: list[str] = []
            rc = self._node_setup(spec, run_dir, alloc) or self._run_step(spec, run_dir, alloc, attempt, deadline,
                                                                          received)
            # A cancel whatever the exit code (a program may catch SIGTERM and exit 0), unless the run
            # recorded its finish: one that completed all the same completed.
            if self.ctrl_c.requested and (rc != 0 or not attempts.finished_in_last_attempt(Path(run_dir))):
                return self._cancelled(run_dir, attempt, rc, began=True)
            # A SIGTERM from outside is not the program's failure, as the batch shell's trap tells the policy.
            end_env = {**policy_env, "HPC_DDP_SHELL_SIGNAL": "TERM" if "TERM" in received else ""}
            if ends is not None:  # near the allocation's (or --time's) end, a checkpoint is a time limit
                end_env["HPC_DDP_DEADLINE"] = f"{ends:.3f}"
            requeue, reason = attempts.end(run_dir, attempt, rc, env=end_env)
            if not requeue:
                if rc == REQUEUE_EXIT_CODE:
                    _say(f"checkpointed, not restarting: {reason}")
                return rc
            if alloc_end is not None and alloc_end - time.time() < 60:
                _say(f"checkpointed; allocation {alloc.job_id} ends in {max(alloc_end - time.time(), 0):.0f} s, so no "
                     "attempt starts in it: submit again with the same --run-dir in a new allocation to resume")
                return rc
            attempt += 1
            _say(f"checkpointed at a stop request; restarting ({reason})")

    def _node_setup(self, spec: JobSpec, run_dir: Path, alloc: Allocation) -> int:
        """The per-node setup step before the ranks' (0 without one), its lines labelled by node. In a session
        of its own, as the ranks' srun: a Ctrl-C here ends it (and then the run) instead of asking srun."""
        if not spec.node_setup:
            return 0
        env = {**self.environ, **site_environment(spec, self.environ), "HPC_DDP_RUN_DIR": str(run_dir)}
        proc = subprocess.Popen(node_setup_command(spec, overlap=bool(alloc.step)), env=env, cwd=spec.workdir,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent_preexec())
        while proc.poll() is None:
            if self.ctrl_c.requested:
                proc.terminate()  # srun turns it into SIGKILL for the setup's tasks
            time.sleep(_POLL_S)
        rc = 128 - proc.returncode if proc.returncode < 0 else proc.returncode
        if rc:
            _say(f"the per-node setup failed (exit code {rc}); the ranks were not started")
        return rc

    def _run_step(self, spec: JobSpec, run_dir: Path, alloc: Allocation, attempt: int, deadline: float | None,
                  received: list[str]) -> int:
        argv = srun_argv(spec, str(run_dir), self.job_id, attempt, alloc)
        env = {**self.environ, **step_environment(spec, self.job_id, attempt, deadline)}
        if spec.container is not None:
            env.update(container.runtime_environment(env))
        # A session of its own: the terminal's Ctrl-C reaches only us (srun's own would only print status).
        proc = subprocess.Popen(argv, env=env, cwd=spec.workdir, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent_preexec())
        step = _Step(proc, alloc.job_id, self.job_id, self.commands)
        echo = _Echo(RunDir(run_dir).attempt_logs(self.job_id, attempt), secrets.current()) if self.echo else None
        warning = (deadline - spec.signal_lead, spec.signal) if deadline is not None else None
        previous = _forward_signals(step.pending, received)
        try:
            return self._wait(step, echo, warning)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if echo is not None:
                echo.flush(final=True)

    def _wait(self, step: _Step, echo: _Echo | None, warning: tuple[float, str] | None) -> int:
        """Until srun exits: act on cancels and forwarded signals, send --time's warning, echo the logs."""
        acted, cancelled_at, killed = 0, None, False
        while step.proc.poll() is None:
            step.find_id()
            if self.ctrl_c.count != acted:
                acted, cancelled_at = self.ctrl_c.count, cancelled_at or time.monotonic()
                if acted == 1:
                    _say("cancelling: asking every rank to checkpoint and stop (Ctrl-C again to stop them at once)")
                    step.pending.append("TERM")
                else:
                    _say("cancelling: killing every rank now")
                    step.kill()
            if cancelled_at is not None and not killed and time.monotonic() > cancelled_at + KILL_WAIT_S:
                killed = True
                _say(f"cancelling: ranks still running {KILL_WAIT_S} s after the cancel; killing them")
                step.kill()
            if warning is not None and time.time() >= warning[0]:
                _say(f"time limit: sending SIG{warning[1]} to every rank")
                step.pending.append(warning[1])
                warning = None
            step.deliver()
            step.escalate()
            if echo is not None:
                echo.flush()
            time.sleep(_POLL_S)
        code = step.proc.returncode
        return 128 - code if code < 0 else code  # srun killed by a signal: as a shell reports it


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None










# ---- the running step ----

class _Step:
    """The srun process and the step it made. Signals for the ranks queue in `pending` and go to the step
    with `scancel --signal` once its id is known; if it cannot be found (no squeue), after STEP_LOOKUP_S
    USR1/USR2 go to srun, which forwards them, and the rest end the step."""

    def __init__(self, proc: subprocess.Popen, alloc_id: str, name: str, commands: CommandRunner):
        self.proc, self.alloc_id, self.name, self.commands = proc, alloc_id, name, commands
        self.id: str | None = None
        self.pending: list[str] = []
        self.started = time.monotonic()
        self.killed_at: float | None = None
        self._next_lookup = 0.0

    def find_id(self) -> None:
        """Look the step up by its name: every 0.5 s at first, then every 5 s."""
        now = time.monotonic()
        if self.id is not None or now < self._next_lookup:
            return
        self._next_lookup = now + (0.5 if now - self.started < STEP_LOOKUP_S else 5)
        done = self.commands.run(["squeue", "--noheader", "--steps", f"--jobs={self.alloc_id}", "--format=%i|%j"],
                                 timeout=30)
        for line in done.stdout.splitlines() if done.returncode == 0 else ():
            step, _, name = line.strip().partition("|")
            if name == self.name:
                self.id = step

    def deliver(self) -> None:
        while self.pending:
            name = self.pending[0]
            if self.id is not None:
                done = self.commands.run(["scancel", f"--signal={name}", self.id], timeout=30)
                if done.returncode != 0 and self.proc.poll() is None:
                    _say(f"scancel --signal={name} {self.id} failed: {done.stderr.strip() or done.stdout.strip()}")
            elif time.monotonic() - self.started < STEP_LOOKUP_S:
                return  # the step is being created: its id comes first
            elif name in ("USR1", "USR2"):
                self._to_srun(getattr(signal, f"SIG{name}"))
            else:
                self.kill()
            self.pending.pop(0)

    def kill(self) -> None:
        """srun turns SIGTERM into SIGKILL for every task: the ranks stop at once."""
        self.killed_at = self.killed_at or time.monotonic()
        self._to_srun(signal.SIGTERM)

    def escalate(self) -> None:
        """An srun that has not ended KILL_GRACE_S after SIGTERM (a node that does not answer) is killed;
        Slurm then ends the step whose srun is gone."""
        if self.killed_at is not None and time.monotonic() > self.killed_at + KILL_GRACE_S:
            self._to_srun(signal.SIGKILL)

    def _to_srun(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)


def _forward_signals(pending: list[str], received: list[str]) -> dict:
    """Queue stop signals for every rank (the handler only notes them: the wait loop sends them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, _frame):
        name = signal.Signals(signum).name.removeprefix("SIG")
        received.append(name)
        pending.append(name)
    return {signum: signal.signal(signum, forward) for signum in _FORWARDED}


class _Cancel:
    """SIGINT (Ctrl-C, `hpc-ddp cancel`) counted by a handler that only counts; the wait loop acts on it."""

    def __init__(self):
        self.count = 0

    @property
    def requested(self) -> bool:
        return self.count > 0

    def __call__(self, _signum=None, _frame=None) -> None:
        self.count += 1

    def install(self):
        """The previous SIGINT handler, or None where handlers cannot be set (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGINT, self)


class _Echo:
    """This attempt's rank logs, as srun writes them, echoed here as `[rank N] line`, secrets masked.
    Whole lines only while the step runs, so a token split across two reads is masked whole."""

    def __init__(self, folder: Path, scrubber: secrets.Scrubber):
        self.folder, self.scrubber = folder, scrubber
        self.offsets: dict[Path, int] = {}

    def flush(self, final: bool = False) -> None:
        for path in sorted(self.folder.glob(RANK_LOG.format(rank="*")), key=_rank_of):
            lines = self._new_lines(path, final)
            for line in self.scrubber.lines(lines):
                sys.stdout.write(f"[rank {_rank_of(path)}] {line}\n")
        sys.stdout.flush()

    def _new_lines(self, path: Path, final: bool) -> Sequence[str]:
        start = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read()
        except OSError:
            return []
        if not final:
            data = data[:data.rfind(b"\n") + 1]
        self.offsets[path] = start + len(data)
        return data.decode(errors="replace").splitlines()


def _rank_of(path: Path) -> int:
    stem = path.stem.removeprefix("rank-")
    return int(stem) if stem.isdigit() else -1
