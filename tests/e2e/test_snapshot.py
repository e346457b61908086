"""The code that runs is the code submitted: a script edited (and committed) while its job waits to run
again resumes with the code as submitted, on every executor; status names the commit and the uncommitted
changes each attempt ran; a resubmission to the run dir takes a new snapshot and says what changed.

On the test Slurm the job is preempted for real between the edit and the requeue; under the local and srun
executors `hpc-ddp preempt` stops the first attempt after the edit, and the executor runs the next. A sweep's second task, started after the edit,
runs the submitted code too."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, job_field, submit_json, wait_until
from .test_frameworks import _preempt_all, _wait_done

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main"]

# A torchrun-style script that imports a sibling module and a package of its project, records what it
# ran (rank 0: one line per attempt), and goes on from its own progress file. At SIGTERM (a preemption) or
# SIGUSR2 (the warning `hpc-ddp preempt` sends) it saves and leaves with exit code 0.
SCRIPT = """
import hashlib, json, os, signal, sys, time
import torch, torch.distributed as dist
import consts
from pkg import mod

out = sys.argv[1]
progress = os.path.join(out, "progress.json")
dist.init_process_group("gloo")
start = json.load(open(progress))["step"] if os.path.exists(progress) else 0
if dist.get_rank() == 0:
    with open(os.path.join(out, "records.jsonl"), "a") as fh:
        fh.write(json.dumps({"value": consts.VALUE, "pkg": mod.X, "file": __file__, "start": start,
                             "sha": hashlib.sha256(open(__file__, "rb").read()).hexdigest()}) + "\\n")
stop = []
for sig in (signal.SIGTERM, signal.SIGUSR2):
    signal.signal(sig, lambda *_: stop.append(1))

for step in range(start, 40):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.25)
    if dist.get_rank() == 0:
        with open(progress + ".tmp", "w") as fh:
            json.dump({"step": step + 1}, fh)
        os.replace(progress + ".tmp", progress)
    flag = torch.tensor([float(bool(stop))])
    dist.all_reduce(flag)
    if flag.item():
        sys.exit(0)
dist.destroy_process_group()
"""


def _git(root: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def project(tmp_path):
    """A git project, committed with VALUE = 1, then edited (VALUE = 2, not committed): the submitted code."""
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text(SCRIPT)
    (root / "consts.py").write_text("VALUE = 1\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("X = 'a'\n")
    (root / ".gitignore").write_text("runs/\nout*/\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "first")
    (root / "consts.py").write_text("VALUE = 2\n")
    return root


def _edit(root: Path) -> None:
    """What the author does while the job waits: changes every file the job imports, and commits."""
    (root / "consts.py").write_text("VALUE = 3\n")
    (root / "pkg" / "mod.py").write_text("X = 'b'\n")
    (root / "train.py").write_text(SCRIPT + "# edited\n")
    _git(root, "commit", "-qam", "edited while the job waited")


def _records(out: Path) -> list[dict]:
    path = out / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ran_as_submitted(out: Path, run_dir: Path, attempts: int) -> str:
    """Every attempt ran the submitted code from the snapshot; returns the snapshot's id."""
    submitted = hashlib.sha256(SCRIPT.encode()).hexdigest()
    records = _records(out)
    assert len(records) == attempts and records[-1]["start"] > 0, records
    assert {(r["value"], r["pkg"], r["sha"]) for r in records} == {(2, "a", submitted)}, records
    snaps = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "snapshot"]
    assert len(snaps) == 1 and snaps[0]["git"]["dirty"] and snaps[0]["git"]["changed"] == ["consts.py"]
    code = snaps[0]["code"]
    assert all(r["file"] == str(run_dir / "code" / code / "train.py") for r in records)
    diff = (run_dir / "code" / snaps[0]["patch"]).read_text()
    assert "-VALUE = 1" in diff and "+VALUE = 2" in diff
    return code


def _status_shows(run_dir: Path, cwd: Path, code: str, attempts: int) -> dict:
    status = json.loads(hpc_ddp("status", "--json", str(run_dir), cwd=cwd).stdout)
    assert [a["code"] for a in status["attempts"]] == [code] * attempts, status["attempts"]
    assert all(a["environment"] and a["environment"]["torch"] for a in status["attempts"]), status["attempts"]
    text = hpc_ddp("status", str(run_dir), cwd=cwd).stdout
    assert text.count(f"code {code} (git ") == attempts and "+ uncommitted changes (code/" in text, text
    return status


@pytest.mark.slurm
def test_a_script_edited_while_its_preempted_job_waits_resumes_with_the_submitted_code(slurm_conf, project):
    out = project / "out"
    out.mkdir()
    job = submit_json("--executor", "sbatch", "--partition", "grace", "--nodes", "2", "--run-dir", "runs/pre",
                      "train.py", str(out), cwd=project)["job_id"]
    wait_until(lambda: _records(out) and json.loads((out / "progress.json").read_text())["step"] >= 8
               if (out / "progress.json").exists() else False, 300, "the job's step 8")
    first_commit = _git(project, "rev-parse", "HEAD")
    _edit(project)
    _preempt_all([job])
    assert _wait_done(job) == "COMPLETED", hpc_ddp("logs", job, cwd=project).stdout[-3000:]
    assert job_field(job, "Restarts") == "1"
    run_dir = project / "runs" / "pre"
    code = _ran_as_submitted(out, run_dir, attempts=2)
    _status_shows(run_dir, project, code, attempts=2)

    # Resubmitted to the same run dir, on purpose: a new snapshot, and what changed since the last one.
    (out / "progress.json").write_text(json.dumps({"step": 30}))
    done = hpc_ddp("submit", "--json", "--executor", "sbatch", "--nodes", "2", "--run-dir", "runs/pre",
                   "train.py", str(out), cwd=project)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "a new snapshot for this run dir" in line]
    assert len(said) == 1 and f"replacing {code}" in said[0], done.stderr
    assert f"commit {first_commit[:12]} -> {_git(project, 'rev-parse', 'HEAD')[:12]}" in said[0]
    assert "3 changed (consts.py, pkg/mod.py, train.py)" in said[0]
    again = json.loads(done.stdout[done.stdout.index("{"):])
    assert _wait_done(again["job_id"]) == "COMPLETED"
    assert _records(out)[-1]["value"] == 3 and again["code"]["id"] != code
    status = json.loads(hpc_ddp("status", "--json", str(run_dir), cwd=project).stdout)
    assert [a["code"] for a in status["attempts"]] == [code, code, again["code"]["id"]]
    text = hpc_ddp("status", str(run_dir), cwd=project).stdout
    assert "(a new snapshot: resubmitted)" in text and f"code {again['code']['id']} (git " in text


def _step(out: Path) -> int:
    try:
        return json.loads((out / "progress.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


def _run_preempted(project: Path, out: Path, command: list[str], run_dir: str) -> subprocess.CompletedProcess:
    """Run `command` (it blocks until the job ends); edit the code during the first attempt, then stop it
    as a preemption would (`hpc-ddp preempt`): the executor runs the next attempt."""
    proc = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _step(out) >= 4 or proc.poll() is not None, 240, "the first attempt's step 4")
        assert proc.poll() is None, proc.communicate()
        _edit(project)
        sent = hpc_ddp("preempt", run_dir, cwd=project, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.e2e
def test_the_local_executors_next_attempt_runs_the_submitted_code(project):
    out = project / "out"
    out.mkdir()
    done = _run_preempted(project, out, [sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local",
                                         "--tasks-per-node", "2", "--run-dir", "runs/local", "train.py", str(out)],
                          "runs/local")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = project / "runs" / "local"
    code = _ran_as_submitted(out, run_dir, attempts=2)
    _status_shows(run_dir, project, code, attempts=2)


@pytest.mark.slurm
def test_the_srun_executors_next_attempt_runs_the_submitted_code(slurm_conf, project):
    out = project / "out"
    out.mkdir()
    done = _run_preempted(project, out, ["salloc", "-N2", "--ntasks-per-node=1", "--time=5", sys.executable, "-m",
                                         "hpc_ddp", "run", "--run-dir", "runs/srun", "train.py", str(out)], "runs/srun")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = project / "runs" / "srun"
    code = _ran_as_submitted(out, run_dir, attempts=2)
    _status_shows(run_dir, project, code, attempts=2)


SWEEP_TASK = """
import os, sys, time
import consts
out = sys.argv[1]
tag = sys.argv[2].split("=", 1)[1]
if tag == "a":
    open(os.path.join(out, "waiting"), "w").close()
    while not os.path.exists(os.path.join(out, "edited")):
        time.sleep(0.1)
with open(os.path.join(out, f"task-{tag}.txt"), "w") as fh:
    fh.write(f"{consts.VALUE} {__file__}")
"""


@pytest.mark.e2e
def test_a_sweeps_later_task_runs_the_code_the_sweep_was_submitted_with(project):
    (project / "task.py").write_text(SWEEP_TASK)
    out = project / "out"
    out.mkdir()
    command = [sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--sweep", "args.tag=a,b",
               "--run-dir", "runs/sweep", "task.py", str(out)]
    proc = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (out / "waiting").exists() or proc.poll() is not None, 120, "task 0 to wait")
        _edit(project)
        (out / "edited").touch()
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = subprocess.CompletedProcess(command, proc.returncode, "", stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    code_dirs = list((project / "runs" / "sweep" / "code").iterdir())
    copies = [p for p in code_dirs if p.is_dir()]
    assert len(copies) == 1  # one copy for every task
    for tag in "ab":
        value, file = (out / f"task-{tag}.txt").read_text().split()
        assert value == "2" and file == str(copies[0] / "task.py"), (tag, value, file)
    for task in ("task-0", "task-1"):
        snaps = [e for e in read_jsonl(project / "runs" / "sweep" / task / "events.jsonl") if e["event"] == "snapshot"]
        assert [s["code"] for s in snaps] == [copies[0].name]
