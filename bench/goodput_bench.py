"""Goodput under a trace of interruptions (issue 44, item 4), on the 4-node test Slurm (SLURM_CONF).

The same job (bench/goodput_job.py: STEPS small DDP steps of STEP_S seconds each, 1 rank per node) faces
the same seeded trace of interruptions, at about one a minute from its first step: a real partition
preemption (a job in `urgent` taking hpcn1-2 whole for a while), one node killed (its slurmd and the job's
processes on it, State=DOWN, back 15 s later), one rank crashed (SIGKILL of rank 1). Two sides:

- hpc-ddp: `hpc-ddp submit --partition wide --nodes 2-4`, the Session API, a checkpoint every CKPT_EVERY
  steps; a crash and a lost node restart in place, a preemption is requeued and resumes on the nodes free;
- plain: what users write by hand: `sbatch --requeue -N 4` + `srun` of a plain DDP loop that saves with
  torch.save every epoch (EPOCH_STEPS steps) and resumes from its last file. Slurm requeues it after a
  preemption or a lost node; a crashed rank ends it FAILED, and the bench submits it again at once (a
  user would, later).

Requeued jobs are released at once on both sides (Slurm holds them ~120 s), and queue waits count on neither
side: ETTR is useful node time over allocated node time:
- allocated: sacct's runs of every job (-D: a requeued or resized job's runs each), (End - Start) x NNodes;
- useful: the steps kept (of each step number, the record of the last life that trained it), each step's
  duration (capped at 2 x STEP_S: the first step of a life holds its start-up) x the nodes of its life.
Time to the next step: from each interruption to the first step of the next life.
The model beside it (Meta's RSC paper): ETTR ~ (1 - N r (u0 + dt/2)) / (1 + w/dt), with N r the trace's rate,
u0 the measured mean time to the next step, dt the checkpoint interval, w the save time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import Row, Target, Workspace, say

SECTION = "goodput"
HERE = Path(__file__).parent
SEED = 44
STEPS, STEP_S = 420, 0.5          # 210 s of training uninterrupted
CKPT_EVERY, EPOCH_STEPS = 10, 100  # hpc-ddp: every 5 s; plain: every epoch, 50 s
RATE_S = 60.0                     # mean seconds between interruptions
CREDENTIAL_SECOND_S = 1.5         # wait before releasing a requeued job (see `run_side`)


def trace(seed: int = SEED) -> list[dict]:
    """The interruptions, in seconds from the run's first step: one of each kind, in a seeded order, gaps
    drawn uniformly from 0.7 to 1.3 x RATE_S."""
    rng = random.Random(seed)
    kinds = ["preempt", "node", "crash"]
    rng.shuffle(kinds)
    at, out = 0.0, []
    for kind in kinds:
        at += rng.uniform(0.7, 1.3) * RATE_S
        out.append({"at_s": round(at, 1), "kind": kind})
    return out


def _job(job: str) -> dict[str, str]:
    info = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    out: dict[str, str] = {}
    for word in info.split():
        key, _, value = word.partition("=")
        out.setdefault(key, value)
    return out


def _field(job: str, name: str) -> str | None:
    return _job(job).get(name)


def _hosts(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True).stdout.split()


def _procs(job: str, node: str | None = None, rank: str | None = None) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}\0".encode() not in env:
            continue
        if node and f"SLURMD_NODENAME={node}\0".encode() not in env:
            continue
        if rank is not None and (f"SLURM_PROCID={rank}\0".encode() not in env
                                 or b"goodput_job.py" not in (entry / "cmdline").read_bytes()):
            continue
        found.append(int(entry.name))
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _depth(pid: int) -> int:
    depth = 0
    while pid > 1 and depth < 64:
        pid, depth = _parent(pid), depth + 1
    return depth


def kill_at_once(pids) -> None:
    """SIGKILL `pids` as a node that vanishes would lose them, with none reacting to another's death: all
    stopped first, then killed children before parents. Killed as they come, a process sees its kin die:
    srun's shepherd, when its srun died, cancels srun's step (the batch host guard's, on another node);
    and a stopped child whose parent dies is woken by the kernel (SIGHUP and SIGCONT to an orphaned
    process group), which again lets the shepherd run. A real lost node lets none of them run."""
    pids = sorted(set(pids), key=_depth, reverse=True)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def slurmd_pids(node: str, conf: str | None = None) -> list[int]:
    """The slurmd of `node` in the test Slurm of SLURM_CONF (or `conf`): started as `slurmd -N node` with that
    SLURM_CONF. Several test Slurms may run here at once with the same node names (tests/cluster/instance.sh);
    the other's slurmd of the same name is never one of these."""
    conf = conf or os.environ["SLURM_CONF"]
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or (entry / "comm").read_text().strip() != "slurmd":
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        named = any(argv[i:i + 2] == [b"-N", node.encode()] for i in range(len(argv)))
        if named and f"SLURM_CONF={conf}".encode() in environ:
            found.append(int(entry.name))
    return found


def kill_node(job: str, node: str) -> None:
    """As tests/e2e/test_restart_in_place.py does: the node's slurmd, the job's processes on it and their
    slurmstepds, then State=DOWN."""
    pids = slurmd_pids(node)
    for pid in _procs(job, node):
        pids.append(pid)
        parent = _parent(pid)
        try:
            if Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"slurmstepd"):
                pids.append(parent)
        except OSError:
            pass
    kill_at_once(pids)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=hpc-ddp bench: node killed"],
                   check=True, capture_output=True)


def bring_back(node: str, after_s: float = 15.0) -> threading.Thread:
    def back():
        time.sleep(after_s)
        root = Path(os.environ["SLURM_CONF"]).parent
        if not slurmd_pids(node):
            subprocess.run(["slurmd", "-N", node, "-L", str(root / "log" / f"slurmd-{node}.log")])
        for _ in range(60):
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
            state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
            if state.strip() == "idle" or "mix" in state or "alloc" in state:
                return
            time.sleep(1)
    thread = threading.Thread(target=back, daemon=True)
    thread.start()
    return thread


def _steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Side:
    def __init__(self, ws: Workspace, name: str):
        self.ws, self.name = ws, name
        self.dir = ws.fresh(f"goodput-{name}")
        self.dir.mkdir(parents=True)
        shutil.copy(HERE / "goodput_job.py", self.dir)
        self.jobs: list[str] = []

    def submit(self) -> str:
        if self.name == "hpc-ddp":
            done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--json", "--partition", "wide",
                                   "--nodes", "2-4", "--run-dir", "run", "goodput_job.py", "--", "hpc",
                                   str(self.dir), str(STEPS), str(STEP_S), str(CKPT_EVERY)],
                                  cwd=self.dir, capture_output=True, text=True, env=self.ws.env())
            if done.returncode != 0:
                raise RuntimeError(f"hpc-ddp submit failed: {done.stderr[-400:]}")
            job = json.loads(done.stdout[done.stdout.index("{"):])["job_id"]
        else:
            script = self.dir / "plain.sbatch"
            script.write_text(f"""#!/bin/bash
#SBATCH --partition=wide
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={self.dir}/slurm-%j.out
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
srun {sys.executable} {self.dir}/goodput_job.py plain {self.dir} {STEPS} {STEP_S} {EPOCH_STEPS}
""")
            done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                                  cwd=self.dir, env=self.ws.env())
            if done.returncode != 0:
                raise RuntimeError(f"sbatch failed: {done.stderr[-400:]}")
            job = done.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job


def _only_ours_on_urgent_nodes(job: str) -> bool:
    """The test Slurm is shared: a preemption waits while another job runs on hpcn1-2, which it would hit."""
    out = subprocess.run(["squeue", "-h", "-w", "hpcn1,hpcn2", "-t", "R,CG", "-o", "%i"], capture_output=True,
                         text=True).stdout.split()
    return all(j == job for j in out)


def _inject(kind: str, job: str) -> dict:
    if kind == "preempt":
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", "-o", "/dev/null",
                                 "--wrap", "sleep 20"], capture_output=True, text=True).stdout.strip()
        return {"urgent_job": urgent}
    if kind == "node":
        batch = _field(job, "BatchHost")
        others = [h for h in _hosts(_field(job, "NodeList") or "") if h != batch]
        node = others[-1]
        kill_node(job, node)
        bring_back(node)
        return {"node": node}
    pids = _procs(job, rank="1")
    kill_at_once(pids)
    return {"rank": 1, "pids": len(pids)}


def run_side(ws: Workspace, name: str, events: list[dict], timeout: float = 900) -> dict:
    side = Side(ws, name)
    job = side.submit()
    say(f"goodput: {name}: job {job}")
    first = None
    pending = list(events)
    done_at = []
    released: set[tuple[str, str]] = set()
    deadline = time.monotonic() + timeout
    allocated, polled, timeline, counted = 0.0, time.time(), [], []
    while time.monotonic() < deadline:
        steps = _steps(side.dir)
        if steps and first is None:
            first = steps[0]["t"]
        info = _job(job)
        state = info.get("JobState")
        now = time.time()
        if state in ("RUNNING", "COMPLETING"):  # the nodes it holds now (a node lost under --no-kill has left)
            held = int(info.get("NumNodes", "0").split("-")[0] or 0)
            allocated += (now - polled) * held
            counted.append((polled, now, held))
            if not timeline or timeline[-1][1:] != [state, held]:
                timeline.append([round(now, 1), state, held])
        polled = now
        training = steps and time.time() - steps[-1]["t"] < 2 and state == "RUNNING"
        if pending and first is not None and training and time.time() >= first + pending[0]["at_s"] \
                and (pending[0]["kind"] != "preempt" or _only_ours_on_urgent_nodes(job)):
            ev = pending.pop(0)
            at = time.time()
            what = _inject(ev["kind"], job)
            done_at.append({**ev, "time": at, "life": steps[-1]["life"], **what})
            say(f"goodput: {name}: {ev['kind']} at {at - first:.0f} s ({what})")
        restarts = info.get("Restarts") or "0"
        if state == "PENDING" and restarts != "0" and (job, restarts) not in released:
            # Each slurmd refuses a launch whose credential was made in the second it revoked the old run's
            # ("Job credential revoked"); once the job is PENDING that second is over: 1.5 s makes every new
            # credential newer (measured: 8 of 8 requeues start; 0 s failed one of 5; tests/e2e/helpers.py)
            time.sleep(CREDENTIAL_SECOND_S)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
            released.add((job, restarts))
        if state == "COMPLETED" and steps and steps[-1]["step"] >= STEPS:
            break
        if state in ("FAILED", "NODE_FAIL", "TIMEOUT", "CANCELLED", "COMPLETED", None):
            if name == "plain" and state != "COMPLETED":  # by hand: submitted again at once
                job = side.submit()
                say(f"goodput: {name}: job ended {state}; submitted again as {job}")
            else:
                raise RuntimeError(f"{name} job {job} ended {state} at step {steps[-1]['step'] if steps else 0}")
        time.sleep(0.5)
    else:
        for j in side.jobs:
            subprocess.run(["scancel", j], capture_output=True)
        raise RuntimeError(f"{name}: did not finish within {timeout:.0f} s")
    return measure(side, done_at, allocated, timeline, counted)


def where_it_went(counted: list[tuple[float, float, int]], step_times: list[float]) -> dict[str, float]:
    """The allocated node-seconds (`counted`: intervals polled RUNNING or COMPLETING, with the nodes held)
    by what the job did then: `start` before its first step; `training` while steps came (the last one at
    most 2 x STEP_S before); `between` otherwise: from an interruption to the next life's first step
    (stopping, Slurm's clean-up, the restart's start-up) and after the last step (the end)."""
    import bisect

    out = {"start": 0.0, "training": 0.0, "between": 0.0}
    times = sorted(step_times)
    for began, ended, nodes in counted:
        mid = (began + ended) / 2
        i = bisect.bisect_right(times, mid)
        kind = "start" if i == 0 else "training" if mid - times[i - 1] <= 2 * STEP_S else "between"
        out[kind] += (ended - began) * nodes
    return {k: round(v, 1) for k, v in out.items()}


def measure(side: Side, interruptions: list[dict], allocated: float, held: list,
            counted: list[tuple[float, float, int]] | None = None) -> dict:
    """`allocated`: node-seconds the harness saw the jobs RUNNING or COMPLETING (polled twice a second, the
    nodes `scontrol show job` counts at each poll). sacct is not used: after a node is taken out of a
    --no-kill job and the job is requeued, Slurm 22.05's accounting records the requeued run with the
    resized record's node count (measured: 1 node for a run on 3)."""
    runs = held
    steps = _steps(side.dir)
    last_life = {}
    for r in steps:
        last_life[r["step"]] = tuple(r["life"])
    useful, redone, previous = 0.0, 0.0, {}
    for r in steps:
        life = tuple(r["life"])
        dur = r["t"] - previous[life] if life in previous else STEP_S
        previous[life] = r["t"]
        if last_life[r["step"]] == life:
            useful += min(dur, 2 * STEP_S) * r["nodes"]
        else:
            redone += min(dur, 2 * STEP_S) * r["nodes"]
    to_next = []
    for ev in interruptions:
        later = [r["t"] for r in steps if r["t"] > ev["time"] and r["life"] != ev["life"]]
        to_next.append(round(min(later) - ev["time"], 1) if later else None)
    saves = []
    if side.name == "hpc-ddp":
        from hpc_ddp.common.events import read_jsonl

        saves = [e.get("seconds") for e in read_jsonl(side.dir / "run" / "events.jsonl")
                 if e.get("event") == "checkpoint" and isinstance(e.get("seconds"), (int, float))]
    return {"allocated_node_s": round(allocated, 1), "useful_node_s": round(useful, 1),
            "ettr": round(useful / allocated, 4) if allocated else None, "held": runs, "jobs": side.jobs,
            "time_to_next_step_s": to_next, "interruptions": interruptions,
            "save_s": round(statistics.median(saves), 4) if saves else 0.0,
            "first_to_last_step_s": round(steps[-1]["t"] - steps[0]["t"], 1) if steps else None,
            "steps_recorded": len(steps), "steps_redone": len(steps) - len(last_life),
            "redone_node_s": round(redone, 1),
            "where_allocated_went_node_s": where_it_went(counted or [], [r["t"] for r in steps])}


def model(u0: float, dt: float, w: float, rate_per_s: float) -> float:
    """Meta's RSC model: ETTR ~ (1 - N r (u0 + dt/2)) / (1 + w/dt), N r the job's interruptions per second."""
    return (1 - rate_per_s * (u0 + dt / 2)) / (1 + w / dt)


def run(ws: Workspace) -> list[Row]:
    conf = os.environ.get("SLURM_CONF")
    nodes = subprocess.run(["sinfo", "-h", "-p", "wide", "-o", "%D"], capture_output=True, text=True).stdout.strip() \
        if conf and shutil.which("sinfo") else ""
    if nodes != "4":
        why = "needs the 4-node test Slurm: SLURM_CONF unset" if not conf else f"partition wide has {nodes or 'no'} nodes"
        return [Row(SECTION, "goodput: ETTR under a trace of interruptions", "ratio", "hpc-ddp", None,
                    skipped=f"{why} (make slurm-up, then export SLURM_CONF=...)")]
    events = trace()
    inputs = {"seed": SEED, "trace": events, "steps": STEPS, "step_s": STEP_S, "ckpt_every_steps": CKPT_EVERY,
              "epoch_steps": EPOCH_STEPS, "rate_s": RATE_S, "nodes": "hpc-ddp --nodes 2-4 / plain -N 4",
              "release": f"requeued jobs released at once on both sides (StartTime=now {CREDENTIAL_SECOND_S} s after)"}
    sides = {}
    for name in ("hpc-ddp", "plain"):
        sides[name] = run_side(ws, name, events)
        say(f"goodput: {name}: ETTR {sides[name]['ettr']}, to next step {sides[name]['time_to_next_step_s']}")
    rate = 1 / RATE_S
    rows = []
    predicted = {}
    for name, dt in (("hpc-ddp", CKPT_EVERY * STEP_S), ("plain", EPOCH_STEPS * STEP_S)):
        waits = [x for x in sides[name]["time_to_next_step_s"] if x is not None]
        u0 = statistics.mean(waits) if waits else 0.0
        span = sides[name]["first_to_last_step_s"]
        seen = len(events) / span if span else rate  # the rate the run saw: its interruptions over its span
        predicted[name] = {"u0_s": round(u0, 1), "dt_s": dt, "w_s": sides[name]["save_s"], "rate_per_s": rate,
                           "ettr": round(model(u0, dt, sides[name]["save_s"], rate), 4),
                           "rate_seen_per_s": round(seen, 5),
                           "ettr_at_rate_seen": round(model(u0, dt, sides[name]["save_s"], seen), 4)}
    ours, base = sides["hpc-ddp"]["ettr"], sides["plain"]["ettr"]
    extra = {"inputs": inputs, "hpc-ddp": sides["hpc-ddp"], "plain": sides["plain"], "model": predicted}
    target = Target(">=", 0.90, on="value")
    rows.append(Row(SECTION, "goodput: ETTR under ~1 interruption/min (hpc-ddp)", "ratio", "hpc-ddp --nodes 2-4",
                    ours, target=target, met=target.met(ours) if ours is not None else None, repeats=1,
                    samples={"ours": [ours]}, extra={**extra, "model_ettr": predicted["hpc-ddp"]["ettr"]},
                    note=f"model predicts {predicted['hpc-ddp']['ettr']}"))
    ratio = ours / base if ours and base else None
    target = Target(">=", 1.3)
    rows.append(Row(SECTION, "goodput: ETTR, hpc-ddp vs sbatch --requeue + torch.save per epoch", "ratio",
                    "hpc-ddp --nodes 2-4", ours, baseline="plain DDP, sbatch --requeue -N 4", baseline_value=base,
                    ratio=ratio, target=target, met=target.met(ratio) if ratio is not None else None, repeats=1,
                    samples={"ours": [ours], "baseline": [base]},
                    extra={"model_ettr": predicted}, note="same trace, same seed"))
    for name in ("hpc-ddp", "plain"):
        waits = [x for x in sides[name]["time_to_next_step_s"] if x is not None]
        rows.append(Row(SECTION, f"goodput: interruption -> next training step ({name})", "s", name,
                        statistics.mean(waits) if waits else None, repeats=len(waits), aggregate="mean",
                        samples={"ours": sides[name]["time_to_next_step_s"]}, note="mean of the 3 interruptions",
                        extra={"kinds": [e["kind"] for e in sides[name]["interruptions"]]}))
    return rows
