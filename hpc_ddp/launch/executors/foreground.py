"""How a job that runs in the foreground of the submitting process (the local and srun executors) is
watched and managed from another shell: a pid file names that very process (start time, command line,
never a recycled pid); cancel is its Ctrl-C (SIGINT: the ranks checkpoint and stop); a signal is passed
to it, and it passes it on to every rank. Also how such a run records being cancelled, and how it ended:
COMPLETED, CANCELLED, CHECKPOINTED, TIMEOUT (its last attempt stopped at the time limit) or FAILED.
"""

from __future__ import annotations

import copy
import signal
import time
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.common import verbosity
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.procs import ProcessIdentity, read_pid_file, signal_process, write_pid_file
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.launch.executors.base import Run, Submission, record_submission
from hpc_ddp.launch.shellwords import bash_word

__all__ = ["ForegroundControl", "CANCELLED_EXIT_CODE", "say", "last_cause"]

CANCELLED_EXIT_CODE = 130  # as a shell reports a job stopped by Ctrl-C
CANCEL_WAIT_S = 60         # how long `hpc-ddp cancel` waits for the ranks' checkpoint before it returns


class ForegroundControl:
    """The state/cancel/signal half of an executor that runs its jobs in the submitting process."""

    name: str
    queues = False
    not_running_hint: str | None = None  # what to do when the pid file names no live process

    job_id: str
    ctrl_c: object  # counts SIGINTs while the ranks run: .install() -> previous handler, .requested

    pid_name: str  # the run dir's file that names the foreground process (rundir.LOCAL_PID, ...)

    def for_task(self, index: int) -> "ForegroundControl":
        """The executor for task `index` of a sweep: the same, with the task's own job id (a run's id names
        its logs and derives its port)."""
        task = copy.copy(self)
        task.job_id = f"{self.job_id}-t{index}"
        return task

    def pid_file(self, run: Run) -> Path:
        return run.run_dir / self.pid_name

    def run_here(self, run_dir: Path, attempts: Callable[[], int]) -> Submission:
        """Run `attempts()` (the job, to its end) in this process, named by the pid file meanwhile, and
        return what happened: COMPLETED, CANCELLED, CHECKPOINTED (stopped, resumable), TIMEOUT or FAILED."""
        pid_file = self.pid_file(Run(run_dir, self.job_id, self.name))
        previous = self.ctrl_c.install()  # before the pid file names us: `hpc-ddp cancel` may act at once
        try:
            write_pid_file(pid_file, self.job_id)
            record_submission(Submission(self.name, self.job_id, str(run_dir), None, state="RUNNING"))
            try:
                rc = attempts()
            finally:
                pid_file.unlink(missing_ok=True)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        state = "COMPLETED" if rc == 0 else "CANCELLED" if self.ctrl_c.requested else \
            "CHECKPOINTED" if rc == REQUEUE_EXIT_CODE else "TIMEOUT" if last_cause(run_dir) == "time_limit" else "FAILED"
        sub = Submission(self.name, self.job_id, str(run_dir), None, state=state, returncode=rc)
        record_submission(sub)
        return sub

    def state(self, run: Run) -> dict:
        """RUNNING while the process that wrote the pid file runs; {} otherwise."""
        who, _, _ = read_pid_file(self.pid_file(run))
        return {"state": "RUNNING", "source": self.name, "pid": who.pid} if who else {}

    def cancel(self, run: Run) -> str:
        """SIGINT to the foreground process. Asked again while that goes on, it only waits: a second
        SIGINT would kill ranks that are still saving (Ctrl-C twice does that)."""
        if _cancel_pending(run):
            who = self._running(run)
            say(f"job {run.job_id} is already being cancelled; waiting for it")
        else:  # recorded before the ranks hear of it, so a rank that stops can tell a cancel from a preemption
            self._running(run)
            JsonLines(run.paths.events).write({"event": "cancelled", "job_id": run.job_id, "by": "hpc-ddp cancel"})
            who = self._signal(run, signal.SIGINT)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while who.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if who.alive():  # what it is still doing is not known here: its setup, or ranks saving, or stuck
            return (f"Asked job {run.job_id} to stop ({run.run_dir}); it has not ended {CANCEL_WAIT_S} s later: "
                    f"`hpc-ddp status {bash_word(str(run.run_dir))}` says when it has")
        return f"Cancelled job {run.job_id} ({run.run_dir})"

    def signal(self, run: Run, name: str) -> None:
        self._signal(run, getattr(signal, f"SIG{name}"))

    def _running(self, run: Run) -> ProcessIdentity:
        who, _, why = read_pid_file(self.pid_file(run))
        if who is None:
            raise UserError(f"no {self.name} job is running for {run.run_dir} ({why})", hint=self.not_running_hint)
        return who

    def _signal(self, run: Run, signum: int) -> ProcessIdentity:
        who = self._running(run)
        if not signal_process(who, signum):
            raise UserError(f"no {self.name} job is running for {run.run_dir} (process {who.pid} has just ended)")
        return who

    def _cancelled(self, run_dir: Path, attempt: int, rc: int | None, began: bool = False) -> int:
        """Record the cancel as the end of the job (`status` says CANCELLED); the requeue policy is not
        asked: a cancelled job is never restarted, however it stopped."""
        events = JsonLines(RunDir(run_dir).events)
        if began:
            events.write({"event": "attempt_end", "attempt": attempt, "exit_code": rc, "cause": "cancelled"})
        events.write({"event": "gave_up", "attempt": attempt, "reason": "cancelled by the user", "cause": "cancelled"})
        saved = " after the ranks checkpointed: submit again with the same --run-dir to resume" \
            if rc == REQUEUE_EXIT_CODE else ""
        say(f"cancelled{saved}")
        return CANCELLED_EXIT_CODE


def last_cause(run_dir: Path) -> str | None:
    """How the run's newest attempt ended, as its events record it (time_limit, preempted, failed, ...)."""
    from hpc_ddp.job.attempts import attempts_from_events

    attempts = attempts_from_events(read_jsonl(RunDir(run_dir).events))
    return attempts[-1].cause if attempts else None


def _cancel_pending(run: Run) -> bool:
    """`hpc-ddp cancel` already signalled this run of the job (since its latest first attempt)."""
    from hpc_ddp.job.attempts import current_job

    return any(e.get("event") == "cancelled" and e.get("job_id") == run.job_id
               for e in current_job(read_jsonl(run.paths.events)))


def say(message: str) -> None:
    verbosity.say(message)  # -q: only "warning: ..." lines
