"""The submitit executor: the same job (resources, setup lines, per-rank runner) through submitit's API.

submitit pickles `RankTask` and starts it once per task under srun; each task then runs the per-rank
runner's program as a child process, with its output in the same per-rank log files as the sbatch
executor uses.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..errors import SubmitError
from ..render import SPEC_NAME
from ..spec import JobSpec
from .base import Plan, Submission, record_submission, write_run_dir


def submitit_parameters(spec: JobSpec) -> dict:
    """SlurmExecutor.update_parameters() arguments for `spec`. Pure."""
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
    if spec.setup:
        params["setup"] = list(spec.setup)
    extra = {}
    for arg in spec.sbatch_args:
        name, _, value = arg[2:].partition("=")
        extra[name.replace("-", "_")] = value if value else True
    if extra:
        params["additional_parameters"] = extra
    return params


class RankTask:
    """What submitit runs in each task: the user's program with the per-rank environment."""

    def __init__(self, spec_path: str):
        self.spec_path = spec_path

    def __call__(self) -> int:
        from ..runner import prepare  # on the compute node

        argv, env = prepare(self.spec_path)
        log_dir = Path(env["HPC_DDP_RUN_DIR"]) / "logs" / f"job-{env.get('HPC_DDP_JOB_ID', 'unknown')}" / \
            f"attempt-{env.get('HPC_DDP_RESTART_COUNT', '0')}"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"rank-{env['RANK']}.log"
        print(f"hpc-ddp: rank {env['RANK']} output goes to {log_path}", flush=True)
        with open(log_path, "ab") as log:
            rc = subprocess.call(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd())
        if rc != 0:
            raise RuntimeError(f"rank {env['RANK']} exited with code {rc}; see {log_path}")
        return rc


class SubmititExecutor:
    name = "submitit"

    def __init__(self, **_ignored):
        pass

    def plan(self, spec: JobSpec, run_dir: str) -> Plan:
        params = submitit_parameters(spec)
        lines = [f"# submitit executor: SlurmExecutor(folder={run_dir + '/submitit/%j'!r}, python={spec.python!r})",
                 "update_parameters("]
        lines += [f"    {k}={v!r}," for k, v in params.items()]
        lines += [")", f"submit(RankTask({str(Path(run_dir) / SPEC_NAME)!r}))  # each rank runs: {spec.target.describe()}"]
        return Plan("submitit", spec, run_dir, None, summary="\n".join(lines) + "\n")

    def submit(self, plan: Plan) -> Submission:
        import submitit

        run_dir = write_run_dir(plan)
        executor = submitit.SlurmExecutor(folder=str(run_dir / "submitit" / "%j"), python=plan.spec.python)
        executor.update_parameters(**submitit_parameters(plan.spec))
        old_cwd = os.getcwd()
        try:
            os.chdir(plan.spec.workdir)  # the tasks start where the user submitted from
            job = executor.submit(RankTask(str(run_dir / SPEC_NAME)))
        except Exception as exc:  # submitit wraps sbatch failures in its own exception types
            raise SubmitError(f"submitit could not submit the job: {exc}".splitlines()[0]) from None
        finally:
            os.chdir(old_cwd)
        sub = Submission("submitit", str(job.job_id), str(run_dir), None)
        record_submission(sub)
        return sub
