"""The CLI through click's runner, with a fake `sbatch` on PATH that records what it was given."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.launch.executors import choose_executor
from hpc_ddp.launch.executors.sbatch import SbatchExecutor
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

HELP = Path(__file__).parent.parent / "spec" / "helptext"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project dir with train.py, a fake sbatch on PATH, and an empty profiles file location."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    fake = bin_dir / "sbatch"
    # `sbatch --help` answers as the test Slurm's does (hpc-ddp reads it to check --sbatch-arg options).
    fake.write_text(f"#!/bin/bash\nif [ \"$1\" = --help ]; then cat {HELP / 'sbatch-22.05.txt'}; exit 0; fi\n"
                    f"echo \"$PWD $*\" >> {calls}\necho '4711;cluster'\n")
    fake.chmod(0o755)
    # submit's preflight reads the cluster: a fake like the test Slurm, not whatever sinfo finds here.
    sinfo = bin_dir / "sinfo"
    sinfo.write_text("#!/bin/bash\nfor n in hpcn1 hpcn2; do echo \"debug*|up|infinite|$n|idle|4|4000|gpu:2\"; done\n")
    sinfo.chmod(0o755)
    (tmp_path / "loop").symlink_to("loop2")  # a symlink loop, for --run-dir loop/run
    (tmp_path / "loop2").symlink_to("loop")
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
    # Nonsense that used to be accepted (issue 11, item 5) and its neighbours.
    (["--lr", "nan"], "--lr: 'nan' is not a finite number"),
    (["--lr", "inf"], "--lr: 'inf' is not a finite number"),
    (["--lr", "-inf"], "is not a finite number"),
    (["--lr", "1e999"], "is not a finite number"),
    (["--nodes", "99999999999999999999999"], "--nodes: 99999999999999999999999 is above the maximum of 100000"),
    (["--gpus", "99999"], "--gpus: 99999 is above the maximum of 4096"),
    (["--tasks-per-node", "99999"], "--tasks-per-node: 99999 is above the maximum"),
    (["--cpus-per-task", "99999"], "--cpus-per-task: 99999 is above the maximum"),
    (["--signal-lead", "99999999999999999999"], "--signal-lead: 99999999999999999999 is above the maximum of 65535"),
    (["--max-requeues", "99999999999"], "--max-requeues: 99999999999 is above the maximum"),
    (["--max-preemptions", "99999999999"], "--max-preemptions: 99999999999 is above the maximum"),
    (["--epochs", "99999999999"], "--epochs: 99999999999 is above the maximum"),
    (["--batch-size", "99999999999"], "--batch-size: 99999999999 is above the maximum"),
    (["--rendezvous-timeout", "99999999999999999999999"], "--rendezvous-timeout: 99999999999999999999999 is above"),
    (["--collective-timeout", "99999999999"], "--collective-timeout: 99999999999 is above the maximum"),
    (["--master-port", "99999999999999999999"], "not a port we can listen on"),
    (["--time", "999999999999-0"], "--time: time '999999999999-0' is more than 365 days"),
    (["--job-name", "a/b"], "--job-name: 'a/b' contains '/'"),
    (["--job-name", "../../x"], "--job-name: '../../x' contains '/'"),
    (["--job-name", "a" * 300], "--job-name: is 300 bytes long; at most 200"),
    # Run dirs that cannot be one (issue 11, item 6): one line, exit 2, before anything is written.
    (["--run-dir", "train.py"], "train.py' is a file"),
    (["--run-dir", "train.py/run"], "is a file, so the run dir"),
    (["--run-dir", "/proc/x"], "run dir '/proc/x' is on a kernel filesystem"),
    (["--run-dir", "/proc/self"], "is on a kernel filesystem"),
    (["--run-dir", "/sys/kernel/x"], "is on a kernel filesystem"),
    (["--run-dir", "/dev/x"], "is on a kernel filesystem"),
    (["--run-dir", "a" * 300], "has a name longer than the filesystem allows"),
    (["--run-dir", "loop/run"], "cannot be resolved"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_exits_2_with_one_line(project, args, message):
    result = invoke("submit", *args, "train.py")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()


@pytest.mark.parametrize("command", [["submit", "--dry-run"], ["render"], ["render", "--stdout"]])
@pytest.mark.parametrize("args,message", [row for row in BAD if row[0][0] in ("--run-dir", "--job-name")])
def test_run_dir_refusals_hold_for_dry_run_and_render(project, command, args, message):
    result = invoke(*command, *args, "train.py")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output and not (project / "runs").exists()
    assert (project / "train.py").is_file()


@pytest.mark.parametrize("args,message", [
    (["missing.py"], "script 'missing.py' does not exist"),
    ([], "nothing to run"),
    (["-m", "pkg.train", "--", "x"], None),
    (["bad.toml"], "is not valid TOML"),
    (["unknown.toml"], "unknown key 'gpu'"),
    (["empty.toml"], "names nothing to run"),
    (["absent.toml"], "does not exist"),
    (["-m", "not a module"], "not a Python module name"),
    (["dir.toml"], "is a directory, not a regular file"),
    (["binary.toml"], "is not UTF-8 text (byte 10)"),
    (["deep.toml"], "nests arrays or tables too deeply to read"),  # was a RecursionError
    (["deep_table.toml"], "nests arrays or tables too deeply to read"),
    (["--profile", "deep", "train.py"], "profiles file"),
    (["huge_int.toml"], "is not valid TOML: Exceeds the limit"),
    # round 5's rerun (issue 53, D6c): a folder Python can run is named with the file it runs
    (["pkgdir"], "'pkgdir' is a folder, not a script HINT: give the file it runs: 'pkgdir/__main__.py'"),
    (["emptydir"], "'emptydir' is a folder, not a script HINT: give the script in it that trains"),
])
def test_bad_targets(project, args, message):
    (project / "pkgdir").mkdir()
    (project / "pkgdir" / "__main__.py").write_text("print('hi')\n")
    (project / "emptydir").mkdir()
    (project / "deep.toml").write_text('script = "train.py"\nargs = ' + "[" * 5000 + "]" * 5000 + "\n")
    (project / "deep_table.toml").write_text("[train]\nx = " + "{a=" * 5000 + "1" + "}" * 5000 + "\n")
    (project / "profiles.toml").write_text("[deep]\nsetup = " + "[" * 5000 + "]" * 5000 + "\n")
    (project / "huge_int.toml").write_text('script = "train.py"\nnodes = ' + "9" * 5000 + "\n")
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
    assert len([ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]) == 1


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
    ("gpu_bind = 3", "gpu_bind: 3 is not one of auto, node, rank"),
    ("master_port = 22", "master_port: 22 is not a port we can listen on"),
    ('[train]\nmodel = 5', "train: model: 5 is not a model name"),
    ('[train]\nepochs = -1', "train: epochs: -1 is below the minimum of 1"),
    ('[train]\ndataset = "fake"\noptimiser = "sgd"', "train: unknown key 'optimiser' (did you mean 'optimizer'?)"),
    ('[train]\ndataset = "fake"\nlr = "fast"', "train: lr: 'fast' is not a number"),
    ('args = "--a"', "args must be a list of strings"),
    ('datasets = {"1x" = "/tmp"}', "datasets: dataset name '1x' must be a letter"),
    # Wrong TOML types for the keys read before the spec (issue 11, item 6): were internal errors.
    ("script = 5", "script: 5 is not a string"),
    ('script = ["train.py"]', "script: ['train.py'] is not a string"),
    ("module = 5", "module: 5 is not a string"),
    ("module = {a = 1}", "module: {'a': 1} is not a string"),
    ("args = [1, {a=1}]", "args must be a list of strings"),
    ('args = [["a"]]', "args must be a list of strings"),
    ('args = ["ok", "a\\u0000b"]', "args: an argument contains a NUL character"),
    ('profile = ["a"]', "profile: ['a'] is not a string"),
    ("profile = 5", "profile: 5 is not a string"),
    ("template = 5", "template: 5 is not a usable string"),
    ("run_dir = 5", "run_dir: 5 is not a usable string"),
    # NaN, infinity and no ceiling (item 5), top level and in [train].
    ("lr = nan", "lr: nan is not a finite number"),
    ('lr = "inf"', "lr: 'inf' is not a finite number"),
    ("nodes = 99999999999999999999", "nodes: 99999999999999999999 is above the maximum of 100000"),
    ("gpus = 1e400", "gpus: inf is not a whole number"),
    ("stage_timeout = 99999999999", "stage_timeout: 99999999999 is above the maximum"),
    ("signal_lead = 70000", "signal_lead: 70000 is above the maximum of 65535"),
    ('time = "400-0"', "time: time '400-0' is more than 365 days"),
    ('job_name = "../../x"', "job_name: '../../x' contains '/'"),
    ('job_name = "a/b"', "job_name: 'a/b' contains '/'"),
    ("[train]\nlr = nan", "train: lr: nan is not a finite number"),
    ("[train]\nlr = inf", "train: lr: inf is not a finite number"),
    ("[train]\nlr = -inf", "train: lr: -inf is not a finite number"),
    ("[train]\nmomentum = nan", "train: momentum: nan is not a finite number"),
    ("[train]\nweight_decay = inf", "train: weight_decay: inf is not a finite number"),
    ("[train]\nclip_grad = nan", "train: clip_grad: nan is not a finite number"),
    ("[train]\ncheckpoint_every_minutes = nan", "train: checkpoint_every_minutes: nan is not a finite number"),
    ("[train]\nstop_lead_seconds = inf", "train: stop_lead_seconds: inf is not a finite number"),
    ("[train]\nlr = 1" + "0" * 400, "train: lr: 100000000000... (401 characters) is too large"),
    ("[train]\nseed = 99999999999999999999", "train: seed: 99999999999999999999 is above the maximum"),
    ("[train]\nimage_size = 1000000", "train: image_size: 1000000 is above the maximum of 4096"),
    # A template that is not a jinja template of ours, setup lines that would add directives (item 2).
    ('template = "/etc/shadow"', "template: '/etc/shadow' is not a jinja2 template"),
    ('setup = ["#SBATCH --array=0-3"]', "setup: '#SBATCH --array=0-3' would add an #SBATCH directive"),
    ('setup = ["echo hi\\n  #SBATCH --array=0-3"]', "would add an #SBATCH directive"),
    ('setup = "\\t#sbatch --uid=0"', "would add an #SBATCH directive"),
]


@pytest.mark.parametrize("body,message", JOB_FILE_BAD)
def test_bad_job_file_values_name_the_file_and_key(project, body, message):
    text = body if "[train]" in body or body.startswith(("script", "module")) else 'script = "train.py"\n' + body
    (project / "job.toml").write_text(text + "\n")
    result = invoke("submit", "job.toml")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and f"job file '{project / 'job.toml'}': " in lines[0] and message in lines[0], result.output
    assert "Traceback" not in result.output and not (project / "sbatch-calls").exists()


# ---- job files and profiles that would run code or add directives (issue 11, item 2) ----

ESCAPE = "{{ cycler.__init__.__globals__.os.system('touch PWNED') }}\n"
TEMPLATE_CASES = [
    ("job", 'template = "evil.j2"', "template 'evil.j2' was stopped by the sandbox"),
    ("profile", 'template = "evil.j2"', "template 'evil.j2' was stopped by the sandbox"),
    ("job", 'template = "lipsum.j2"', "was stopped by the sandbox"),
    ("job", 'template = "/etc/shadow"', "template: '/etc/shadow' is not a jinja2 template"),
    ("profile", 'template = "/etc/passwd"', "template: '/etc/passwd' is not a jinja2 template"),
    ("job", 'template = "plain.j2"', "template 'plain.j2' misses '#SBATCH --job-name=train'"),
    ("job", 'template = "norunner.j2"', "does not run the per-rank runner"),
    ("job", 'template = "array.j2"', "writes '#SBATCH --array=0-3', which hpc-ddp did not ask for"),
    ("job", 'template = "fifo.j2"', "is not a regular file"),
    ("job", 'setup = ["#SBATCH --array=0-3"]', "setup: '#SBATCH --array=0-3' would add an #SBATCH directive"),
    ("profile", 'setup = ["#SBATCH --array=0-3"]', "would add an #SBATCH directive"),
    ("profile", 'setup = ["  #SBATCH --array=0-3"]', "would add an #SBATCH directive"),
    ("profile", 'setup = ["module load x\\n#SBATCH --array=0-3"]', "would add an #SBATCH directive"),
    ("profile", 'setup = ["#SBATCH --uid=0"]', "would add an #SBATCH directive"),
]


@pytest.mark.parametrize("command", [["render", "--stdout"], ["submit", "--dry-run"], ["submit"], ["render"]])
@pytest.mark.parametrize("where,line,message", TEMPLATE_CASES)
def test_templates_and_setup_cannot_run_code_or_add_directives(project, command, where, line, message):
    (project / "evil.j2").write_text(ESCAPE)
    (project / "lipsum.j2").write_text("{{ lipsum.__globals__['os'].system('touch PWNED') }}\n")
    (project / "plain.j2").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (project / "norunner.j2").write_text("#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}"
                                         "python -m hpc_ddp.job.attempts begin x 0\nsrun hostname\n")
    (project / "array.j2").write_text("#!/bin/bash\n#SBATCH --array=0-3\n{% for d in directives %}#SBATCH {{ d }}\n"
                                      "{% endfor %}")
    os.mkfifo(project / "fifo.j2")
    if where == "job":
        (project / "job.toml").write_text(f'script = "train.py"\n{line}\n')
    else:
        (project / "profiles.toml").write_text(f"[site]\n{line}\n")
        (project / "job.toml").write_text('script = "train.py"\nprofile = "site"\n')
    result = invoke(*command, "job.toml")
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output and "#!/bin/bash" not in result.output and "root:" not in result.output
    assert not (project / "PWNED").exists() and not (project / "runs").exists()
    assert not (project / "sbatch-calls").exists()


def test_a_site_template_that_keeps_the_job_works(project):
    text = (Path(__file__).resolve().parents[2] / "templates" / "sbatch.sh.j2").read_text()
    (project / "site.j2").write_text("{# our site #}\n" + text.replace("set -uo pipefail", "set -uo pipefail\nulimit -c 0"))
    (project / "profiles.toml").write_text('[site]\ntemplate = "site.j2"\nsetup = ["# sbatch reads no setup"]\n')
    result = invoke("render", "--stdout", "--profile", "site", "train.py")
    assert result.exit_code == 0, result.output
    assert "ulimit -c 0" in result.output and "hpc_ddp.job.runner" in result.output


# ---- commands taking a RUN_DIR (issue 11, items 5 and 6) ----

RUN_DIR_COMMANDS = [["status"], ["logs"], ["cancel"], ["preempt"], ["status", "--json"], ["logs", "-f"]]


@pytest.mark.parametrize("command", RUN_DIR_COMMANDS)
@pytest.mark.parametrize("ref,message", [
    ("/etc", "'/etc' is not a run dir (it has no spec.json)"),
    ("/proc/self", "is not a run dir"),
    ("/", "'/' is not a run dir"),
    ("empty", "empty' is not a run dir"),
    ("fake_spec", "fake_spec' is not a run dir"),  # spec.json there, but a directory
])
def test_run_dir_commands_refuse_what_is_not_a_run_dir(project, command, ref, message):
    (project / "empty").mkdir()
    (project / "fake_spec" / "spec.json").mkdir(parents=True)
    result = invoke(*command, ref)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output and "UNKNOWN" not in result.output
    assert sorted(p.name for p in (project / "empty").iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["status", "train.py"], "no run dir or known job 'train.py'"),
    (["logs", "424242"], "no run dir or known job '424242'"),
    (["cancel", "/nonexistent/run"], "no run dir or known job"),
    (["preempt", "/etc/passwd"], "no run dir or known job"),
    (["status", "gone"], "the run dir of 'gone'"),
    (["cancel", "gone"], "no longer exists"),
    (["plot", "train.py"], "is a file"),
    (["plot", "/etc"], "/etc/metrics.jsonl has no training records yet"),
    (["plot", "empty"], "has no training records yet"),
    (["plot", "-o", "/proc/x.png", "run"], "-o '/proc/x.png': '/proc' is not a directory you can write to"),
    (["plot", "-o", "train.py/x.png", "run"], "is not a directory you can write to"),
    (["plot", "-o", "run", "run"], "-o 'run': is a directory"),
    (["inspect", "/etc"], "'/etc' is not a checkpoint, a checkpoints dir or a run dir"),
    (["inspect", "/etc/passwd"], "is not a checkpoint"),
    (["inspect", "/proc/self"], "is not a checkpoint"),
    (["inspect", "empty"], "is not a checkpoint"),
    (["inspect", "/nonexistent"], "does not exist"),
    (["make-dataset", "mnist", "ds", "--seed", "-1"], "Invalid value for '--seed': -1 is not in the range"),
    (["make-dataset", "mnist", "ds", "--seed", str(2**32)], "Invalid value for '--seed'"),
    (["make-dataset", "mnist", "ds", "--train", "0"], "Invalid value for '--train'"),
    (["make-dataset", "cifar10", "ds", "--test", "-5"], "Invalid value for '--test'"),
    (["make-dataset", "imagefolder", "ds", "--train", "99999999999999"], "Invalid value for '--train'"),
    (["train", "--run-dir", "/proc/x", "trainer.toml"], "run dir '/proc/x' is on a kernel filesystem"),
    (["train", "--run-dir", "train.py", "trainer.toml"], "train.py' is a file"),
    (["train", "--run-dir", "a" * 300, "trainer.toml"], "has a name longer than the filesystem allows"),
    (["train", "nan.toml"], "train: lr: nan is not a finite number"),
])
def test_other_commands_bad_input(project, monkeypatch, args, message):
    from hpc_ddp.watch.registry import register

    register({"job_id": "gone", "executor": "sbatch", "run_dir": str(project / "gone-run"), "name": "x"})
    (project / "empty").mkdir()
    (project / "run").mkdir()
    (project / "run" / "spec.json").write_text("{}")
    (project / "trainer.toml").write_text('[train]\ndataset = "fake"\n')
    (project / "nan.toml").write_text('[train]\ndataset = "fake"\nlr = nan\n')
    before = sorted(p.name for p in project.iterdir())
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(lines) == 1 and message in lines[0], result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert sorted(p.name for p in project.iterdir()) == before  # nothing created (no ds/, no runs/)


# ---- --chain and --after (issue 14) ----

def test_submit_chain_reports_every_job(project):
    fake = project / "bin" / "sbatch"
    fake.write_text(f"#!/bin/bash\necho \"$*\" >> {project / 'sbatch-calls'}\n"
                    "n=$(wc -l < " + str(project / "sbatch-calls") + "); echo $((4710 + n))\n")
    result = invoke("submit", "--chain", "3", "train.py")
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[-1]
    assert line.startswith("Submitted jobs 4711, 4712, 4713 (sbatch; a chain: each starts when the one before ends")
    assert (project / "sbatch-calls").read_text().splitlines() == [
        "--parsable job.sbatch", "--parsable --dependency=afterany:4711 job.sbatch",
        "--parsable --dependency=afterany:4712 job.sbatch"]
    result = invoke("submit", "--json", "--chain", "2", "train.py")
    out = json.loads(result.output[result.output.index("{"):])
    assert out["job_id"] == "4714" and out["job_ids"] == ["4714", "4715"]


@pytest.mark.parametrize("args,message", [
    (["--chain", "0"], "hpc-ddp: error: --chain: 0 is below the minimum of 1"),
    (["--after", "999999"], "hpc-ddp: error: --after 999999: Slurm knows no job 999999"),
    (["--after", "12:ok"], "hpc-ddp: error: --after 12: job 12 ended FAILED, so a job waiting for its success"),
    (["--after", "nodir:any"], "hpc-ddp: error: --after: 'nodir' is neither a Slurm job id nor a run dir"),
    (["--after", "5", "--no-preflight"], "hpc-ddp: error: --after 5: Slurm knows no job 5"),  # checked anyway
    (["--executor", "local", "--chain", "2"], "hpc-ddp: error: --chain 2: only the sbatch executor queues"),
])
def test_bad_chains_and_dependencies_submit_nothing(project, args, message):
    scontrol = project / "bin" / "scontrol"
    scontrol.write_text('#!/bin/bash\n[ "$3" = 12 ] && { printf "JobId=12 JobName=x\\n   JobState=FAILED\\n"; exit 0; }\n'
                        'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n')
    scontrol.chmod(0o755)
    sacct = project / "bin" / "sacct"  # accounting knows none of them either (not the real test Slurm's)
    sacct.write_text("#!/bin/bash\nexit 0\n")
    sacct.chmod(0o755)
    result = invoke("submit", *args, "train.py")
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(errors) == 1 and errors[0].startswith(message), result.output
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()


def test_after_a_run_dir_waits_for_its_last_job(project):
    output = invoke("submit", "--json", "--run-dir", "first", "train.py").output
    first = json.loads(output[output.index("{"):])
    scontrol = project / "bin" / "scontrol"
    scontrol.write_text('#!/bin/bash\nprintf "JobId=$3 JobName=x\\n   JobState=RUNNING\\n"\n')
    scontrol.chmod(0o755)
    result = invoke("submit", "--dry-run", "--after", "first:any", "train.py")
    assert result.exit_code == 0, result.output
    assert f"#SBATCH --dependency=afterany:{first['job_id']}\n" in result.output


LOCAL_RANK_SCRIPT = "import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"


@pytest.mark.parametrize("args", [["--gpu-bind", "rank"], ["--sbatch-arg=--gpus-per-task=1"]])
def test_submit_refuses_a_local_rank_script_where_each_rank_sees_one_gpu(project, args):
    """Issue 28: refused before it queues (the dry run too), one line naming the fix; nothing written."""
    (project / "train.py").write_text(LOCAL_RANK_SCRIPT)
    for dry in (["--dry-run"], []):
        result = CliRunner().invoke(cli, ["submit", *dry, "--run-dir", "r", "--nodes", "2", "--gpus", "2", *args,
                                          "train.py"])
        assert result.exit_code == 2, result.output
        last = result.output.strip().splitlines()[-1]
        assert last.startswith("hpc-ddp: error: train.py:2 picks its GPU by local rank") and "HINT:" in last
        assert "local rank 1 would find no cuda:1; nothing was submitted" in last
    assert not (project / "r").exists() and not (project / "sbatch-calls").exists()


def test_submit_with_the_default_binding_takes_the_local_rank_script_and_warns_on_a_fixed_gpu(project):
    (project / "train.py").write_text(LOCAL_RANK_SCRIPT)
    result = invoke("submit", "--dry-run", "--nodes", "2", "--gpus", "2", "train.py")
    assert result.exit_code == 0 and "warning" not in result.output
    (project / "train.py").write_text("import torch\nx = torch.zeros(1).to('cuda:0')\n")
    result = invoke("submit", "--dry-run", "--nodes", "2", "--gpus", "2", "train.py")
    assert result.exit_code == 0
    assert "hpc-ddp: warning: train.py:2 uses a fixed GPU (x = torch.zeros(1).to('cuda:0'))" in result.output
    result = invoke("submit", "--dry-run", "--nodes", "2", "--gpus", "2", "--gpu-bind", "rank", "train.py")
    assert result.exit_code == 0 and "warning: train.py" not in result.output


def test_doctor_names_the_device_problem(project):
    (project / "train.py").write_text(LOCAL_RANK_SCRIPT)
    result = CliRunner().invoke(cli, ["doctor", "--nodes", "2", "--gpus", "2", "--gpu-bind", "rank", "train.py"])
    assert result.exit_code == 2
    assert "error: train.py:2 picks its GPU by local rank" in result.output


@pytest.mark.parametrize("source,says", [
    ("import pytorch_lightning as pl\ntrainer.fit(model)\n", 'warning: train.py uses Lightning'),
    ("import lightning as L\ntrainer.fit(model, ckpt_path='last')\n", None),
    ("from transformers import Trainer, TrainingArguments\ntrainer.train()\n", "warning: train.py uses the Hugging Face Trainer"),
    ("from transformers import Trainer\ntrainer.train(resume_from_checkpoint=last)\n", None),
    ("from accelerate import Accelerator\n", "warning: train.py uses accelerate"),
])
def test_submit_says_what_a_framework_script_needs_to_resume(project, source, says):
    """Issue 27: one line at submit when a framework's script would start over after a preemption."""
    (project / "train.py").write_text(source)
    result = invoke("submit", "--dry-run", "--nodes", "2", "train.py")
    assert result.exit_code == 0
    lines = [line for line in result.output.splitlines() if "train.py uses" in line]
    if says is None:
        assert lines == []
    else:
        [line] = lines
        assert says in line and "HINT:" in line


def test_the_docs_show_the_lines_submit_really_prints(project):
    """docs/gpus.md's example of the GPU-binding refusal and docs/frameworks.md's Lightning note, as submit
    prints them."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    readme = (docs / "gpus.md").read_text() + (docs / "frameworks.md").read_text()
    (project / "train.py").write_text("import os, torch\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
                                      "torch.cuda.set_device(local_rank)\n")
    result = CliRunner().invoke(cli, ["submit", "--nodes", "2", "--gpus", "2", "--gpu-bind", "rank", "train.py"])
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1] in readme
    (project / "fit.py").write_text("import pytorch_lightning as pl\ntrainer.fit(model)\n")
    result = invoke("submit", "--dry-run", "--nodes", "2", "fit.py")
    [line] = [x for x in result.output.splitlines() if "fit.py uses Lightning" in x]
    assert line in readme
