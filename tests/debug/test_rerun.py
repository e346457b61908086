"""`hpc-ddp rerun`'s planning (pure: which attempt, which checkpoint, what sizes and what that changes), the
copy of the starting checkpoint (the original is only read), and the command's refusals (exit 2, one line,
nothing written). The replay itself, of a crash on the test Slurm: tests/e2e/test_rerun.py."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from hpc_ddp.cli.app import cli as app_cli
from hpc_ddp.cli.cmd_debug import rerun
from hpc_ddp.common.errors import UserError
from hpc_ddp.debug import rerun as rr
from hpc_ddp.spec.jobspec import Layer, Target, build_spec
from hpc_ddp.spec.trainconfig import TrainConfig

# The real group (its error handling) with rerun in it, without changing the group other tests list.
cli = copy.copy(app_cli)
cli.commands = {**app_cli.commands, "rerun": rerun}


def spec(**values):
    return build_spec([Layer("t", values)], target=Target("script", "/w/train.py", ("--crash-at", "12")),
                      workdir="/w", python="/py")


# A chain of two jobs: job 7 trained to a checkpoint at step 6 and was preempted; job 8 resumed from it
# (its latest said step 6 too) and crashed.
EVENTS = [
    {"event": "attempt_start", "attempt": 0, "job_id": "7", "nodes": "hpcn[1-2]", "checkpoint_step": None},
    {"event": "start", "step": 0},
    {"event": "attempt_end", "attempt": 0, "exit_code": 75, "cause": "preempted"},
    {"event": "attempt_start", "attempt": 0, "job_id": "8", "chain": "7", "nodes": "hpcn[1-2]", "checkpoint_step": 6},
    {"event": "resume", "step": 6, "path": "/old/place/checkpoints/step-000000006-r1"},
    {"event": "attempt_end", "attempt": 0, "exit_code": 1, "cause": "failed"},
]


def test_attempts_and_the_checkpoint_each_loaded_come_from_the_events():
    first, second = rr.attempt_records(EVENTS)
    assert (first.job_id, first.number, first.cause, first.checkpoint) == ("7", 0, "preempted", None)
    # The resume record names the checkpoint really loaded (here a re-save of step 6), not just its step.
    assert (second.job_id, second.cause, second.start_step, second.checkpoint) == ("8", "failed", 6,
                                                                                   "step-000000006-r1")
    assert second.label == "attempt 0 of job 8" and second.nodes == "hpcn[1-2]"


def test_without_a_resume_record_the_start_step_names_the_checkpoint():
    [record] = rr.attempt_records([{"event": "attempt_start", "attempt": 2, "job_id": "9", "checkpoint_step": 40},
                                   {"event": "attempt_end", "attempt": 2, "exit_code": 1}])
    assert record.checkpoint == "step-000000040" and record.cause == "failed"


def test_the_default_is_the_last_failed_attempt():
    assert rr.choose_attempt(rr.attempt_records(EVENTS), None, None, False).job_id == "8"


@pytest.mark.parametrize("number, job, any_outcome, says", [
    (0, None, False, "attempt 0 is in several jobs of this run (7, 8) HINT: say which with --job ID, one of 7, 8"),
    (0, "7", False, "attempt 0 of job 7 did not fail: it ended preempted, exit code 75 HINT: add --any-outcome"),
    (3, None, False, "no attempt 3 in this run (it has: attempt 0 of job 7, attempt 0 of job 8)"),
    (None, "99", False, "no attempt of job 99 in this run"),
])
def test_an_attempt_that_cannot_be_replayed_is_one_line_with_the_fix(number, job, any_outcome, says):
    with pytest.raises(UserError) as caught:
        rr.choose_attempt(rr.attempt_records(EVENTS), number, job, any_outcome)
    assert str(caught.value).startswith(says)


def test_an_attempt_that_did_not_fail_is_replayed_on_request_but_one_never_admitted_never():
    records = rr.attempt_records(EVENTS)
    assert rr.choose_attempt(records, 0, "7", True).cause == "preempted"
    refused = rr.attempt_records([{"event": "attempt_start", "attempt": 1, "job_id": "7"},
                                  {"event": "attempt_end", "attempt": 1, "exit_code": 3, "cause": "not_admitted"}])
    with pytest.raises(UserError, match="never ran"):
        rr.choose_attempt(refused, 1, None, True)
    with pytest.raises(UserError, match=r"no attempt of this run failed \(attempt 0 of job 7: preempted\)"):
        rr.choose_attempt(records[:1], None, None, False)


# ---- sizes: what the world size may be, and what changes (pure) ----

def test_a_checkpoint_pins_the_world_size_even_past_this_machines_cores():
    sizes = rr.plan_sizes(spec(nodes=2, gpus=4), 8, "step-000000040", nodes=None, tasks_per_node=None,
                          cpus=2, gpus_here=0)
    assert (sizes.nodes, sizes.tasks_per_node, sizes.gpus) == (2, 4, 0)
    assert sizes.notes[0].startswith("world size: 8 rank(s), as the job (2 simulated node(s) x 4): "
                                     "step-000000040 was saved by 8 ranks")
    assert "8 ranks on 2 CPU core(s)" in sizes.notes[1]
    assert "gloo instead of nccl" in sizes.notes[2]
    with pytest.raises(UserError, match="saved by 8 ranks; a resume needs as many .* HINT: keep 8 ranks"):
        rr.plan_sizes(spec(nodes=2, gpus=4), 8, "step-000000040", nodes=1, tasks_per_node=2, cpus=2, gpus_here=0)


def test_without_a_checkpoint_the_world_is_scaled_down_and_the_global_batch_named():
    trainer = dataclasses.replace(spec(nodes=2, gpus=4), train=TrainConfig(batch_size=32))
    sizes = rr.plan_sizes(trainer, None, None, nodes=1, tasks_per_node=2, cpus=16, gpus_here=0)
    assert (sizes.nodes, sizes.tasks_per_node) == (1, 2)
    assert sizes.notes[0].startswith("world size: 8 -> 2 rank(s) (1 node(s) x 2): per-rank batch 32 unchanged, "
                                     "global batch 256 -> 64")
    fitted = rr.plan_sizes(spec(nodes=2, gpus=4), None, None, nodes=None, tasks_per_node=None, cpus=2, gpus_here=0)
    assert (fitted.nodes, fitted.tasks_per_node) == (1, 2) and "BATCH_SIZE unchanged" in fitted.notes[0]
    kept = rr.plan_sizes(spec(nodes=2, tasks_per_node=1), None, None, nodes=None, tasks_per_node=None, cpus=2,
                         gpus_here=0)
    assert (kept.nodes, kept.tasks_per_node, kept.notes) == (2, 1, ("world size: 2 rank(s), as the job "
                                                                      "(2 simulated node(s) x 1): it fits this machine",))


def test_gpus_here_give_one_per_rank():
    sizes = rr.plan_sizes(spec(nodes=1, gpus=2), None, None, nodes=None, tasks_per_node=None, cpus=8, gpus_here=4)
    assert sizes.gpus == 2 and sizes.notes[-1] == "GPUs: one per rank (2 of the 4 here)"


def test_the_rerun_spec_runs_once_here_without_the_clusters_limits():
    original = spec(nodes=2, tasks_per_node=1, time="1:00:00", master_port=24555, max_requeues=5, partition="gpu")
    new = rr.rerun_spec(original, rr.Sizes(2, 1, 0, ()), "/runs/new")
    assert (new.executor, new.run_dir, new.time, new.master_port, new.max_requeues, new.max_preemptions) == \
        ("local", "/runs/new", None, None, 0, 0)
    assert new.target == original.target and new.partition == "gpu"  # what the program sees is unchanged


# ---- a run dir on disk: the checkpoint copy, and the command ----

def make_checkpoint(root: Path, name: str, world: int) -> Path:
    path = root / name
    path.mkdir(parents=True)
    files = {}
    for fname, data in (("model.pt", b"weights" * 1000), ("session.pt", b"rng")):
        (path / fname).write_bytes(data)
        files[fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"step": int(name.split("-")[1]), "files": files, "fingerprint": {"world_size": world}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def spec_here(root: Path, **values):
    """A spec whose script and python are on this machine (a rerun refuses one whose are not)."""
    import sys

    (root / "w").mkdir(exist_ok=True)
    (root / "w" / "train.py").write_text("raise SystemExit(1)\n")
    return build_spec([Layer("t", values)], target=Target("script", "train.py", ("--crash-at", "12")),
                      workdir=str(root / "w"), python=sys.executable)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "crash-20261123-120000"
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps(spec_here(tmp_path, nodes=2, tasks_per_node=1).to_dict()))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    for name in ("step-000000006", "step-000000006-r1", "step-000000010"):
        make_checkpoint(run / "checkpoints", name, 2)
    (run / "checkpoints" / "latest").write_text("step-000000010\n")
    return run


def snapshot(path: Path) -> dict[str, tuple[int, int, str]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "")
            for p in sorted(path.rglob("*"))}


def plan_for(run: Path, **overrides):
    import datetime as dt

    args = {"attempt": None, "job": None, "any_outcome": False, "nodes": None, "tasks_per_node": None,
            "run_dir": None, "cpus": 2, "gpus_here": 0, "now": dt.datetime(2026, 11, 23, 12, 30)}
    return rr.plan_rerun(run, **{**args, **overrides})


def test_the_starting_checkpoint_is_copied_and_made_latest_and_the_original_left_as_it_was(run_dir):
    before = snapshot(run_dir)
    plan = plan_for(run_dir)
    assert plan.run_dir == run_dir.parent / "crash-20261123-120000-rerun-8-a0-20261123-123000"
    assert plan.checkpoint == run_dir / "checkpoints" / "step-000000006-r1"
    rr.make_rerun_dir(plan)
    copied = plan.run_dir / "checkpoints"
    assert sorted(p.name for p in copied.iterdir()) == ["latest", "step-000000006-r1"]
    assert (copied / "latest").read_text() == "step-000000006-r1\n"
    assert (copied / "step-000000006-r1" / "model.pt").read_bytes() == b"weights" * 1000
    record = json.loads((plan.run_dir / "rerun.json").read_text())
    assert (record["source_run_dir"], record["job_id"], record["attempt"], record["checkpoint_step"]) == \
        (str(run_dir), "8", 0, 6)
    assert json.loads((plan.run_dir / "events.jsonl").read_text())["event"] == "rerun_of"
    assert oct(plan.run_dir.stat().st_mode & 0o777) == "0o700"
    assert snapshot(run_dir) == before


def test_a_damaged_or_linked_checkpoint_file_is_not_copied_and_leaves_no_rerun_dir(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step-000000006-r1"
    (ckpt / "model.pt").write_bytes(b"tampered" * 1000)
    plan = plan_for(run_dir)
    with pytest.raises(UserError, match="model.pt does not match its manifest"):
        rr.make_rerun_dir(plan)
    assert not plan.run_dir.exists()
    (ckpt / "model.pt").unlink()
    (tmp_path / "secret").write_bytes(b"weights" * 1000)
    os.symlink(tmp_path / "secret", ckpt / "model.pt")
    with pytest.raises(UserError, match="model.pt cannot be copied: Too many levels of symbolic links"):
        rr.make_rerun_dir(plan_for(run_dir))
    assert not plan.run_dir.exists()


def test_a_pruned_checkpoint_or_a_run_dir_inside_the_original_is_refused(run_dir):
    import shutil

    with pytest.raises(UserError, match=r"inside the original run dir .* HINT: give --run-dir a place outside it"):
        plan_for(run_dir, run_dir=str(run_dir / "reruns" / "x"))
    shutil.rmtree(run_dir / "checkpoints" / "step-000000006-r1")
    with pytest.raises(UserError, match=r"started from step-000000006-r1, which is no longer in .* \(now: "
                                        r"step-000000006, step-000000010\)"):
        plan_for(run_dir)


def test_the_command_refuses_with_one_line_and_exit_2(run_dir, tmp_path, capsys):
    for args, says in ((["rerun", str(tmp_path / "nothing")], "no run dir or known job"),
                       (["rerun", str(run_dir), "--attempt", "0", "--job", "7"], "did not fail"),
                       (["rerun", str(run_dir), "--nodes", "1"], "a resume needs as many")):
        with pytest.raises(SystemExit) as caught:
            cli.main(args)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]  # nothing written


def test_dry_run_says_what_is_replayed_and_writes_nothing(run_dir, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["rerun", str(run_dir), "--dry-run"])
    out = capsys.readouterr().out
    assert caught.value.code == 0
    assert out.splitlines()[0] == f"rerun of attempt 0 of job 8 (failed) of {run_dir}"
    assert "starts from step-000000006-r1 (copied)" in out and "saved by 2 ranks" in out
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]


def test_data_comes_from_the_source_else_the_jobs_node_local_copy_still_here(tmp_path):
    source, copy = tmp_path / "data" / "mnist", tmp_path / "node-scratch" / "hpc-ddp-datasets" / "mnist"
    source.mkdir(parents=True)
    copy.mkdir(parents=True)
    (copy.parent / "mnist.complete.json").write_text(json.dumps({"source": str(source)}))
    run = tmp_path / "run"
    logs = run / "logs" / "job-8" / "attempt-0"
    logs.mkdir(parents=True)
    (logs / "rank-0.log").write_text(f"hpc-ddp stage: mnist: 3 files, 0.1 MB in 0.0 s (9 MB/s) -> {copy}\n")
    with_data = spec(datasets=[f"{source}:mnist"])
    record = rr.attempt_records(EVENTS)[1]
    assert rr._datasets(with_data, run, record) == (((("mnist", str(source)),),
                                                     [f"data mnist: staged again from {source}, as on a new node"]))
    source.rmdir()
    datasets, notes = rr._datasets(with_data, run, record)
    assert datasets == (("mnist", str(copy)),) and "its source" in notes[0] and str(copy) in notes[0]
    (copy.parent / "mnist.complete.json").write_text(json.dumps({"source": "/somewhere/else"}))
    with pytest.raises(UserError, match="its source .* is gone, and the job's node-local copy is not on this machine"):
        rr._datasets(with_data, run, record)


def test_a_rerun_runs_the_code_snapshot_its_attempt_ran(tmp_path):
    import sys

    from hpc_ddp.debug.rerun import AttemptRecord, attempt_code
    from hpc_ddp.spec.code import Code
    from hpc_ddp.spec.jobspec import Target, build_spec

    code_root = tmp_path / "run" / "code"
    (code_root / "old").mkdir(parents=True)
    latest = Code(str(tmp_path / "proj"), str(code_root / "new"), "new", str(code_root / "new" / "sub" / "t.py"))
    spec = dataclasses.replace(build_spec([], target=Target("script", str(tmp_path / "proj" / "sub" / "t.py")),
                                          workdir=str(tmp_path), python=sys.executable), code=latest)

    def record(code):
        return AttemptRecord("7", 0, "failed", 1, None, None, None, code)

    code, notes = attempt_code(spec, record("old"))  # resubmitted since with newer code: the attempt's own
    assert code == Code(latest.project, str(code_root / "old"), "old", str(code_root / "old" / "sub" / "t.py"))
    assert notes == ["code: the snapshot attempt 0 of job 7 ran (old), not the working tree"]
    code, notes = attempt_code(spec, record("gone"))
    assert code == latest and "is gone" in notes[0]
    assert attempt_code(spec, record("new"))[0] == latest
    assert attempt_code(dataclasses.replace(spec, code=None), record(None))[0] is None


# ---- issue 30: refused before anything is made; the rerun runs what it plans ----

def rewrite_spec(run: Path, **changes) -> None:
    data = json.loads((run / "spec.json").read_text())
    (run / "spec.json").write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize("change, says", [
    ("script", "the script {w}/train.py is not here (removed since the run, or on another machine)"),
    ("python", "the run's python /gone/bin/python is not an executable here"),
    ("env", "its env sets RANK, which the rerun sets itself (hpc-ddp sets it on every rank"),
    ("env_addr", "its env sets MASTER_ADDR, which the rerun sets itself"),
])
def test_what_cannot_be_replayed_as_planned_is_refused_in_one_line_writing_nothing(run_dir, tmp_path, capsys,
                                                                                  change, says):
    if change == "script":
        (tmp_path / "w" / "train.py").unlink()
    elif change == "python":
        rewrite_spec(run_dir, python="/gone/bin/python")
    else:
        rewrite_spec(run_dir, env=[["NCCL_DEBUG", "INFO"], ["RANK" if change == "env" else "MASTER_ADDR", "5"]])
    with pytest.raises(SystemExit) as caught:
        cli.main(["rerun", str(run_dir)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert says.format(w=tmp_path / "w") in err and "HINT:" in err, err
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]  # nothing made


def test_a_sweep_tasks_own_values_in_env_are_replayed(run_dir):
    rewrite_spec(run_dir, env=[["HPC_DDP_SWEEP_TASK", "1"], ["HPC_DDP_SWEEP_LR", "0.1"]])
    assert dict(plan_for(run_dir).spec.env) == {"HPC_DDP_SWEEP_TASK": "1", "HPC_DDP_SWEEP_LR": "0.1"}


@pytest.mark.parametrize("job_id", ["../../x", "/tmp/x", "8/../../x", "8\nx", "..", "local-1-2/../x"])
def test_a_job_id_no_executor_makes_is_refused_before_it_names_anything(run_dir, job_id):
    events = [dict(e, job_id=job_id) if e.get("job_id") == "8" else e for e in EVENTS]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    with pytest.raises(UserError, match="give it a job id that no executor makes"):
        plan_for(run_dir)
    assert sorted(p.name for p in run_dir.parent.iterdir()) == [run_dir.name]
    assert not (run_dir.parent.parent / "x").exists()


@pytest.mark.parametrize("job_id", ["8123", "8123_4", "local-4242-1764230000", "local-4242-1764230000-t3",
                                    "900-srun-4242-1764230000", "none-srun-1-2-t0"])
def test_the_ids_the_executors_make_pass(job_id):
    rr.check_job_id(rr.AttemptRecord(job_id, 0, "failed", 1, None, None, None))


def test_node_setup_is_in_the_plan_or_not_run(run_dir, tmp_path, capsys):
    """The cluster's per-node setup is not run here, and the plan says so; the rerun runs only what it shows."""
    marker = tmp_path / "node-setup-ran"
    rewrite_spec(run_dir, node_setup=[f"touch {marker}"])
    plan = plan_for(run_dir)
    assert plan.spec.node_setup == ()
    assert any(n.startswith("node_setup not run here (1 line(s), the first: 'touch ") for n in plan.notes)
    with pytest.raises(SystemExit) as caught:
        cli.main(["rerun", str(run_dir), "--dry-run"])
    assert caught.value.code == 0 and "node_setup not run here" in capsys.readouterr().out
    with pytest.raises(SystemExit) as caught:
        cli.main(["rerun", str(run_dir), "--json"])
    outcome = json.loads(capsys.readouterr().out)
    assert caught.value.code == 1 and outcome["returncode"] == 1  # the script exits 1, as planned
    assert not marker.exists()
