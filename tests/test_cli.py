"""The CLI through click's runner, with a fake `sbatch` on PATH that records what it was given."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.executors import choose_executor
from hpc_ddp.executors.sbatch import SbatchExecutor
from hpc_ddp.procs import Completed, FakeCommands
from hpc_ddp.spec import Layer, Target, build_spec


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project dir with train.py, a fake sbatch on PATH, and an empty profiles file location."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    fake = bin_dir / "sbatch"
    fake.write_text(f"#!/bin/bash\necho \"$PWD $*\" >> {calls}\necho '4711;cluster'\n")
    fake.chmod(0o755)
    # submit's preflight reads the cluster: a fake like the test Slurm, not whatever sinfo finds here.
    sinfo = bin_dir / "sinfo"
    sinfo.write_text("#!/bin/bash\nfor n in hpcn1 hpcn2; do echo \"debug*|up|infinite|$n|idle|4|4000|gpu:2\"; done\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.delenv("HPC_DDP_PROFILE", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_dry_run_four_by_eight_is_valid_bash(project):
    result = invoke("submit", "--dry-run", "--nodes", "4", "--gpus", "8", "train.py")
    assert result.exit_code == 0, result.output
    assert "#SBATCH --nodes=4" in result.output and "#SBATCH --gpus-per-node=8" in result.output
    assert "#SBATCH --ntasks-per-node=8" in result.output
    script = result.output[result.output.index("#!/bin/bash"):]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()


def test_submit_writes_run_dir_and_reports_json(project):
    result = invoke("submit", "--json", "--nodes", "2", "--gpus", "2", "train.py", "--", "--lr", "0.1")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output[result.output.index("{"):])
    assert out["job_id"] == "4711" and out["executor"] == "sbatch"
    run_dir = Path(out["run_dir"])
    assert Path(out["script"]) == run_dir / "job.sbatch" and (run_dir / "spec.json").exists()
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["target"]["args"] == ["--lr", "0.1"] and spec["nodes"] == 2
    # sbatch ran inside the run dir, so the relative log paths land there.
    assert (project / "sbatch-calls").read_text().split() == [str(run_dir), "--parsable", "job.sbatch"]


def test_executor_choice_is_announced(project):
    result = invoke("submit", "--dry-run", "train.py")
    assert "executor sbatch (Slurm's sbatch was found)" in result.output


def test_executor_defaults_to_local_without_slurm():
    assert choose_executor(None, sbatch_found=False) == ("local", "no sbatch on PATH, running on this machine")
    assert choose_executor(None, sbatch_found=True)[0] == "sbatch"
    assert choose_executor("submitit", sbatch_found=False) == ("submitit", "as requested")


def test_module_target_and_args(project):
    result = invoke("submit", "--dry-run", "--json", "-m", "pkg.train", "--", "--epochs", "3")
    assert result.exit_code == 0, result.output
    script = json.loads(result.output[result.output.index("{"):])["script"]
    assert "-m pkg.train --epochs 3" in script


def test_job_file_with_profile(project):
    (project / "profiles.toml").write_text(
        '[uni]\npartition = "gpu"\ngpu_request = "gres"\nsetup = ["module load cuda"]\ntime = "4:00:00"\n')
    (project / "job.toml").write_text('script = "train.py"\nargs = ["--a"]\nnodes = 2\ngpus = 4\nprofile = "uni"\n')
    result = invoke("submit", "--dry-run", "--time", "30", "job.toml", "--", "--b")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "#SBATCH --gres=gpu:4" in text and "#SBATCH --partition=gpu" in text
    assert "#SBATCH --time=0-00:30:00" in text and "module load cuda" in text
    assert "train.py --a --b" in text


def test_render_writes_without_submitting(project):
    result = invoke("render", "--nodes", "2", "--run-dir", "out", "train.py")
    assert result.exit_code == 0, result.output
    assert (project / "out" / "job.sbatch").exists() and not (project / "sbatch-calls").exists()


def test_env_json(project, monkeypatch):
    for key, value in {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                       "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "a[1]",
                       "SLURM_STEP_TASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    out = json.loads(invoke("env", "--json").output)
    assert out["rank"] == 1 and out["hosts"] == ["a1"] and out["source"] == "slurm"


def test_sbatch_refusal_is_a_user_error(project):
    (project / "bin" / "sbatch").write_text("#!/bin/bash\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    result = invoke("submit", "train.py")
    assert result.exit_code == 2
    assert "sbatch refused the job: sbatch: error: invalid partition specified: nope" in result.output


def test_sbatch_executor_with_fake_commands(tmp_path):
    fake = FakeCommands({"sbatch": lambda argv: Completed(tuple(argv), 0, "99\n")})
    spec = build_spec([Layer("f", {})], target=Target("script", "/x/t.py"), workdir=str(tmp_path), python="py")
    executor = SbatchExecutor(fake, generated_at="now", command_line="hpc-ddp submit t.py")
    sub = executor.submit(executor.plan(spec, str(tmp_path / "run")))
    assert sub.job_id == "99" and fake.calls == [(("sbatch", "--parsable", "job.sbatch"), str(tmp_path / "run"))]
    assert (tmp_path / "run" / "job.sbatch").read_text().startswith("#!/bin/bash")


# ---- bad input: each is refused before submission, exit 2, one line, no traceback ----

BAD = [
    (["--nodes", "0"], "--nodes: 0 is below the minimum of 1"),
    (["--nodes", "-1"], "below the minimum"),
    (["--nodes", "x"], "not a whole number"),
    (["--gpus", "-2"], "--gpus: -2 is below the minimum of 0"),
    (["--tasks-per-node", "0"], "--tasks-per-node: 0 is below"),
    (["--gpus", "4", "--tasks-per-node", "3"], "do not fit"),
    (["--cpus-per-task", "0"], "--cpus-per-task: 0 is below"),
    (["--time", "1:2:3:4"], "not a Slurm time"),
    (["--time", "soon"], "not a Slurm time"),
    (["--mem", "1.5G"], "memory size"),
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--job-name", "a\nb"], "control character"),
    (["--job-name", "x#y"], "comment"),
    (["--partition", "p q"], "whitespace"),
    (["--sbatch-arg", "--output=/etc/passwd"], "set by hpc-ddp"),
    (["--sbatch-arg", "--exclusiv"], "did you mean --exclusive"),
    (["--sbatch-arg", "--comment=a\n#SBATCH --uid=0"], "control character"),
    (["--executor", "pbs"], "Invalid value for '--executor'"),
    (["--no-such-flag"], "No such option"),
    (["--lr", "fast"], "not a number"),
    (["--lr", "0"], "--lr: 0.0 must be greater than 0.0"),
    (["--nodes", "1.5"], "--nodes: '1.5' is not a whole number"),
    (["--nodes", ""], "is not a whole number"),
    (["--gpus", "two"], "--gpus: 'two' is not a whole number"),
    (["--cpus-per-task", "x"], "--cpus-per-task: 'x' is not a whole number"),
    (["--time", "-1"], "not a Slurm time"),
    (["--time", "0"], "--time: time '0' is zero"),
    (["--mem", "-4G"], "not a Slurm memory size"),
    (["--signal", "KILL"], "--signal: 'KILL' is not one of"),
    (["--signal-lead", "5"], "--signal-lead: 5 is below the minimum of 10"),
    (["--time", "5", "--signal-lead", "400"], "in its first half"),
    (["--max-requeues", "-1"], "--max-requeues: -1 is below the minimum of 0"),
    (["--epochs", "0"], "--epochs: 0 is below the minimum of 1"),
    (["--batch-size", "0"], "--batch-size: 0 is below the minimum of 1"),
    (["--master-port", "80"], "--master-port: 80 is not a port we can listen on (1024-65535)"),
    (["--master-port", "70000"], "not a port we can listen on"),
    (["--master-port", "port"], "--master-port: 'port' is not a whole number"),
    (["--rendezvous-timeout", "0"], "--rendezvous-timeout: 0 is below the minimum of 5"),
    (["--collective-timeout", "-5"], "--collective-timeout: -5 is below the minimum of 10"),
    (["--account", "a;rm -rf ~"], "--account: contains whitespace"),
    (["--qos", 'q"x'], "--qos: contains '\"', which is a quote"),
    (["--constraint", "a'b"], "which is a quote"),
    (["--run-dir", ""], "--run-dir: '' is not a usable string"),
    (["--gpu-bind", "socket"], "Invalid value for '--gpu-bind'"),
    (["--sbatch-arg", "-N 2"], "--sbatch-arg: '-N 2' is not of the form --option"),
    (["--sbatch-arg", "--dependency=after:1 --uid=0"], "--sbatch-arg: the value contains whitespace"),
    (["--stage", "/nonexistent/ds"], "dataset 'ds': source /nonexistent/ds does not exist on this machine; nothing"),
    (["--stage", "train.py:1bad"], "--stage: dataset name '1bad' must be a letter"),
    # Refused by the preflight against the cluster (the fake sinfo: 2 nodes x 4 CPUs, 4000 MB, 2 GPUs).
    (["--nodes", "3"], "--nodes 3: partition debug has only 2 node(s); nothing was submitted"),
    (["--gpus", "4", "--tasks-per-node", "2"], "no node of partition debug has more than 2 GPUs"),
    (["--mem", "8G"], "nothing was submitted"),
    (["--partition", "gpu"], "partition 'gpu' does not exist"),
    (["--cpus-per-task", "3", "--gpus", "2"], "nothing was submitted"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_exits_2_with_one_line(project, args, message):
    result = invoke("submit", *args, "train.py")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert not (project / "sbatch-calls").exists()


@pytest.mark.parametrize("args,message", [
    (["missing.py"], "script 'missing.py' does not exist"),
    ([], "nothing to run"),
    (["-m", "pkg.train", "--", "x"], None),
    (["bad.toml"], "is not valid TOML"),
    (["unknown.toml"], "unknown key 'gpu'"),
    (["empty.toml"], "names nothing to run"),
    (["absent.toml"], "does not exist"),
    (["-m", "not a module"], "not a Python module name"),
    (["dir.toml"], "cannot read job file"),
    (["binary.toml"], "is not UTF-8 text (byte 10)"),
])
def test_bad_targets(project, args, message):
    (project / "dir.toml").mkdir()
    (project / "binary.toml").write_bytes(b"nodes = 2\n\xff\xfe\n")
    (project / "bad.toml").write_text("nodes = [\n")
    (project / "unknown.toml").write_text('script = "train.py"\ngpu = 2\n')
    (project / "empty.toml").write_text("nodes = 2\n")
    result = invoke("submit", "--dry-run", *args)
    if message is None:
        assert result.exit_code == 0
        return
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_light_commands_do_not_import_torch(project):
    code = ("import sys\nfrom click.testing import CliRunner\nfrom hpc_ddp.cli import cli\n"
            "r = CliRunner()\n"
            "for args in (['--help'], ['env', '--json'], ['submit', '--dry-run', '--nodes', '2', 'train.py'],"
            " ['submit', '--help'], ['list']):\n"
            "    res = r.invoke(cli, args)\n    assert res.exit_code == 0, res.output\n"
            "bad = [m for m in ('torch', 'submitit', 'torchvision') if m in sys.modules]\n"
            "print(','.join(bad) or 'clean')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=project, timeout=60)
    assert done.stdout.strip() == "clean", done.stdout + done.stderr


def test_slurm_down_is_not_a_user_error(project):
    (project / "bin" / "sbatch").write_text(
        "#!/bin/bash\necho 'sbatch: error: Batch job submission failed: Unable to contact slurm controller "
        "(connect failure)' >&2\nexit 1\n")
    result = invoke("submit", "train.py")
    assert result.exit_code == 1 and "sbatch could not reach Slurm" in result.output and "HINT: check `sinfo`" in result.output


def test_submissions_in_the_same_second_get_their_own_run_dirs(project):
    first = invoke("render", "train.py")
    second = invoke("render", "train.py")
    dirs = [line.split("Wrote ")[1].split("/job.sbatch")[0] for line in (first.output, second.output)]
    assert dirs[0] != dirs[1] and Path(dirs[0]).is_dir() and Path(dirs[1]).is_dir()


@pytest.mark.parametrize("args,message", [
    (["trainer.toml", "--nodes", "3"], "after the job file would be ignored"),
    (["--sbatch-arg=--array=0-3", "train.py"], "--array is set by hpc-ddp"),
    (["--executor", "submitit", "--signal", "USR1", "train.py"], "always uses SIGUSR2"),
    (["--profile", "typed", "train.py"], "setup: expected a string or a list of strings"),
])
def test_more_bad_input(project, args, message):
    (project / "trainer.toml").write_text('[train]\ndataset = "fake"\n')
    (project / "profiles.toml").write_text("[typed]\nsetup = 5\n")
    result = invoke("submit", "--dry-run", *args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_job_file_run_dir_is_relative_to_the_file(project):
    (project / "jobs").mkdir()
    (project / "jobs" / "j.toml").write_text('script = "../train.py"\nrun_dir = "../runs/exp1"\n')
    result = invoke("submit", "--dry-run", "--json", "jobs/j.toml")
    assert json.loads(result.output[result.output.index("{"):])["run_dir"] == str(project / "runs" / "exp1")


JOB_FILE_BAD = [
    ('nodes = "two"', "nodes: 'two' is not a whole number"),
    ("nodes = true", "nodes: True is not a whole number"),
    ("time = 5.5", "time: time '5.5' is not a Slurm time"),
    ("gpu_bind = 3", "gpu_bind: 3 is not one of rank, node"),
    ("master_port = 22", "master_port: 22 is not a port we can listen on"),
    ('[train]\nmodel = 5', "train: model: 5 is not a model name"),
    ('[train]\nepochs = -1', "train: epochs: -1 is below the minimum of 1"),
    ('[train]\ndataset = "fake"\noptimiser = "sgd"', "train: unknown key 'optimiser' (did you mean 'optimizer'?)"),
    ('[train]\ndataset = "fake"\nlr = "fast"', "train: lr: 'fast' is not a number"),
    ('args = "--a"', "args must be a list of strings"),
    ('datasets = {"1x" = "/tmp"}', "datasets: dataset name '1x' must be a letter"),
]


@pytest.mark.parametrize("body,message", JOB_FILE_BAD)
def test_bad_job_file_values_name_the_file_and_key(project, body, message):
    text = body if "[train]" in body else 'script = "train.py"\n' + body
    (project / "job.toml").write_text(text + "\n")
    result = invoke("submit", "job.toml")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and f"job file '{project / 'job.toml'}': " in lines[0] and message in lines[0], result.output
    assert "Traceback" not in result.output and not (project / "sbatch-calls").exists()
