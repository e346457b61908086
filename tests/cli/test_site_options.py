"""Site settings through the CLI: options the cluster's sbatch and srun know (their --help, plugins included).
Bad values are one line, exit 2, nothing submitted."""

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.slurm import helptext

HELP = Path(__file__).parent.parent / "spec" / "helptext"
PLUGINS = """
Options provided by plugins:
      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH
                              [pyxis] the image to use for the container
      --image=image           shifter image to use
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A project with train.py and fake Slurm commands whose --help is the test Slurm's plus two plugins;
    sbatch records its other calls (there must be none when a job is refused)."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):
        (tmp_path / f"{tool}-help.txt").write_text((HELP / f"{tool}-22.05.txt").read_text() + PLUGINS)
        fake = bin_dir / tool
        fake.write_text(f"#!/bin/bash\nif [ \"$1\" = --help ]; then cat {tmp_path}/{tool}-help.txt; exit 0; fi\n"
                        f"echo \"$PWD $*\" >> {tmp_path}/calls\necho '4711;cluster'\n")
        fake.chmod(0o755)
    sinfo = bin_dir / "sinfo"
    sinfo.write_text("#!/bin/bash\nfor n in hpcn1 hpcn2; do echo \"debug*|up|infinite|$n|idle|4|4000|gpu:2\"; done\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.delenv("HPC_DDP_PROFILE", raising=False)
    monkeypatch.setattr(helptext, "_CACHE", {})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def refused(project: Path, *args: str) -> str:
    result = invoke("submit", *args, "train.py")
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert not (project / "calls").exists() and not (project / "runs").exists()
    return errors[0]


def test_a_plugin_option_the_cluster_knows_becomes_a_directive(site):
    result = invoke("submit", "--dry-run", "--sbatch-arg=--image=docker:nersc/pytorch:ngc-23.07", "train.py")
    assert result.exit_code == 0, result.output
    assert "#SBATCH --image=docker:nersc/pytorch:ngc-23.07" in result.output
    script = result.output[result.output.index("#!/bin/bash"):]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_an_option_the_cluster_does_not_know_is_refused(site):
    (site / "sbatch-help.txt").write_text((HELP / "sbatch-22.05.txt").read_text())  # no plugins here
    line = refused(site, "--sbatch-arg=--image=docker:x")
    assert "--sbatch-arg: --image is not an sbatch option (`sbatch --help` here lists no --image)" in line


def test_a_typo_is_refused_with_the_option_meant(site):
    assert "did you mean --container-image?" in refused(site, "--sbatch-arg=--container-imag=x")


def test_without_sbatch_an_unlisted_option_is_let_through_with_a_warning(site, monkeypatch):
    for tool in ("sbatch", "srun", "sinfo"):
        (site / "bin" / tool).unlink()
    monkeypatch.setenv("PATH", str(site / "bin"))  # not /usr/bin: CI installs the test Slurm's sbatch there
    result = invoke("submit", "--dry-run", "--sbatch-arg=--image=x", "--sbatch-arg=--exclusive", "train.py")
    assert result.exit_code == 0, result.output
    assert ("warning: --sbatch-arg --image=x: not checked, there is no sbatch on PATH here to ask which options "
            "this cluster (and its plugins) accepts") in result.output
    assert "--exclusive:" not in result.output


def test_a_profile_may_give_a_plugin_option(site):
    (site / "profiles.toml").write_text('[nersc]\nsbatch_args = ["--image=docker:nersc/pytorch:ngc-23.07"]\n')
    result = invoke("submit", "--dry-run", "--profile", "nersc", "train.py")
    assert result.exit_code == 0 and "#SBATCH --image=docker:nersc/pytorch:ngc-23.07" in result.output


# ---- srun options ----

def test_srun_options_go_onto_the_ranks_srun_line(site):
    result = invoke("submit", "--dry-run", "--srun-arg=--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
                    "--srun-arg=--mpi=pmix", "train.py")
    assert result.exit_code == 0, result.output
    line = next(ln.lstrip() for ln in result.output.splitlines() if ln.lstrip().startswith("srun --kill-on-bad-exit"))
    assert "'--container-image=nvcr.io#nvidia/pytorch:24.01-py3' --mpi=pmix " in line


@pytest.mark.parametrize("value,message", [
    ("--mpi=pmix\n#SBATCH --uid=0", "--srun-arg: --mpi: the value contains a control character"),
    ("--mpi=pmix;reboot", "--srun-arg: --mpi: the value contains ';'"),
    ("--mpi=pmix && reboot", "--srun-arg: --mpi: the value contains whitespace"),
    ("--mpii=pmix", "--srun-arg: --mpii is not an srun option (did you mean --mpi?)"),
    ("--ntasks=3", "--srun-arg: --ntasks is set by hpc-ddp; use --nodes and --tasks-per-node instead"),
    ("-l", "is not of the form --option"),
])
def test_bad_srun_options_are_one_line_and_nothing_is_submitted(site, value, message):
    assert message in refused(site, f"--srun-arg={value}")


def test_a_bad_srun_option_in_a_profile_names_the_profile(site):
    (site / "profiles.toml").write_text('[p]\nsrun_args = ["--mpi=pmix;x"]\n')
    assert "profile 'p': srun_args: --mpi: the value contains ';'" in refused(site, "--profile", "p")


# ---- the site environment ----

def test_env_from_the_profile_and_the_command_line_is_exported(site):
    (site / "profiles.toml").write_text('[p]\nenv = { NCCL_SOCKET_IFNAME = "ib0", HF_HOME = "$SLURM_TMPDIR/hf" }\n')
    result = invoke("submit", "--dry-run", "--profile", "p", "--env", "NCCL_SOCKET_IFNAME=eth0", "train.py")
    assert result.exit_code == 0, result.output
    assert 'export NCCL_SOCKET_IFNAME="eth0"\nexport HF_HOME="${SLURM_TMPDIR-}/hf"\n' in result.output


@pytest.mark.parametrize("value,message", [
    ("BAD-KEY=x", "--env: 'BAD-KEY' is not a variable name"),
    ("X;reboot=1", "--env: 'X;reboot' is not a variable name"),
    ("RANK=0", "--env: RANK cannot be set through env: hpc-ddp sets it on every rank"),
    ("MASTER_ADDR=localhost", "--env: MASTER_ADDR cannot be set through env"),
    ("JUSTANAME", "--env: 'JUSTANAME' is not NAME=VALUE"),
    ("X=a\nb", "--env: X: the value contains a control character"),
])
def test_bad_env_entries_are_one_line_and_nothing_is_submitted(site, value, message):
    assert message in refused(site, "--env", value)


def test_a_bad_env_key_in_a_job_file_names_the_file(site):
    (site / "job.toml").write_text('script = "train.py"\n[env]\n"NOT VALID" = "x"\n')
    result = invoke("submit", "job.toml")
    assert result.exit_code == 2 and "job.toml': env: 'NOT VALID' is not a variable name" in result.output
    assert not (site / "calls").exists()


# ---- containers ----

def test_a_container_job_renders_with_its_runtime(site):
    result = invoke("submit", "--dry-run", "--container", "pyxis:nvcr.io#nvidia/pytorch:24.01-py3", "train.py")
    assert result.exit_code == 0, result.output
    assert "'--container-image=nvcr.io#nvidia/pytorch:24.01-py3'" in result.output
    assert "-m hpc_ddp.job.containersrc" in result.output


@pytest.mark.parametrize("args,message", [
    (["--container", "apptainer:/usr/share/no-such-image.sif"],
     "--container: container image /usr/share/no-such-image.sif does not exist (/usr/share has no"),
    (["--container", "docker:pytorch/pytorch"], "--container: unknown container runtime 'docker'"),
    (["--container", "apptainer"], "--container: 'apptainer' is not RUNTIME:IMAGE"),
    (["--container", "pyxis:x", "--executor", "submitit"], "the submitit executor runs each rank in its own"),
])
def test_bad_containers_are_one_line_and_nothing_is_submitted(site, args, message):
    assert message in refused(site, *args)


def test_a_bad_container_in_a_profile_names_the_profile(site):
    (site / "profiles.toml").write_text('[p]\ncontainer = { runtime = "singularty", image = "/x.sif" }\n')
    assert "profile 'p': container: unknown container runtime 'singularty' (did you mean singularity?" in \
        refused(site, "--profile", "p")


def test_the_local_executor_refuses_a_runtime_this_machine_lacks(site, monkeypatch):
    monkeypatch.setenv("PATH", f"{site / 'bin'}")  # no ch-run here
    (site / "img" / "tmp").mkdir(parents=True)
    result = invoke("submit", "--executor", "local", "--container", f"charliecloud:{site / 'img'}", "train.py")
    assert result.exit_code == 2, result.output
    assert "--container charliecloud: no ch-run on PATH here, and the local executor runs the ranks on this " \
           "machine" in result.output and not (site / "runs").exists()


def test_doctor_says_whether_the_runtime_is_here(site):
    result = invoke("doctor", "--container", "apptainer:docker://pytorch/pytorch", "train.py")
    assert "warning: container runtime apptainer: no apptainer on PATH here (login nodes often lack it)" in \
        result.output
