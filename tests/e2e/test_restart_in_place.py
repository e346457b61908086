"""Restarts inside the allocation (issue 44), on the test Slurm: a rank that crashes once on a healthy node
costs one in-place restart (same job id, no requeue, a new srun step); a `--nodes 2-4` job that loses a
node goes on on the 3 left, in the same allocation (`--no-kill`); one that loses its batch host is requeued
by the guard step (Slurm 22.05 would leave it RUNNING with nothing in it). Each trains exactly the
(epoch, index) multiset of an uninterrupted run, once the steps a crash lost are dropped (`trained_once`)."""

from __future__ import annotations

import collections
import json
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bench.goodput_bench import kill_node
from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, job_field, run_through_requeues, submit_json, wait_until
from .test_node_failure import _bring_back

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]
SCRIPT = Path(__file__).with_name("restart_keys.py")


def trained_once(folder: Path) -> collections.Counter:
    """The (epoch, index) pairs trained, each step counted once: from the last life (attempt, srun step)
    that trained it; a life that crashed trained some steps after its last checkpoint that the next redid."""
    records = [json.loads(line) for path in folder.glob("keys-*.jsonl") for line in path.read_text().splitlines()]
    last: dict[int, tuple[int, int]] = {}
    for r in records:
        last[r["step"]] = max(last.get(r["step"], tuple(r["life"])), tuple(r["life"]))
    found = collections.Counter()
    for r in records:
        if tuple(r["life"]) == last[r["step"]]:
            found.update((r["epoch"], k) for k in r["keys"])
    return found


def uninterrupted(global_batch: int) -> collections.Counter:
    from hpc_ddp.data.loaders import ResumableSampler

    sampler = ResumableSampler(200, rank=0, world_size=1, seed=0)
    expected = collections.Counter()
    for epoch in range(2):
        sampler.set_position(epoch, 0)
        expected.update((epoch, i) for i in sampler.order()[:200 // global_batch * global_batch])
    return expected


def _submit(tmp_path: Path, *options: str, env: dict[str, str]) -> str:
    shutil.copy(SCRIPT, tmp_path)
    (tmp_path / "keys").mkdir()
    return submit_json(*options, "--run-dir", "run", "restart_keys.py", "--", str(tmp_path / "keys"), cwd=tmp_path,
                       env={"KEYS_CHECKPOINT_EVERY": "3", **env})["job_id"]


def _events(tmp_path: Path) -> list[dict]:
    return read_jsonl(tmp_path / "run" / "events.jsonl")


def _kill_node(node: str, job_id: str) -> None:
    """What test_node_failure does to a node, for one node of a multi-node job on this one machine: its
    slurmd, and the job's processes on it (its slurmstepds, the ranks; the batch shell on the batch host),
    all at one moment (bench.goodput_bench.kill_node, which the goodput bench's trace uses too)."""
    kill_node(job_id, node)


def _finish(job: str, *more: str) -> None:
    for pending in (job, *more):
        if pending and job_field(pending, "JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
            subprocess.run(["scancel", pending])


def _steps(job: str) -> list[str]:
    out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID"], capture_output=True, text=True).stdout
    return [line for line in out.split() if line.startswith(f"{job}.") and line.split(".")[1].isdigit()]


@pytest.mark.slurm_core
def test_a_rank_that_crashes_once_costs_one_restart_in_place(slurm_conf, tmp_path):
    job = _submit(tmp_path, "--partition", "debug", "--nodes", "2", env={"KEYS_CRASH_AT": "7:1", "KEYS_STEP_S": "0.1"})
    try:
        assert run_through_requeues(job, timeout=300, run_dir=tmp_path / "run") == "COMPLETED"
    finally:
        _finish(job)
    events = _events(tmp_path)
    restarted = [e for e in events if e.get("event") == "restarted"]
    assert [(e["cause"], e["nodes"], e["checkpoint_step"]) for e in restarted] == [("failed", "hpcn1,hpcn2", 6)]
    assert [e.get("job_id") for e in events if e.get("event") == "attempt_start"] == [job]   # no requeue
    assert job_field(job, "Restarts") == "0"
    assert [e["step"] for e in events if e.get("event") == "resume"] == [6]
    assert len(_steps(job)) >= 2   # the ranks' first step, the guard's, the restarted ranks'
    assert trained_once(tmp_path / "keys") == uninterrupted(8)
    status = hpc_ddp("status", "run", cwd=tmp_path).stdout
    assert "restarted in place 1 time" in status and "goodput" in status, status


def _on_4(job: str, keys: Path) -> bool:
    return job_field(job, "JobState") == "RUNNING" and job_field(job, "NumNodes") == "4" and bool(list(keys.glob("*")))


@pytest.mark.slurm_core
@pytest.mark.parametrize("which", ["other", "batch_host", pytest.param("other-fsdp", marks=pytest.mark.extended)])
def test_a_2_4_job_that_loses_one_of_its_4_nodes_completes_exactly(slurm_conf, tmp_path, which):
    """`other`: a node that is not the batch host, at a random step: the ranks restart on the 3 left in the
    same allocation (uneven batches keep the global batch of 16). `batch_host`: the batch script dies with
    its node; the guard step requeues the job, which resumes on the nodes that are up. `other-fsdp`: the
    first, with the model sharded (FSDP2): 4 ranks' shards resume on 3 (issue 52)."""
    sharded = which.endswith("-fsdp")
    which = which.removesuffix("-fsdp")
    nodes = subprocess.run(["sinfo", "-h", "-p", "wide", "-o", "%D"], capture_output=True, text=True).stdout.strip()
    if nodes != "4":
        pytest.skip("needs the test Slurm's 4 nodes (HPC_DDP_SLURM_NODES=4, slurm-up's default)")
    job = _submit(tmp_path, "--partition", "wide", "--nodes", "2-4",
                  env={"KEYS_STEP_S": "0.4", **({"KEYS_FSDP": "1"} if sharded else {})})
    rng = random.Random()
    node = None
    try:
        wait_until(lambda: _on_4(job, tmp_path / "keys"), 120, "the job to train on 4 nodes")
        # a checkpoint first, so the restart resumes (and resizes 4 -> 3) rather than starting over; then a
        # random moment after it (seen on 26.05: a kill 1-6 s after the first keys came before any checkpoint)
        wait_until(lambda: (tmp_path / "run" / "checkpoints" / "latest").exists(), 120, "the first checkpoint")
        time.sleep(rng.uniform(1.0, 6.0))
        batch_host = job_field(job, "BatchHost")
        node = batch_host if which == "batch_host" else rng.choice([f"hpcn{i}" for i in range(1, 5)
                                                                   if f"hpcn{i}" != batch_host])
        _kill_node(node, job)
        assert run_through_requeues(job, timeout=420, run_dir=tmp_path / "run") == "COMPLETED"
    finally:
        _finish(job)
        if node:
            _bring_back(node, slurm_conf)
    events = _events(tmp_path)
    restarted = [e for e in events if e.get("event") == "restarted"]
    lost = [e for e in events if e.get("event") == "attempt_end" and e.get("cause") == "node_failure"]
    if which == "other":
        assert [(e["cause"], e["lost_nodes"], e["node_count"]) for e in restarted] == [("node_failure", node, 3)]
        assert not lost and job_field(job, "Restarts") == "0"
        assert [(e["from_world_size"], e["world_size"]) for e in events if e.get("event") == "resized"] == [(4, 3)]
    else:
        assert not restarted and [e["nodes"] for e in lost] == [node]
        assert [e["node"] for e in events if e.get("event") == "batch_host_lost"] == [node]
        assert len([e for e in events if e.get("event") == "attempt_start"]) == 2
    assert trained_once(tmp_path / "keys") == uninterrupted(16)
    assert [e for e in events if e.get("event") == "finish"]
    if sharded:  # the 4 ranks' shards resumed (resized 4 -> 3 above); the final checkpoint is the 3 ranks'
        root = tmp_path / "run" / "checkpoints"
        final = root / (root / "latest").read_text().strip()
        assert sorted(p.name for p in final.glob("__*.distcp")) == [f"__{r}_0.distcp" for r in range(3)]


@pytest.mark.slurm
@pytest.mark.extended
def test_after_a_restart_in_place_with_gpus_each_rank_is_on_its_own_gpu_again(slurm_conf, tmp_path):
    """Issue 53: `--gpus 2 --nodes 2-3` (2 ranks a node, Slurm's fake GPUs through GRES): a rank crashes,
    the ranks start again as a new srun step with an explicit --nodes/--ntasks/--nodelist, and on every node
    each rank takes a GPU of its own again, as in the first step."""
    nodes = subprocess.run(["sinfo", "-h", "-p", "wide", "-o", "%D"], capture_output=True, text=True).stdout.strip()
    if nodes != "4":
        pytest.skip("needs the test Slurm's 4 nodes (HPC_DDP_SLURM_NODES=4, slurm-up's default)")
    job = _submit(tmp_path, "--partition", "wide", "--nodes", "2-3", "--gpus", "2",
                  env={"KEYS_CRASH_AT": "7:3", "KEYS_STEP_S": "0.1", "KEYS_DEVICES": "1"})
    try:
        assert run_through_requeues(job, timeout=300, run_dir=tmp_path / "run") == "COMPLETED"
    finally:
        _finish(job)
    events = _events(tmp_path)
    restarted = [e for e in events if e.get("event") == "restarted"]
    assert [e["cause"] for e in restarted] == ["failed"], events
    lives: dict[tuple[str, str], dict[str, list[str]]] = {}
    for path in (tmp_path / "keys").glob("devices-*.json"):
        _, restart, step, _rank = path.stem.split("-")
        record = json.loads(path.read_text())
        lives.setdefault((restart, step), {}).setdefault(record["node"], []).append(record["own"])
    assert len(lives) == 2, lives  # the first srun step and the restart's
    for life, per_node in lives.items():
        assert len(per_node) >= 2, (life, per_node)
        for node, owns in per_node.items():
            assert sorted(owns) == ["0", "1"], (life, node, owns)  # two ranks, two GPUs, one each
    world = 2 * len(next(iter(lives.values())))
    assert trained_once(tmp_path / "keys") == uninterrupted(4 * world)


@pytest.mark.slurm
def test_a_restart_in_place_keeps_the_users_srun_nodelist(slurm_conf, tmp_path):
    """Issue 53: `--srun-arg=--nodelist=hpcn2` on the ranks' srun, then a rank crash: the restart's srun carries
    the user's --nodelist and its own after it (srun keeps the last; measured on 22.05: `--nodelist=X
    --nodefile=F` takes F, `--nodefile=F --nodelist=X` takes X), on nodes that still include hpcn2."""
    nodes = subprocess.run(["sinfo", "-h", "-p", "wide", "-o", "%D"], capture_output=True, text=True).stdout.strip()
    if nodes != "4":
        pytest.skip("needs the test Slurm's 4 nodes (HPC_DDP_SLURM_NODES=4, slurm-up's default)")
    job = _submit(tmp_path, "--partition", "wide", "--nodes", "2-3", "--max-restarts", "1",
                  "--srun-arg=--nodelist=hpcn2", env={"KEYS_CRASH_AT": "7:0", "KEYS_STEP_S": "0.1"})
    try:
        assert run_through_requeues(job, timeout=300, run_dir=tmp_path / "run") == "COMPLETED"
    finally:
        _finish(job)
    events = _events(tmp_path)
    [restarted] = [e for e in events if e.get("event") == "restarted"]
    assert restarted["cause"] == "failed" and "hpcn2" in restarted["nodes"].split(","), restarted
    assert [e.get("job_id") for e in events if e.get("event") == "attempt_start"] == [job]   # no requeue
    world = restarted["node_count"]
    assert trained_once(tmp_path / "keys") == uninterrupted(4 * world)


@pytest.mark.slurm
@pytest.mark.extended
def test_a_rank_crash_during_rank_0s_background_write_resumes_from_a_committed_checkpoint(slurm_conf, tmp_path):
    """Issue 53: rank 1 dies while rank 0's background thread writes a checkpoint (96 MB of state, so the
    write is seen in flight: a `.tmp-step-*` folder). The step ends, the restart in place resumes from the
    newest checkpoint that was committed (never the half-written one), the unfinished folder is cleared by
    a later save, and every sample is trained once."""
    job = _submit(tmp_path, "--partition", "debug", "--nodes", "2",
                  env={"KEYS_BALLAST_MB": "96", "KEYS_CRASH_IN_WRITE": "1", "KEYS_STEP_S": "0.1",
                       "KEYS_CHECKPOINT_EVERY": "5"})
    try:
        assert run_through_requeues(job, timeout=300, run_dir=tmp_path / "run") == "COMPLETED"
    finally:
        _finish(job)
    crashed = json.loads((tmp_path / "keys" / "crashed").read_text())
    assert [n for n in crashed["saw"] if n.startswith(".tmp-step-")], crashed   # it died during a write
    events = _events(tmp_path)
    [restarted] = [e for e in events if e.get("event") == "restarted"]
    resumed = [e["step"] for e in events if e.get("event") == "resume"]
    assert restarted["cause"] == "failed" and resumed == [restarted["checkpoint_step"]], events
    assert 0 < resumed[0] <= crashed["step"], (resumed, crashed)   # a checkpoint that verified, none half-written
    root = tmp_path / "run" / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert hpc_ddp("inspect", "--json", str(tmp_path / "run"), cwd=tmp_path).returncode == 0
    assert trained_once(tmp_path / "keys") == uninterrupted(8)
