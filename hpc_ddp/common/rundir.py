"""The run dir's layout: every file and folder hpc-ddp keeps for one run, named here and nowhere else
(as submitit's JobPaths owns its job folder). Every runtime reads and writes the run dir through this:
the CLI and executors on the login node, the batch script (its paths are rendered from here), the
requeue policy and the runner on compute nodes, the checkpointer in every training process.

    RUN_DIR/
      spec.json                 the frozen job spec every rank loads (the user's alone, 0600)
      job.sbatch                the batch script (sbatch executor)
      submissions.jsonl         one record per submission (job id, executor)
      events.jsonl              what happened: attempts, why each ended, requeues, resumes, stops
      metrics.jsonl             what training measured, step by step
      local.pid                 the local executor's identity while it runs
      srun.pid                  the srun executor's identity while it runs (inside an allocation)
      logs/slurm-<job>.out      the batch shell's output
      logs/job-<job>/attempt-<n>/rank-<r>.log   every rank's output, per job and attempt
      checkpoints/step-<N>[-r<k>]/ and checkpoints/latest
      code/<id>/                the snapshot of the project the ranks run (snapshot.snapshot), read-only
      code/<id>.json            its manifest; code/<id>-<commit>.diff: its uncommitted changes
      environments/<hash>.txt   the ranks' installed packages, one list per environment seen (job.provenance)
      submitit/<job>/           submitit's own files
      training.png, timeline.png

A sweep (`submit --sweep`) is a folder of run dirs, one per task, with the sweep's own files:

    SWEEP_DIR/
      sweep.json                the axes, every task's values and run dir, the array's job id
      job.sbatch                the array's batch script: picks task-<i>/job.sbatch and runs it
      code/<id>/                the one snapshot every task runs
      task-<i>/                 task i's whole run dir (its Slurm output: logs/slurm-<array>_<i>.out)

Pure: names and paths only; nothing here touches the filesystem except `rank_logs` (a glob), `is_sweep_dir` and
`job_ids` (reads submissions.jsonl).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

__all__ = ["RunDir", "CODE", "ENVIRONMENTS", "SPEC", "SCRIPT", "EVENTS", "METRICS", "SUBMISSIONS", "LOCAL_PID", "SRUN_PID", "CHECKPOINTS", "LATEST",
           "CHECKPOINT_PREFIX", "CHECKPOINT_NAME", "checkpoint_name", "attempt_logs", "RANK_LOG", "RANK_LOGS_GLOB", "SLURM_OUTPUT", "GUARD_LOG",
           "SWEEP", "TASK_DIR", "ARRAY_OUTPUT", "task_dir", "is_sweep_dir"]

SPEC = "spec.json"
SCRIPT = "job.sbatch"
SUBMISSIONS = "submissions.jsonl"
EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
LOCAL_PID = "local.pid"
SRUN_PID = "srun.pid"
LOGS = "logs"
SUBMITIT = "submitit"
CODE = "code"
ENVIRONMENTS = "environments"
CHECKPOINTS = "checkpoints"
LATEST = "latest"                      # inside CHECKPOINTS: the name of the newest complete checkpoint
CHECKPOINT_PREFIX = "step-"
# step-N, or step-N-rK when step N was saved again (nothing complete is ever replaced in place).
CHECKPOINT_NAME = re.compile(r"step-(\d+)(?:-r(\d+))?")
RANK_LOG = "rank-{rank}.log"           # {rank}: a number, or srun's %t
GUARD_LOG = "hostguard.log"            # beside the rank logs: what srun said of the batch host's guard step
SLURM_OUTPUT = f"{LOGS}/slurm-%j.out"  # relative: sbatch runs in the run dir
RANK_LOGS_GLOB = f"{LOGS}/job-*/attempt-*/{RANK_LOG.format(rank='*')}"  # every rank's log, for hints and globs
SWEEP = "sweep.json"
TASK_DIR = "task-{index}"
# sbatch runs the array script in the sweep dir; %a names the task's run dir, so each task's output is in it.
ARRAY_OUTPUT = f"{TASK_DIR.format(index='%a')}/{LOGS}/slurm-%A_%a.out"


def task_dir(sweep_dir: str | Path, index: int) -> Path:
    return Path(sweep_dir) / TASK_DIR.format(index=index)


def is_sweep_dir(path: str | Path) -> bool:
    return (Path(path) / SWEEP).is_file()


def checkpoint_name(step: int, revision: int = 0) -> str:
    return f"{CHECKPOINT_PREFIX}{step:09d}" + (f"-r{revision}" if revision else "")


def checkpoint_step(name: str) -> int | None:
    """The step a checkpoint directory's name says, or None for any other name."""
    m = CHECKPOINT_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def attempt_logs(job_id: str, attempt: int | str) -> str:
    """logs/job-<job>/attempt-<n>, relative to the run dir. The batch script passes shell words
    ("$SLURM_JOB_ID", "$ATTEMPT") to get the same path rendered."""
    return f"{LOGS}/job-{job_id}/attempt-{attempt}"


def _under(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"RUN_DIR/{name}")


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One run dir's paths."""

    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    def __fspath__(self) -> str:
        return str(self.path)

    spec = _under(SPEC)
    script = _under(SCRIPT)
    submissions = _under(SUBMISSIONS)
    events = _under(EVENTS)
    metrics = _under(METRICS)
    local_pid = _under(LOCAL_PID)
    srun_pid = _under(SRUN_PID)
    logs = _under(LOGS)
    checkpoints = _under(CHECKPOINTS)
    submitit = _under(SUBMITIT)
    code = _under(CODE)
    environments = _under(ENVIRONMENTS)

    def picture(self, what: str) -> Path:
        """training.png, timeline.png: the default place of a plot of this run."""
        return self.path / f"{what}.png"

    def attempt_logs(self, job_id: str, attempt: int) -> Path:
        return self.path / attempt_logs(job_id, attempt)

    def rank_log(self, job_id: str, attempt: int, rank: int) -> Path:
        return self.attempt_logs(job_id, attempt) / RANK_LOG.format(rank=rank)

    def rank_logs(self, rank: int | None = None) -> list[tuple[int, int, Path]]:
        """(attempt, rank, path) of every per-rank log, in attempt then rank order."""
        found = []
        # One rank's: the literal name is looked up in each attempt's folder, which is not listed (a folder
        # of thousands of ranks' logs, for every attempt, is what `status` must not read).
        pattern = RANK_LOGS_GLOB if rank is None else f"{LOGS}/job-*/attempt-*/{RANK_LOG.format(rank=int(rank))}"
        for path in self.path.glob(pattern):
            try:
                attempt = int(path.parent.name.removeprefix("attempt-"))
                r = int(path.stem.removeprefix("rank-"))
            except ValueError:  # a file of another shape that the glob also matched
                continue
            if rank is None or r == rank:
                found.append((attempt, r, path))
        return sorted(found, key=lambda t: (t[0], t[1], str(t[2])))

    def job_ids(self) -> list[str]:
        """The Slurm job ids recorded in submissions.jsonl, oldest first: every sbatch or submitit
        submission, the jobs of a chain and those the requeue fallback queued. Local runs are no Slurm jobs;
        a record that does not hold a plain job id (digits, or an array task's 123_4) is skipped."""
        from hpc_ddp.common.events import read_jsonl

        return [str(r["job_id"]) for r in read_jsonl(self.submissions)
                if isinstance(r, dict) and r.get("executor") in ("sbatch", "submitit")
                and re.fullmatch(r"\d+(?:_\d+)?", str(r.get("job_id")))]

    def slurm_outputs(self) -> list[Path]:
        return sorted(self.logs.glob(Path(SLURM_OUTPUT).name.replace("%j", "*")))
