"""What Slurm says about a job: squeue, then sacct where accounting exists, then `scontrol show job`, each
falling back cleanly to the next (`scheduler_state`); a whole array in one squeue and one sacct call
(`array_states`). Asked by the executors that hand jobs to Slurm, by sweeps and by `status`."""

from __future__ import annotations

import re
from typing import Any

from hpc_ddp.common.procs import CommandRunner

__all__ = ["scheduler_state", "array_states", "accounting", "parse_sacct", "SACCT_FIELDS", "ENDED"]

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
          "DEADLINE")


SACCT_FIELDS = ("JobID", "State", "ExitCode", "Elapsed", "Start", "End", "NodeList", "Reason")


def parse_sacct(text: str) -> dict[str, list[dict[str, str]]]:
    """`sacct -n -X -P -o SACCT_FIELDS` output -> job id -> its records, oldest first (with -D, one per
    run of a requeued job). "CANCELLED by 0" is CANCELLED; a line of another shape is skipped."""
    jobs: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        values = line.split("|")
        if len(values) != len(SACCT_FIELDS):
            continue
        record = dict(zip((f.lower() for f in SACCT_FIELDS), values))
        record["state"] = record["state"].split(" ")[0]
        if record["state"] and "." not in record["jobid"]:  # -X leaves out steps; this guards the rest
            jobs.setdefault(record.pop("jobid"), []).append(record)
    return jobs


def accounting(job_ids: list[str], commands: CommandRunner, *, history: bool = False) -> dict[str, list[dict[str, str]]]:
    """What Slurm's accounting (sacct) holds for `job_ids`; {} without sacct or accounting. `history`:
    every run of a requeued job (-D), not only the latest."""
    if not job_ids or not commands.which("sacct"):
        return {}
    done = commands.run(["sacct", "-n", "-X", "-P", *(["-D"] if history else []), "-j", ",".join(job_ids),
                         "-o", ",".join(SACCT_FIELDS)], timeout=20)
    return parse_sacct(done.stdout) if done.returncode == 0 else {}


def scheduler_state(job_id: str, commands: CommandRunner) -> dict[str, Any]:
    """{'state', 'reason', 'source'} from squeue, else sacct, else scontrol; {} if Slurm knows nothing.
    Where accounting exists, 'history' lists every run of the job (requeues included), from sacct."""
    runs = accounting([job_id], commands, history=True).get(job_id, [])
    queue = commands.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], timeout=20)
    if queue.returncode == 0 and queue.stdout.strip():
        return _queued_state(queue.stdout.strip().splitlines()[0], runs)
    if runs:
        return _accounted_state(runs)
    show = commands.run(["scontrol", "show", "job", job_id], timeout=20)
    if show.returncode == 0:
        state = re.search(r"JobState=(\S+)", show.stdout)
        reason = re.search(r"Reason=(\S+)", show.stdout)
        code = re.search(r"ExitCode=(\S+)", show.stdout)
        if state:
            return {"state": state.group(1), "reason": reason.group(1) if reason and reason.group(1) != "None" else None,
                    "exit_code": code.group(1) if code else None, "source": "scontrol"}
    return {}



def array_states(array_id: str, commands: CommandRunner) -> dict[str, dict[str, Any]]:
    """scheduler_state of every task of array `array_id` (keyed <array>_<task>), in one squeue and one
    sacct call: a sweep of hundreds of tasks is one question to the controller, not hundreds."""
    runs = accounting([array_id], commands, history=True)
    states = {job: _accounted_state(records) for job, records in runs.items()}
    queue = commands.run(["squeue", "-h", "-r", "-j", array_id, "-o", "%i|%T|%r"], timeout=20)
    for line in queue.stdout.splitlines() if queue.returncode == 0 else ():
        job, _, rest = line.strip().partition("|")
        if job:
            states[job] = _queued_state(rest, runs.get(job, []))
    return states


def _history(runs: list[dict[str, str]]) -> dict[str, Any]:
    return {"history": [{k: r[k] for k in ("state", "elapsed", "exitcode", "start", "end", "nodelist")}
                        for r in runs]} if runs else {}


def _queued_state(line: str, runs: list[dict[str, str]]) -> dict[str, Any]:
    """From squeue's "%T|%r"."""
    state, _, reason = line.partition("|")
    return {"state": state, "reason": None if reason in ("None", "") else reason, "source": "squeue", **_history(runs)}


def _accounted_state(runs: list[dict[str, str]]) -> dict[str, Any]:
    last = runs[-1]
    return {"state": last["state"], "exit_code": last["exitcode"], "elapsed": last["elapsed"],
            # A finished job's Reason is why it last waited (BeginTime after a requeue): not news.
            "reason": None if last["reason"] in ("None", "") or last["state"] in ENDED else last["reason"],
            "source": "sacct", **_history(runs)}
