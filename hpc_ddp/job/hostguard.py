"""The batch host's guard, for jobs that restart inside their allocation (`--no-kill`).

With `--no-kill`, Slurm 22.05 keeps a job whose node fails and takes the node out of its allocation. When
that node is the batch host, the batch script dies with it, yet the job stays RUNNING on its other nodes
with nothing in it, until its time limit (measured on the test Slurm: `Killing JobId=4 StepId=batch due to
failed node hpcn1`, then `R ... 1 hpcn2` for as long as we watched, the node back in service included).
So the batch script starts, beside each srun step of the ranks, this guard as a one-task step on another
node of the step (`--overlap --gres=none`: it takes nothing from the ranks); it asks Slurm every few
seconds whether the batch host is lost (`attempts.down_nodes`: Slurm holds it DOWN or FAIL, or it has
not responded for SILENT_S in a row: one missed ping, `mixed*`, is not a lost node), and if so requeues the
job, as Slurm itself would have without `--no-kill`. The next attempt's `begin` records the lost node (node_failure,
within max_requeues). The batch script kills the guard when the ranks' step ends.

    python -m hpc_ddp.job.hostguard pick NODES BATCH_HOST   -> prints a node of NODES (a hostlist or
                                                                comma-separated) other than BATCH_HOST
    python -m hpc_ddp.job.hostguard watch RUN_DIR ATTEMPT BATCH_HOST
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.attempts import down_nodes

__all__ = ["pick", "watch", "INTERVAL_S"]

INTERVAL_S = 5.0
REQUEUE_TRIES = 24  # two minutes at INTERVAL_S
# A batch host that does not respond (sinfo's "*") this long, look after look, is lost though Slurm has not
# marked it DOWN yet (it does after SlurmdTimeout, 300 s by default): long past a missed ping or a busy node.
SILENT_S = 60.0


def _silent(node: str) -> list[str]:
    return down_nodes(node, silent=True)


def pick(nodes: str, batch_host: str) -> str | None:
    """The node the guard runs on: the last of `nodes` that is not the batch host (None: the step has no
    other node, and a lost batch host then ends a one-node job, which Slurm requeues itself)."""
    from hpc_ddp.slurm.nodelist import expand_hostlist

    try:
        hosts = [h for part in nodes.split(",") if part for h in expand_hostlist(part)] if "[" not in nodes \
            else list(expand_hostlist(nodes))
    except (ValueError, HpcDdpError):
        return None
    others = [h for h in hosts if h != batch_host]
    return others[-1] if others and batch_host else None


def _target(env: Mapping[str, str]) -> str:
    """The id `scontrol requeue` needs: an array task's own, else the job's."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID", "")


def watch(run_dir: Path, attempt: int, batch_host: str, env: Mapping[str, str] | None = None, *,
          lost: Callable[[str], list[str]] = down_nodes, silent: Callable[[str], list[str]] = _silent,
          run=subprocess.run, sleep=time.sleep, clock=time.monotonic, interval: float = INTERVAL_S,
          silent_s: float = SILENT_S, rounds: int | None = None) -> bool:
    """Wait until the batch host is lost (DOWN or FAIL, or not responding at every look for `silent_s`), then
    requeue the job (True). `rounds`: give up after that many looks (tests); otherwise the batch script ends
    the guard."""
    env = dict(os.environ if env is None else env)
    n = 0
    quiet_since: float | None = None
    while rounds is None or n < rounds:
        n += 1
        gone = bool(lost(batch_host))
        if not gone and silent(batch_host):
            quiet_since = clock() if quiet_since is None else quiet_since
            gone = clock() - quiet_since >= silent_s
        elif not gone:
            quiet_since = None  # it answered again: a missed ping, not a lost node
        if gone:
            target = _target(env)
            JsonLines(RunDir(run_dir).events).write(
                {"event": "batch_host_lost", "attempt": attempt, "node": batch_host, "job_id": env.get("SLURM_JOB_ID"),
                 "note": "the batch script died with its node; the guard requeues the job (--no-kill keeps the "
                         "rest of the allocation)"})
            _requeue(target, run, sleep, interval)
            return True
        sleep(interval)
    return False


def _requeue(target: str, run, sleep, interval: float, tries: int = REQUEUE_TRIES) -> bool:
    """`scontrol requeue`, again while Slurm refuses it (it may while it is still taking the lost node out
    of the job, or when slurmctld is busy): a refusal the guard ignored would leave the job RUNNING with
    nothing in it until its time limit. Each refusal goes to stderr, the guard's log."""
    for n in range(1, tries + 1):
        try:
            done = run(["scontrol", "requeue", target], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        else:
            if done.returncode == 0:
                return True
            why = (done.stderr or "").strip() or f"exit code {done.returncode}"
        print(f"hpc-ddp guard: scontrol requeue {target} failed (try {n} of {tries}): {why}", file=sys.stderr,
              flush=True)
        if n < tries:
            sleep(interval)
    return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["pick"] and len(args) == 3:
        node = pick(args[1], args[2])
        if node:
            print(node)
        return 0
    if args[:1] == ["watch"] and len(args) == 4:
        # The batch script ends the guard with SIGTERM when the ranks' step ends: a quiet exit 0, so srun
        # writes no "task 0: Killed" into the job's log.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            watch(Path(args[1]), int(args[2]), args[3])
        except KeyboardInterrupt:
            pass
        return 0
    print("usage: python -m hpc_ddp.job.hostguard pick NODES BATCH_HOST | watch RUN_DIR ATTEMPT BATCH_HOST",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
