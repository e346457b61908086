"""The submitit executor: the same job (resources, setup lines, per-rank runner) through submitit's API.

submitit pickles `RankTask` and starts it once per task under srun; each task then runs the per-rank
runner's program as a child process, with its output in the same per-rank log files as the sbatch
executor uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from hpc_ddp.common import secrets
from hpc_ddp.common.durable import appending
from hpc_ddp.common.errors import SubmitError
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.launch.executors.base import Plan, Submission, record_submission, write_run_dir
from hpc_ddp.launch.executors.slurmctl import SlurmControl
from hpc_ddp.launch.render import env_exports, node_setup_command, refuse_secrets
from hpc_ddp.launch.shellwords import bash_line, bash_word
from hpc_ddp.spec.jobspec import JobSpec


def submitit_parameters(spec: JobSpec, run_dir: str = "") -> dict:
    """SlurmExecutor.update_parameters() arguments for `spec`. Pure. submitit's script runs `setup` lines
    before its srun: the site's env exports, the profile's setup lines, then the per-node setup step (a
    failed one ends the job: its exit code)."""
    params: dict = {
        "job_name": spec.job_name, "nodes": spec.nodes, "ntasks_per_node": spec.tasks_per_node,
        # submitit always writes --time; 0 means "no limit" to Slurm (the partition's maximum applies).
        "time": -(-spec.time // 60) if spec.time else 0,
        "signal_delay_s": spec.signal_lead, "stderr_to_stdout": True,
    }
    if spec.gpus:
        params["gpus_per_node" if spec.gpu_request == "gpus-per-node" else "gres"] = (
            spec.gpus if spec.gpu_request == "gpus-per-node" else f"gpu:{spec.gpus}")
    for key in ("cpus_per_task", "mem", "partition", "qos", "account", "constraint"):
        if getattr(spec, key):
            params[key] = getattr(spec, key)
    setup = [*(f"export {export}" for export in env_exports(spec)), *spec.setup]
    if spec.node_setup:
        setup.append(f"HPC_DDP_RUN_DIR={bash_word(run_dir)} {bash_line(node_setup_command(spec))} || exit $?")
    if setup:
        params["setup"] = setup
    if spec.srun_args:
        params["srun_args"] = list(spec.srun_args)
    extra = {}
    for arg in spec.sbatch_args:
        name, _, value = arg[2:].partition("=")
        extra[name.replace("-", "_")] = value if value else True
    if extra:
        params["additional_parameters"] = extra
    return params


class RankTask:
    """What submitit runs in each task: the user's program (or the trainer) with the per-rank environment.

    It is submitit-checkpointable without double handling of signals: the program (a child process)
    receives Slurm's signals itself and checkpoints; submitit's handler, on global rank 0, only calls
    `checkpoint()`, which waits for the child to finish saving and then lets submitit requeue the same
    task. A child that stops on its own (exit 75, e.g. before its time limit) is requeued by rank 0 with
    scontrol, as the batch script would; the shared requeue policy (`attempts`) decides either way.
    A child killed by Slurm's SIGTERM (preemption) is not a failed program: rank 0 notes the SIGTERM it
    got too, and the policy asks Slurm what happened, as the batch script's does.
    """

    def __init__(self, spec_path: str):
        self.spec_path = spec_path
        self._child: subprocess.Popen | None = None
        self._handled_by_submitit = False
        self._attempt: tuple[Path, int] | None = None
        self._env: dict[str, str] = {}
        self._signalled = ""

    def __getstate__(self) -> dict:
        return {"spec_path": self.spec_path}  # a running child cannot (and must not) be pickled

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["spec_path"])

    def __call__(self) -> int:
        from hpc_ddp.job import attempts
        from hpc_ddp.job.runner import prepare  # on the compute node

        argv, env = prepare(self.spec_path)
        run_dir, rank = Path(env["HPC_DDP_RUN_DIR"]), int(env["RANK"])
        attempt = int(env.get("SLURM_RESTART_COUNT") or 0)
        if rank == 0:
            self._attempt, self._env = (run_dir, attempt), env
            admission = attempts.admit(run_dir, attempt, env)
        else:  # the others go by rank 0's decision: none may start a program that rank 0 will not join
            admission = attempts.admission_of(run_dir, attempt, env.get("SLURM_JOB_ID"))
        if admission is not None and not admission.ok:
            print(f"hpc-ddp: not running attempt {attempt}: {admission.reason}", flush=True)
            return 0 if admission.done else attempts.NOT_ADMITTED_EXIT_CODE
        log_path = RunDir(run_dir).rank_log(env.get("HPC_DDP_JOB_ID", "unknown"), attempt, rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"hpc-ddp: rank {rank} output goes to {log_path}", flush=True)
        self._note_sigterm()
        with appending(log_path) as fd, open(fd, "ab", closefd=False) as log:
            self._child = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
            rc = _shell_code(self._child.wait())
        if rank == 0 and not self._handled_by_submitit:
            outcome = attempts.finish(run_dir, attempt, rc, {**env, "HPC_DDP_SHELL_SIGNAL": self._signalled})
            print(f"hpc-ddp: attempt {attempt} ended: {outcome.reason}", flush=True)
            if outcome.requeue and not outcome.at_end:
                if not outcome.by_slurm:
                    subprocess.run(["scontrol", "requeue", env.get("SLURM_JOB_ID", "")], check=False)
                time.sleep(600)  # the requeue ends this task; returning now would mark the job done
            # at_end: Slurm requeues the job itself once its batch script ends (a GraceTime preemption, Slurm
            # 24.05 on): this task returns at once, so it ends well inside the GraceTime.
        if rc not in (0, REQUEUE_EXIT_CODE) and not self._signalled:
            raise RuntimeError(f"rank {rank} exited with code {rc}; see {log_path}")
        return rc

    def _note_sigterm(self) -> None:
        """Remember a SIGTERM (Slurm's preemption signal) and pass it on to whoever handled it before
        (submitit logs it and carries on)."""
        previous = signal.getsignal(signal.SIGTERM)

        def noted(signum, frame):
            self._signalled = "TERM"
            if callable(previous):
                previous(signum, frame)
        signal.signal(signal.SIGTERM, noted)

    def checkpoint(self, *args, **kwargs):
        """Called by submitit's signal handler (rank 0 only): wait for our child's checkpoint, then let
        submitit requeue this same task; the next attempt resumes from the checkpoint."""
        import submitit

        self._handled_by_submitit = True
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGUSR2)  # in case Slurm signalled only submitit's process
            # Not child.wait(): this runs in a signal handler that interrupted __call__'s own wait(),
            # which holds Popen's wait lock. Reap the child directly.
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
                if pid:
                    child.returncode = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(0.1)
        if self._attempt is not None:
            from hpc_ddp.job import attempts

            requeue, reason = attempts.end(*self._attempt, child.returncode if child and child.returncode is not None
                                           else 1, self._env)
            if not requeue:
                print(f"hpc-ddp: not requeueing: {reason}", flush=True)
                return None  # submitit: no requeue
        return submitit.helpers.DelayedSubmission(RankTask(self.spec_path))


def _shell_code(returncode: int) -> int:
    """Popen's -N for "killed by signal N" as a shell reports it (128 + N), the form the policy reads."""
    return 128 - returncode if returncode < 0 else returncode


class SubmititExecutor(SlurmControl):
    name = "submitit"

    def __init__(self, commands: CommandRunner | None = None, **_ignored):
        self.commands = commands or SubprocessCommands()

    def plan(self, spec: JobSpec, run_dir: str) -> Plan:
        scrub = secrets.current()
        # submitit writes setup lines and sbatch options into its own script: refuse secrets, as render does.
        params = submitit_parameters(spec, run_dir)
        refuse_secrets([*params.get("setup", ()), *spec.sbatch_args, *spec.srun_args], spec, scrub)
        lines = [f"# submitit executor: SlurmExecutor(folder={str(RunDir(run_dir).submitit / '%j')!r}, python={spec.python!r})",
                 "update_parameters("]
        lines += [f"    {k}={v!r}," for k, v in params.items()]
        lines += [")", f"submit(RankTask({str(RunDir(run_dir).spec)!r}))  # each rank runs: {spec.program()}"]
        return Plan("submitit", spec, run_dir, None, summary=scrub("\n".join(lines) + "\n"))

    def check(self, plan: Plan) -> None:
        """Nothing to refuse before anything is written: submitit's sbatch says what it refuses."""

    def submit(self, plan: Plan, on_job_id=None) -> Submission:
        import submitit

        run_dir = write_run_dir(plan)
        executor = submitit.SlurmExecutor(folder=str(RunDir(run_dir).submitit / "%j"), python=plan.spec.python,
                                          max_num_timeout=plan.spec.max_requeues)
        executor.update_parameters(**submitit_parameters(plan.spec, str(run_dir)))
        old_cwd = os.getcwd()
        try:
            os.chdir(plan.spec.workdir)  # the tasks start where the user submitted from
            job = executor.submit(RankTask(str(RunDir(run_dir).spec)))
        except Exception as exc:  # submitit wraps sbatch failures in its own exception types
            raise SubmitError(f"submitit could not submit the job: {exc}".splitlines()[0]) from None
        finally:
            os.chdir(old_cwd)
        sub = Submission("submitit", str(job.job_id), str(run_dir), None)
        record_submission(sub)
        if on_job_id is not None:
            on_job_id(sub.job_id)
        return sub
