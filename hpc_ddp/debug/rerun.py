"""`hpc-ddp rerun`: replay one attempt of a run on this machine, in a new run dir, from the checkpoint that
attempt started from, so a crash that took an hour to reach on the cluster is reproduced in minutes.

What is replayed, read from the original run dir (never written to):
- the spec (spec.json): the same program, arguments, trainer settings and datasets;
- the checkpoint the attempt started from: the `resume` record of that attempt names the one it loaded
  (a damaged newer one may have been skipped), else its `attempt_start` record's step. It is COPIED into
  the new run dir (every file checked against its manifest while it is copied) and made its `latest`, so
  the rerun resumes from it and nothing it saves or prunes can touch the original's checkpoints;
- the data: staged again from each dataset's source, as a new node would; where the source is gone, from
  the job's node-local copy if it is still on this machine (its marker must name the same source);
- the rank environment: the per-rank runner's, as on the cluster, with this machine's host values
  (MASTER_ADDR 127.0.0.1, a free MASTER_PORT, simulated nodes).

What may change, and is said before anything runs (`RerunPlan.notes`): the world size (kept where a
checkpoint pins it: it holds every rank's data order and random streams, and a resume with another world
size is refused; scaled down otherwise, where this machine has fewer cores, or on request), GPUs (none
here: gloo on the CPU), the time limit (none) and requeues (none: a rerun runs once).

The new run dir (default: beside the original, NAME-rerun-JOB-aN-TIME) records where it came from in
rerun.json. Refused before anything is made: a script or python that is not here, an env entry naming a rank
variable the rerun sets (the rerun's own win), a job id no executor makes. The cluster's setup and node_setup
lines are not run, and the plan says so. Planning is pure (`choose_attempt`, `plan_sizes`, `rerun_spec`); reading the original and
making the new run dir are the edges.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common import rundir
from hpc_ddp.common.durable import fsync_dir, read_regular, read_tail, replace_durable, write_durable
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import JsonLines, read_jsonl, well_formed
from hpc_ddp.common.rundir import LATEST, RunDir, checkpoint_name, checkpoint_step
from hpc_ddp.job.attempts import Attempt, attempts_from_events
from hpc_ddp.spec.jobspec import JobSpec, load_spec
from hpc_ddp.spec.siteenv import managed_problem

__all__ = ["AttemptRecord", "RerunPlan", "Sizes", "attempt_records", "choose_attempt", "plan_sizes", "rerun_spec",
           "plan_rerun", "make_rerun_dir", "check_program", "check_rank_env", "check_job_id", "JOB_ID", "attempt_failure", "exception_line", "copy_checkpoint", "RERUN_RECORD", "REPLAYABLE"]

RERUN_RECORD = "rerun.json"
MANIFEST = "manifest.json"             # the checkpointer's (trainer/checkpoint.py), read here without torch
REPLAYABLE = ("failed",)               # causes replayed without --any-outcome
_CHUNK = 8 << 20
LOG_TAIL = 200_000                     # bytes of a rank's log read for its failure: a log of GBs is never read whole
# The job ids hpc-ddp's executors record (the rerun's dir and the logs it reads are named by them): Slurm's
# (8123, an array task's 8123_4), the local executor's (local-PID-TIME) and the srun executor's
# (ALLOC-srun-PID-TIME, none-srun-... outside an allocation), each with a sweep task's -tN.
JOB_ID = re.compile(r"\d+(?:_\d+)?|(?:local|(?:\d+|none)-srun)-\d+-\d+(?:-t\d+)?")


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    """One attempt as the run dir recorded it."""

    job_id: str | None
    number: int
    cause: str                      # completed, failed, preempted, time_limit, cancelled, killed, not_admitted
    exit_code: int | None
    start_step: int | None          # the newest checkpoint when it began
    resumed_from: str | None        # the checkpoint it loaded (a name in checkpoints/), from its resume record
    nodes: str | None               # Slurm's node list of the job
    code: str | None = None         # the code snapshot it ran (snapshot.snapshot)

    @property
    def label(self) -> str:
        return f"attempt {self.number} of job {self.job_id}" if self.job_id else f"attempt {self.number}"

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint directory it started from, by name."""
        if self.resumed_from:
            return self.resumed_from
        return checkpoint_name(self.start_step) if self.start_step is not None else None


def attempt_records(events: Sequence[Mapping[str, Any]]) -> list[AttemptRecord]:
    """Every attempt in events.jsonl, in order, with the checkpoint each one loaded."""
    groups: list[list[Mapping[str, Any]]] = []
    for event in events:
        if event.get("event") == "attempt_start":
            groups.append([event])
        elif groups:
            groups[-1].append(event)
    return [_record(group, attempt) for group, attempt in zip(groups, attempts_from_events(list(events)))]


def _record(group: Sequence[Mapping[str, Any]], attempt: Attempt) -> AttemptRecord:
    start = group[0]
    resumes = [e for e in group if e.get("event") == "resume" and e.get("path")]
    loaded = Path(str(resumes[0]["path"])).name if resumes else None
    return AttemptRecord(job_id=str(start["job_id"]) if start.get("job_id") else None, number=attempt.number,
                         cause=attempt.ended_cause, exit_code=attempt.exit_code, start_step=attempt.start_step,
                         resumed_from=loaded if loaded and checkpoint_step(loaded) is not None else None,
                         nodes=start.get("nodes"), code=attempt.code)


def choose_attempt(records: Sequence[AttemptRecord], number: int | None, job: str | None,
                   any_outcome: bool) -> AttemptRecord:
    """The attempt `rerun` replays: the one asked for (--attempt, --job where attempt numbers repeat across
    the jobs of a chain), else the last that failed. One that did not fail needs --any-outcome."""
    if not records:
        raise UserError("this run recorded no attempt (it never started)", hint="`hpc-ddp status RUN` shows it")
    if number is None and job is None:
        failed = [r for r in records if r.cause in REPLAYABLE]
        if not failed and not any_outcome:
            seen = "; ".join(f"{r.label}: {r.cause}" for r in records)
            raise UserError(f"no attempt of this run failed ({seen})",
                            hint="pick one with --attempt N --any-outcome to replay it all the same")
        return (failed or records)[-1]
    found = [r for r in records if (number is None or r.number == number) and (job is None or r.job_id == job)]
    if not found:
        have = ", ".join(r.label for r in records)
        raise UserError(f"no {_asked(number, job)} in this run (it has: {have})",
                        hint="give --attempt N (and --job ID) as `hpc-ddp status RUN` lists them")
    if len({r.job_id for r in found}) > 1:
        jobs = ", ".join(str(r.job_id) for r in found)
        raise UserError(f"attempt {number} is in several jobs of this run ({jobs})",
                        hint=f"say which with --job ID, one of {jobs}")
    return _replayable(found[-1], any_outcome)


def _asked(number: int | None, job: str | None) -> str:
    return " of ".join(x for x in (f"attempt {number}" if number is not None else "attempt",
                                   f"job {job}" if job else "") if x)


def _replayable(record: AttemptRecord, any_outcome: bool) -> AttemptRecord:
    if record.cause == "not_admitted":
        raise UserError(f"{record.label} never ran (the requeue policy did not admit it): nothing to replay",
                        hint="rerun the attempt before it")
    if record.cause not in REPLAYABLE and not any_outcome:
        code = f", exit code {record.exit_code}" if record.exit_code is not None else ""
        raise UserError(f"{record.label} did not fail: it ended {record.cause}{code}",
                        hint="add --any-outcome to replay it all the same")
    return record


@dataclasses.dataclass(frozen=True)
class Sizes:
    nodes: int
    tasks_per_node: int
    gpus: int
    notes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def plan_sizes(spec: JobSpec, saved_world: int | None, checkpoint: str | None, *, nodes: int | None,
               tasks_per_node: int | None, cpus: int, gpus_here: int, ran_nodes: int | None = None) -> Sizes:
    """The rerun's nodes x tasks, and what that changes. `ran_nodes`: the nodes the attempt ran on (a node
    range's attempt may have run on any number of them), the job's by default. A checkpoint pins the world
    size, but for a node range's job, whose resume keeps its numbers on another size; without one the
    attempt's layout is kept where this machine's cores hold it, else it is scaled down to one node of them."""
    ran = ran_nodes or spec.nodes
    world = ran * spec.tasks_per_node
    if nodes is not None or tasks_per_node is not None:
        n, t = nodes or ran, tasks_per_node or spec.tasks_per_node
    elif saved_world is not None or world <= cpus:
        n, t = ran, spec.tasks_per_node
    else:
        n, t = 1, max(cpus, 1)
    if saved_world is not None and n * t != saved_world and not spec.nodes_max:
        keep = (f"--nodes {saved_world // t} --tasks-per-node {t}" if saved_world % t == 0 else
                f"--nodes 1 --tasks-per-node {saved_world}")
        raise UserError(f"{n} x {t} = {n * t} rank(s), but the attempt started from {checkpoint}, saved by "
                        f"{saved_world} ranks; a resume needs as many (each rank's data order and random streams "
                        "are in the checkpoint)", hint=f"keep {saved_world} ranks ({keep})")
    notes = _world_notes(spec, n, t, saved_world, checkpoint, cpus, ran)
    gpus, gpu_notes = _gpus(spec, n, t, gpus_here)
    return Sizes(n, t, gpus, (*notes, *gpu_notes))


def _world_notes(spec: JobSpec, n: int, t: int, saved: int | None, checkpoint: str | None, cpus: int,
                 ran: int | None = None) -> list[str]:
    world, new = (ran or spec.nodes) * spec.tasks_per_node, n * t
    if new == world:
        why = (f"{checkpoint} was saved by {saved} ranks, and a resume needs as many" if saved == new else
               f"{checkpoint} was saved by {saved} ranks, and the job's node range resumes on another size"
               if saved is not None else "it fits this machine")
        which = "the job" if (ran or spec.nodes) == spec.nodes else "the attempt"
        notes = [f"world size: {world} rank(s), as {which} ({n} simulated node(s) x {t}): {why}"]
        if new > cpus:
            notes.append(f"{new} ranks on {cpus} CPU core(s): slower than the cluster, the same numbers")
        return notes
    batch = spec.train.batch_size if spec.train else None
    per_rank = f"per-rank batch {batch} unchanged, global batch {batch * world} -> {batch * new}" if batch else \
        "your program's per-rank batch is what it computes (BATCH_SIZE unchanged); the global batch scales with it"
    return [f"world size: {world} -> {new} rank(s) ({n} node(s) x {t}): {per_rank}; each rank reads another share "
            "of the data, so a crash tied to particular samples or to the global batch may move or vanish"]


def _gpus(spec: JobSpec, n: int, t: int, gpus_here: int) -> tuple[int, list[str]]:
    if not spec.gpus:
        return 0, []
    if gpus_here >= n * t:
        return t, [f"GPUs: one per rank ({n * t} of the {gpus_here} here)"]
    return 0, [f"GPUs: none (the job had {spec.gpus} per node, this machine shows {gpus_here}): the ranks run on "
               "the CPU with gloo instead of nccl; a CUDA-only failure (out of memory, a device assert) will not "
               "reproduce"]


def rerun_spec(spec: JobSpec, sizes: Sizes, run_dir: str) -> JobSpec:
    """The original spec on the local executor: its sizes, no time limit, no requeue, a free port, and none
    of the cluster's setup: its setup and node_setup lines are not run here (`fixed_notes` says so)."""
    return dataclasses.replace(spec, executor="local", run_dir=run_dir, nodes=sizes.nodes, nodes_max=None,
                               tasks_per_node=sizes.tasks_per_node, gpus=sizes.gpus, time=None, master_port=None,
                               max_requeues=0, max_preemptions=0, chain=1, after=None, node_setup=())


def fixed_notes(spec: JobSpec, record: AttemptRecord) -> list[str]:
    """What always differs from the cluster, in one line each."""
    notes = [f"hosts: simulated on this machine, MASTER_ADDR 127.0.0.1 and a free MASTER_PORT (the job ran on "
             f"{record.nodes or 'its nodes'}{f', port {spec.master_port}' if spec.master_port else ''})"]
    if spec.time:
        notes.append(f"time limit: none (the job's was {spec.time} s); requeues: none, the rerun runs once")
    else:
        notes.append("requeues: none, the rerun runs once")
    notes.append("environment: the rank variables as on the cluster; the rest is this shell's (what the job's "
                 "shell exported is not recorded: export here what the crash needs)")
    if spec.setup:
        notes.append(f"setup lines not run here ({len(spec.setup)}: module loads and the like belong to the cluster)")
    if spec.node_setup:
        notes.append(f"node_setup not run here ({len(spec.node_setup)} line(s), the first: {spec.node_setup[0][:60]!r}): "
                     "per-node setup belongs to the cluster's nodes; do here what the crash needs first")
    return notes


@dataclasses.dataclass(frozen=True)
class RerunPlan:
    source: Path                    # the original run dir (read only)
    record: AttemptRecord
    checkpoint: Path | None         # in the original run dir
    run_dir: Path                   # the new one
    spec: JobSpec                   # the rerun's
    notes: tuple[str, ...]

    def describe(self) -> list[str]:
        start = f"from {self.checkpoint.name} (copied)" if self.checkpoint else "from the start (no checkpoint)"
        return [f"rerun of {self.record.label} ({self.record.cause}) of {self.source}",
                f"starts {start}; run dir {self.run_dir}", *(f"  {note}" for note in self.notes)]

    def to_json(self) -> dict[str, Any]:
        return {"source_run_dir": str(self.source), "job_id": self.record.job_id, "attempt": self.record.number,
                "cause": self.record.cause, "exit_code": self.record.exit_code,
                "checkpoint": str(self.checkpoint) if self.checkpoint else None,
                "checkpoint_step": checkpoint_step(self.checkpoint.name) if self.checkpoint else None,
                "run_dir": str(self.run_dir), "nodes": self.spec.nodes, "tasks_per_node": self.spec.tasks_per_node,
                "gpus": self.spec.gpus, "notes": list(self.notes)}


# ---- the edges: read the original, make the new run dir ----

def plan_rerun(source: Path, *, attempt: int | None, job: str | None, any_outcome: bool, nodes: int | None,
               tasks_per_node: int | None, run_dir: str | None, cpus: int, gpus_here: int,
               now: _dt.datetime) -> RerunPlan:
    spec = load_spec(RunDir(source).spec)
    check_rank_env(spec, RunDir(source).spec)
    events = [e for e in read_jsonl(RunDir(source).events) if well_formed(e)]  # as status reads them
    record = choose_attempt(attempt_records(events), attempt, job, any_outcome)
    check_job_id(record)
    checkpoint = _starting_checkpoint(source, record)
    saved = _saved_world(checkpoint) if checkpoint else None
    sizes = plan_sizes(spec, saved, checkpoint.name if checkpoint else None, nodes=nodes,
                       tasks_per_node=tasks_per_node, cpus=cpus, gpus_here=gpus_here,
                       ran_nodes=attempt_nodes(spec, record))
    target = _new_run_dir(source, record, run_dir, now)
    datasets, data_notes = _datasets(spec, source, record)
    code, code_notes = attempt_code(spec, record)
    new_spec = dataclasses.replace(rerun_spec(spec, sizes, str(target)), datasets=datasets, code=code)
    check_program(new_spec)
    return RerunPlan(source, record, checkpoint, target, new_spec,
                     (*sizes.notes, *data_notes, *code_notes, *fixed_notes(spec, record)))


def attempt_nodes(spec: JobSpec, record: AttemptRecord) -> int | None:
    """How many nodes the attempt ran on: its node list's (Slurm's, in its start record), or a local run's
    most nodes; None where neither says (the job's count is then taken)."""
    if record.nodes:
        from hpc_ddp.slurm.nodelist import expand_hostlist

        try:
            count = len(expand_hostlist(str(record.nodes)))
        except (ValueError, UserError):
            count = 0
        if 0 < count <= spec.most_nodes:
            return count
    return spec.most_nodes if spec.nodes_max and spec.executor == "local" else None


def check_rank_env(spec: JobSpec, path: Path) -> None:
    """The rerun sets the rank variables (RANK, MASTER_ADDR, ...) itself; the runner sets a spec's env after
    them, so an env entry that names one (a spec.json edited by hand: submit refuses them) is refused here,
    rather than let it decide what the ranks are. A sweep task's HPC_DDP_SWEEP_* values are hpc-ddp's own."""
    for name, _ in spec.env:
        problem = None if name.startswith("HPC_DDP_SWEEP_") else managed_problem(name)
        if problem:
            raise UserError(f"{path}: its env sets {name}, which the rerun sets itself ({problem}); hpc-ddp never "
                            "writes that", hint=f"remove {name} from the env in {path.name}")


def check_job_id(record: AttemptRecord) -> None:
    """The attempt's job id names the rerun's dir and the logs read: only an id an executor makes passes
    (a `../x` or `/tmp/x` in the records would put them outside the run dir's folder)."""
    if record.job_id is not None and not JOB_ID.fullmatch(record.job_id):
        raise UserError(f"{record.label[:80]!r}: the records give it a job id that no executor makes; the run dir's "
                        "events.jsonl was edited", hint="replay another attempt (--attempt N, --job ID)")


def check_program(spec: JobSpec) -> None:
    """What the rerun runs must be here before anything is made: the script (the snapshot's copy where
    there is one) and the python; else it would make a run dir, fail, and find no failure to compare."""
    script = spec.code.script if spec.code is not None and spec.code.script else None
    if spec.target.kind == "script":
        script = script or spec.target.value
    if script:
        path = Path(spec.workdir, script)
        if not path.is_file():
            raise UserError(f"the script {path} is not here (removed since the run, or on another machine): "
                            "nothing is replayed", hint="restore it, or rerun where the run's files are")
    python = spec.python if "/" in spec.python else shutil.which(spec.python)
    if not python or not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise UserError(f"the run's python {python or spec.python} is not an executable here: nothing is replayed",
                        hint="rerun where its environment is, or make that path a python here")


def attempt_code(spec: JobSpec, record: AttemptRecord):
    """The code snapshot the attempt ran, which the rerun runs too (the run dir may have been resubmitted
    with newer code since); (its Code, notes)."""
    from hpc_ddp.spec.code import Code

    code = spec.code
    if code is None:
        return None, ["code: not pinned (the run had no snapshot): the working tree as it is now"]
    if record.code and record.code != code.id:
        copy = Path(code.dir).parent / record.code
        if not copy.is_dir():
            return code, [f"code: the snapshot {record.label} ran ({record.code}) is gone: the run dir's latest, "
                          f"{code.id}, runs instead"]
        script = str(copy / Path(code.script).relative_to(code.dir)) if code.script else None
        code = Code(code.project, str(copy), record.code, script, code.origin)
    return code, [f"code: the snapshot {record.label} ran ({code.id}), not the working tree"]


def _starting_checkpoint(source: Path, record: AttemptRecord) -> Path | None:
    name = record.checkpoint
    if name is None:
        return None
    path = RunDir(source).checkpoints / name
    if not path.is_dir() or path.is_symlink():
        present = sorted(p.name for p in RunDir(source).checkpoints.glob("step-*") if p.is_dir())
        raise UserError(f"{record.label} started from {name}, which is no longer in {RunDir(source).checkpoints} "
                        f"(now: {', '.join(present) or 'none'})",
                        hint="older checkpoints are pruned (keep_checkpoints); rerun a later attempt")
    return path


def _saved_world(checkpoint: Path) -> int | None:
    manifest = _manifest(checkpoint)
    world = (manifest.get("fingerprint") or {}).get("world_size")
    return int(world) if isinstance(world, int) else None


def _manifest(checkpoint: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(read_regular(checkpoint / MANIFEST, limit=1 << 20))
    except (OSError, ValueError) as exc:
        raise UserError(f"the checkpoint {checkpoint} cannot be read: {exc}",
                        hint="rerun an attempt that started from another checkpoint") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise UserError(f"the checkpoint {checkpoint} has no usable {MANIFEST}")
    return manifest


def _new_run_dir(source: Path, record: AttemptRecord, given: str | None, now: _dt.datetime) -> Path:
    from hpc_ddp.launch.rundirs import usable_run_dir

    if given:
        target = Path(usable_run_dir(Path(given).expanduser()))
    else:
        job = f"-{record.job_id}" if record.job_id else ""
        target = source.parent / f"{source.name}-rerun{job}-a{record.number}-{now:%Y%m%d-%H%M%S}"
    src = source.resolve()
    if target == src or src in target.parents or target in src.parents:
        raise UserError(f"the rerun's run dir {target} is, holds or lies inside the original run dir {src}",
                        hint="give --run-dir a place outside it (the original is never written to)")
    if os.path.lexists(target):
        raise UserError(f"the rerun's run dir {target} already exists", hint="give --run-dir a new path")
    return target


def _datasets(spec: JobSpec, source: Path, record: AttemptRecord) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """Each dataset's source, else the job's node-local copy still on this machine."""
    out, notes = [], []
    for name, src in spec.datasets:
        if os.path.exists(src):
            out.append((name, src))
            notes.append(f"data {name}: staged again from {src}, as on a new node")
            continue
        copy = _node_copy(source, record, name, src)
        if copy is None:
            raise UserError(f"dataset {name}: its source {src} is gone, and the job's node-local copy is not on this "
                            "machine", hint=f"restore {src} to replay {record.label}")
        out.append((name, copy))
        notes.append(f"data {name}: its source {src} is gone; staged from the job's node-local copy {copy}")
    return tuple(out), notes


def _node_copy(source: Path, record: AttemptRecord, name: str, src: str) -> str | None:
    """The copy the attempt's rank logs say it staged, if it is here and its marker names `src`."""
    from hpc_ddp.data.staging import MARKER_SUFFIX

    for log in _rank_logs(source, record.job_id or "*", record.number):
        for line in read_tail(log, LOG_TAIL, head=True).decode(errors="replace").splitlines():  # said early on
            target = _staged_to(line, name)
            if target and _marker_source(Path(target).with_name(f"{name}{MARKER_SUFFIX}")) == src:
                return target
    return None


def _rank_logs(run_dir: Path, job_id: str, attempt: int) -> list[Path]:
    """The attempt's rank logs (job_id may be "*"), regular files only."""
    pattern = f"{rundir.attempt_logs(job_id, attempt)}/{rundir.RANK_LOG.format(rank='*')}"
    return sorted(p for p in Path(run_dir).glob(pattern) if p.is_file() and not p.is_symlink())


def _staged_to(line: str, name: str) -> str | None:
    for head in (f"hpc-ddp stage: {name}: reusing the verified copy in ", f"hpc-ddp stage: {name}: "):
        if line.startswith(head):
            path = line[len(head):] if "reusing" in head else line.rpartition(" -> ")[2]
            return path if os.path.isabs(path) else None
    return None


def _marker_source(marker: Path) -> str | None:
    try:
        return json.loads(read_regular(marker, limit=1 << 16)).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def make_rerun_dir(plan: RerunPlan) -> None:
    """The new run dir (created here: it did not exist), the starting checkpoint copied into it and named
    `latest`, and rerun.json saying where everything came from. The original is only read."""
    plan.run_dir.mkdir(parents=True, mode=0o700)  # raises if it exists: everything below it is ours
    paths = RunDir(plan.run_dir)
    try:
        if plan.checkpoint is not None:
            paths.checkpoints.mkdir(mode=0o700)
            copy_checkpoint(plan.checkpoint, paths.checkpoints)
        write_durable(plan.run_dir / RERUN_RECORD, (json.dumps(plan.to_json(), indent=2) + "\n").encode())
        JsonLines(paths.events).write({"event": "rerun_of", **plan.to_json()})
    except BaseException:
        shutil.rmtree(plan.run_dir, ignore_errors=True)  # made just now by us: a half-made rerun leaves nothing
        raise


def attempt_failure(run_dir: Path, job_id: str, attempt: int) -> str | None:
    """The exception an attempt's lowest rank with a traceback ended with, or else the failure
    `watch.classify` finds in its logs ('kind: line'), or None."""
    from hpc_ddp.watch.classify import classify_failure

    texts = [read_tail(p, LOG_TAIL).decode(errors="replace") for p in _rank_logs(run_dir, job_id, attempt)]
    line = next((found for found in map(exception_line, texts) if found), None)
    if line:
        return line
    found = classify_failure(texts)
    return f"{found[0]}: {found[1]}" if found else None


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch's elastic error handler prefixes a rank's traceback


def exception_line(text: str) -> str | None:
    """The exception line of the last Python traceback in `text` (the first line after its header that is
    not indented, once torch's `[rankN]: ` prefix is off)."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    return next((line.strip() for line in lines[starts[-1] + 1:] if line and not line[0].isspace()), None)


def copy_checkpoint(src: Path, dest_root: Path) -> Path:
    """Copy checkpoint `src` into `dest_root` under its own name and point `latest` at it. Only the files its
    manifest lists, each a regular file opened without following links and checked against the manifest's
    size and sha256 while it is copied; a temporary name until all of it is durable."""
    manifest = _manifest(src)
    tmp, final = dest_root / f".tmp-rerun-{src.name}", dest_root / src.name
    tmp.mkdir(mode=0o700)
    for fname, want in manifest["files"].items():
        if not isinstance(fname, str) or "/" in fname or fname in ("", ".", "..", MANIFEST):
            raise UserError(f"the checkpoint {src} lists a file {fname!r} that is not a plain name: not copied")
        _copy_checked(src, fname, want, tmp / fname)
    write_durable(tmp / MANIFEST, read_regular(src / MANIFEST, limit=1 << 20))
    fsync_dir(tmp)
    os.rename(tmp, final)
    replace_durable(dest_root / LATEST, (src.name + "\n").encode())
    return final


def _copy_checked(src_dir: Path, fname: str, want: Mapping[str, Any], dest: Path) -> None:
    try:
        fd = os.open(src_dir / fname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP: a symlink in place of the file, never followed
        raise UserError(f"{src_dir / fname} cannot be copied: {exc.strerror}: the checkpoint is not copied",
                        hint="rerun an attempt that started from another checkpoint") from None
    digest, size = hashlib.sha256(), 0
    with open(fd, "rb") as fh, open(dest, "xb") as out:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{src_dir / fname} is not a regular file: the checkpoint is not copied")
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if size != want.get("size") or digest.hexdigest() != want.get("sha256"):
        raise UserError(f"{src_dir / fname} does not match its manifest (damaged since it was saved): the "
                        "checkpoint is not copied", hint="rerun an attempt that started from another checkpoint")
