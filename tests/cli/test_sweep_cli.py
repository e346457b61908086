"""`hpc-ddp submit --sweep` through click's runner, with a fake sbatch (and scontrol) on PATH: what is
submitted, what a dry run shows, and refusals that submit and write nothing."""

import json

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "job.toml").write_text('nodes = 2\n[train]\ndataset = "fake"\nlr = 0.1\n'
                                       '[sweep]\nweight_decay = [0.0, 0.0005]\nmax_running = 1\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    for name, body in (("sbatch", f"echo \"$PWD $*\" >> {calls}\necho '900;cluster'"),
                       ("scontrol", "[ \"$2\" = config ] && echo 'MaxArraySize            = 4'; exit 0"),
                       ("sinfo", "for n in hpcn1 hpcn2; do echo \"debug*|up|infinite|$n|idle|4|4000|gpu:2\"; done")):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_a_sweep_is_one_array_and_says_each_tasks_id(project):
    result = invoke("submit", "--nodes", "2", "--sweep", "lr=0.1,0.01", "--sweep", "args.dropout=0,0.5",
                    "--run-dir", "sw", "train.py")
    assert result.exit_code == 0, result.output
    assert "Submitted array job 900 (sbatch): 4 tasks" in result.output
    assert "task 3: job 900_3  lr=0.01 args.dropout=0.5" in result.output
    assert (project / "sbatch-calls").read_text().split() == [str(project / "sw"), "--parsable", "job.sbatch"]
    spec = json.loads((project / "sw" / "task-3" / "spec.json").read_text())
    assert spec["lr"] == 0.01 and spec["target"]["args"] == ["--dropout=0.5"]


def test_a_job_files_sweep_table(project):
    result = invoke("submit", "--json", "--run-dir", "sw", "job.toml")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert out["array_job_id"] == "900" and [t["values"] for t in out["tasks"]] == [
        {"train.weight_decay": 0.0}, {"train.weight_decay": 0.0005}]
    assert "#SBATCH --array=0-1%1" in (project / "sw" / "job.sbatch").read_text()


def test_a_dry_run_shows_the_array_and_task_0s_script_and_writes_nothing(project):
    result = invoke("submit", "--dry-run", "--sweep", "lr=0.1,0.2", "train.py")
    assert result.exit_code == 0, result.output
    assert "#SBATCH --array=0-1" in result.output and "task 0's job script" in result.output
    assert not (project / "runs").exists() and not (project / "sbatch-calls").exists()


@pytest.mark.parametrize("args, message", [
    (["--sweep", "lr=", "train.py"], "--sweep lr: no values"),
    (["--sweep", "foo=1,2", "train.py"], "--sweep foo: not a setting"),
    (["--sweep", "gpus=1,2", "train.py"], "same allocation"),
    (["--sweep", "lr=1,2,3,4,5", "train.py"], "more than this cluster's MaxArraySize of 4"),
    (["--sweep", "lr=1,2", "--chain", "0", "train.py"], "--chain"),
    (["--sweep", "lr=1,2", "--chain", "2", "train.py"], "--chain with --sweep"),
    (["--sweep", "lr=x,2", "train.py"], "--sweep lr: 'x' is not a number"),
    (["--max-running", "2", "train.py"], "no sweep is given"),
    (["--sweep", "lr=1,2", "--max-running", "2", "--executor", "local", "train.py"], "one by one"),
])
def test_bad_sweeps_are_one_line_exit_2_nothing_submitted_or_written(project, args, message):
    result = invoke("submit", *args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()


def test_commands_that_need_one_run_name_a_task_of_a_sweep(project):
    assert invoke("submit", "--sweep", "lr=0.1,0.2", "--run-dir", "sw", "train.py").exit_code == 0
    for command in ("logs", "timeline"):
        result = invoke(command, "sw")
        assert result.exit_code == 2 and "is a sweep: give one of its tasks" in result.output, result.output
        assert "900_0" in result.output


def test_a_sweep_and_a_run_never_share_a_dir_or_nest(project):
    assert invoke("submit", "--run-dir", "single", "train.py").exit_code == 0
    assert invoke("submit", "--sweep", "lr=1,2", "--run-dir", "sw", "train.py").exit_code == 0
    calls = (project / "sbatch-calls").read_text()
    for args, message in ((["--sweep", "lr=1,2", "--run-dir", "single"], "is a run dir"),
                          (["--run-dir", "sw"], "is a sweep's dir"),
                          (["--run-dir", "sw/task-0"], "inside the sweep dir"),
                          (["--sweep", "lr=1,2", "--run-dir", "sw/task-0/nested"], "inside the run dir"),
                          (["--dry-run", "--sweep", "lr=1,2", "--run-dir", "single"], "is a run dir")):
        result = invoke("submit", *args, "train.py")
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert (project / "sbatch-calls").read_text() == calls
    assert "job.sbatch" in (project / "single" / "job.sbatch").name and not (project / "single" / "sweep.json").exists()


def test_a_dry_run_refuses_what_the_submission_would(project):
    assert invoke("submit", "--sweep", "lr=1,2", "--run-dir", "sw", "train.py").exit_code == 0
    for args, message in ((["--sweep", "lr=3,4", "--run-dir", "sw"], "holds another sweep"),
                          (["--sweep", "lr=1,2,3,4,5", "--no-preflight"], "MaxArraySize of 4")):
        result = invoke("submit", "--dry-run", *args, "train.py")
        assert result.exit_code == 2 and message in result.output, result.output


# ---- issue 30: values reach what runs as typed, and no axis or setting is silently dropped ----

def task_specs(project, sweep="sw"):
    return [json.loads(p.read_text()) for p in sorted((project / sweep).glob("task-*/spec.json"))]


def test_a_scripts_values_reach_it_exactly_as_spelled(project):
    result = invoke("submit", "--sweep", "args.version=1.10,0x10", "--sweep", 'args.name="a,b", c ',
                    "--run-dir", "sw", "train.py")
    assert result.exit_code == 0, result.output
    assert "task 1: job 900_1  args.version=1.10 args.name=c" in result.output
    assert [s["target"]["args"] for s in task_specs(project)] == [
        ["--version=1.10", "--name=a,b"], ["--version=1.10", "--name=c"],
        ["--version=0x10", "--name=a,b"], ["--version=0x10", "--name=c"]]
    assert [dict(s["env"])["HPC_DDP_SWEEP_VERSION"] for s in task_specs(project)][::2] == ["1.10", "0x10"]


def test_a_job_files_table_keeps_tomls_types(project):
    (project / "v.toml").write_text('script = "train.py"\n[sweep]\n"args.version" = ["1.10", 1.20]\n'
                                    'batch_size = ["32", 64]\n')
    result = invoke("submit", "--run-dir", "sw", "v.toml")
    assert result.exit_code == 0, result.output
    specs = task_specs(project)
    assert [s["target"]["args"] for s in specs] == [["--version=1.10"]] * 2 + [["--version=1.2"]] * 2
    assert [s["batch_size"] for s in specs] == [32, 64, 32, 64]


def test_each_tasks_label_is_what_it_trains(project):
    """A [train] key the spec also sets (epochs, lr, batch_size) is swept as the spec's own: a job file's
    epochs = 3 no longer wins over the task's value."""
    (project / "e.toml").write_text('epochs = 3\n[train]\ndataset = "fake"\n[sweep]\n"train.epochs" = [1, 2]\n'
                                    '"train.lr" = [0.1]\n')
    result = invoke("submit", "--json", "--run-dir", "sw", "e.toml")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    labels = [t["values"] for t in out["tasks"]]
    assert labels == [{"epochs": 1, "lr": 0.1}, {"epochs": 2, "lr": 0.1}]
    for label, spec in zip(labels, task_specs(project)):
        assert (spec["epochs"], spec["train"]["epochs"], spec["train"]["lr"]) == (label["epochs"], label["epochs"], 0.1)


@pytest.mark.parametrize("args, message", [
    (["--sweep", "lr=0.1,0.2", "--sweep", "lr=0.3", "train.py"], "--sweep lr is given twice: one axis would be lost"),
    (["--sweep", "epochs=1", "--sweep", "train.epochs=2", "job.toml"], "--sweep epochs and --sweep train.epochs"),
    (["--epochs", "3", "--sweep", "train.epochs=1,2", "job.toml"], "--epochs and --sweep epochs both set epochs"),
    (["--lr", "0.5", "--sweep", "train.lr=0.1,0.2", "job.toml"], "--lr and --sweep lr both set lr"),
    (["--sweep", "train.epochs=1,x", "job.toml"], "--sweep train.epochs: 'x' is not a whole number"),
    (["--sweep", "epochs=0x10", "train.py"], "--sweep epochs: '0x10' is not a whole number"),
    (["--sweep", "train.sync_bn=true,maybe", "job.toml"], "--sweep train.sync_bn: 'maybe' is not true or false"),
    (["--sweep", 'args.name="a,b', "train.py"], "a double quote must wrap a whole value"),
    (["--sweep", "args.x=1,1", "train.py"], "'1' is listed twice"),
])
def test_a_dropped_axis_a_lost_setting_or_a_bad_value_is_refused(project, args, message):
    result = invoke("submit", *args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()
