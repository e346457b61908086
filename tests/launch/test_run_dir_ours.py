"""hpc-ddp writes only into run dirs it made (issue 30, data loss): `--run-dir` at a folder of the user's is
refused before anything is written; a new or empty folder, a run dir hpc-ddp made (to resume) and a sweep's
dir are taken."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest


def _submit(cwd, run_dir, *extra):
    return subprocess.run([sys.executable, "-m", "hpc_ddp", "render", "--executor", "sbatch", "--run-dir", run_dir,
                           *extra, "train.py"], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("folder", ["mine", "."])
def test_a_folder_of_the_user_s_is_refused_and_left_as_it_was(tmp_path, folder):
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "spec.json").write_text("precious\n")
    (tmp_path / "mine" / "job.sbatch").write_text("mine\n")
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    done = _submit(tmp_path, folder)
    assert done.returncode == 2 and "is not a run dir hpc-ddp made" in done.stderr, done.stderr
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_new_an_empty_and_an_own_run_dir_are_taken(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "empty").mkdir()
    for folder in ("new", "empty", "new"):  # the second "new": a run dir of ours, submitted again
        done = _submit(tmp_path, folder)
        assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "new" / "spec.json").read_text())["target"]


def test_a_run_dir_whose_spec_json_is_a_link_is_not_ours(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    assert _submit(tmp_path, "run").returncode == 0
    (tmp_path / "elsewhere.json").write_text((tmp_path / "run" / "spec.json").read_text())
    (tmp_path / "run" / "spec.json").unlink()
    (tmp_path / "run" / "spec.json").symlink_to(tmp_path / "elsewhere.json")
    done = _submit(tmp_path, "run")
    assert done.returncode == 2 and "is not a run dir hpc-ddp made" in done.stderr


# ---- a run dir whose job is still live is not submitted into again ----

def _our_run_dir(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    assert _submit(tmp_path, "run").returncode == 0
    return tmp_path / "run"


def test_a_run_dir_whose_local_job_still_runs_is_refused(tmp_path):
    run = _our_run_dir(tmp_path)
    spec_before = (run / "spec.json").read_bytes()
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys, time; from hpc_ddp.common.procs import "
                                "write_pid_file; write_pid_file(sys.argv[1], 'local-1-2'); time.sleep(60)",
                                str(run / "local.pid")])
    try:
        for _ in range(100):
            if (run / "local.pid").exists():
                break
            time.sleep(0.05)
        done = _submit(tmp_path, "run")
        assert done.returncode == 2, done.stderr
        assert "job local-1-2 is still running in this run dir" in done.stderr and "hpc-ddp cancel" in done.stderr
        assert (run / "spec.json").read_bytes() == spec_before
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _submit(tmp_path, "run").returncode == 0  # its process gone: the pid file is stale, the dir resumable


def test_a_run_dir_whose_slurm_job_is_queued_is_refused_and_an_ended_one_is_taken(tmp_path):
    from hpc_ddp.common.errors import UserError
    from hpc_ddp.common.procs import Completed, FakeCommands
    from hpc_ddp.launch.rundirs import check_not_live

    run = _our_run_dir(tmp_path)
    with open(run / "submissions.jsonl", "a") as fh:
        fh.write(json.dumps({"executor": "sbatch", "job_id": "41"}) + "\n")
        fh.write(json.dumps({"executor": "sbatch", "job_id": "42", "via": "chain"}) + "\n")
    queued = FakeCommands({"squeue": lambda argv: Completed(tuple(argv), 0, "42\n")})
    with pytest.raises(UserError, match="Slurm job 42 of this run dir is still queued or running"):
        check_not_live(str(run), queued)
    assert queued.calls[0][0] == ("squeue", "-h", "-o", "%i", "-j", "41,42")
    check_not_live(str(run), FakeCommands({"squeue": lambda argv: Completed(tuple(argv), 0, "")}))
    check_not_live(str(run), FakeCommands(installed=()))  # no Slurm here: nothing to ask
    check_not_live(str(tmp_path / "new"), queued)  # not a run dir yet


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "esc\x1b[2J"])
def test_a_run_dir_name_with_a_control_character_is_refused(tmp_path, name):
    (tmp_path / "train.py").write_text("print(1)\n")
    done = _submit(tmp_path, name)
    assert done.returncode == 2 and "has a control character" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]
