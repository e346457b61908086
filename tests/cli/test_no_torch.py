"""The laptop's side of hpc-ddp needs no torch (issue 42, item 9): installed with --no-deps plus click and
jinja2 (docs/install.md), `--help`, `submit --ssh ... --dry-run`, `status`, `list` and `logs` work with torch,
torchvision, numpy, submitit, cloudpickle and matplotlib unimportable, as on such a laptop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

BLOCKED = ("torch", "torchvision", "numpy", "submitit", "cloudpickle", "matplotlib")
SITECUSTOMIZE = f"""\
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not installed on this laptop)", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.fixture
def laptop(tmp_path):
    """A home with a project, a Python that cannot import what the laptop does not install, and an ssh
    that says the host cannot be reached (nothing here needs a cluster)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    home = tmp_path / "home"
    project = home / "proj"
    project.mkdir(parents=True)
    (project / "train.py").write_text("import torch\nprint(torch.__version__)\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/sh\necho 'ssh: Could not resolve hostname login.example: Name or service "
                                 "not known' >&2\nexit 255\n")
    (bin_dir / "ssh").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(site), "HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin",
           "HPC_DDP_PROFILES": str(tmp_path / "profiles.toml"), "HPC_DDP_REGISTRY": str(tmp_path / "runs.jsonl"),
           "HPC_DDP_SSH_CONTROL_DIR": tempfile.mkdtemp(prefix="hd-", dir="/tmp")}  # a socket's path is short
    for name in ("SLURM_CONF", "VIRTUAL_ENV", "HPC_DDP_SSH_CONFIG"):
        env.pop(name, None)
    yield project, env
    shutil.rmtree(env["HPC_DDP_SSH_CONTROL_DIR"], ignore_errors=True)


def _run(laptop, *args: str) -> subprocess.CompletedProcess:
    project, env = laptop
    return subprocess.run([sys.executable, "-m", "hpc_ddp", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=120)


def test_torch_is_really_blocked(laptop):
    project, env = laptop
    done = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "not installed on this laptop" in done.stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["submit", "--help"], ["status", "--help"],
                                  ["list"], ["doctor", "--help"], ["logs", "--help"], ["timeline", "--help"]])
def test_the_light_commands_run_without_torch(laptop, args):
    done = _run(laptop, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not installed on this laptop" not in done.stdout + done.stderr


@pytest.mark.parametrize("dry", [["--dry-run"], []])
def test_submit_over_ssh_gets_to_the_connection_without_torch(laptop, dry):
    """Listing and hashing the project, the profile, the checks: all of it before ssh, none of it torch's."""
    done = _run(laptop, "submit", "--ssh", "login.example", *dry, "--nodes", "2", "--gpus", "4", "train.py")
    said = done.stdout + done.stderr
    assert done.returncode == 2, said
    assert "not installed on this laptop" not in said and "internal error" not in said, said
    assert "Could not resolve hostname" in said or "cannot resolve the host login.example" in said, said


def test_status_and_logs_of_a_run_dir_without_torch(laptop, tmp_path):
    done = _run(laptop, "status", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "not installed on this laptop" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["inspect", "runs/x"], ["export", "runs/x", "--to", "model.pt"],
                                     ["submit", "--executor", "submitit", "train.py"]])
def test_a_command_that_needs_torch_says_so_in_one_line_not_an_internal_error(laptop, command):
    """Issue 53: on the laptop install, inspect, export and the submitit executor gave `internal error:
    ModuleNotFoundError`."""
    project, _ = laptop
    run = project / "runs" / "x"
    (run / "checkpoints").mkdir(parents=True)
    (run / "spec.json").write_text("{}")
    done = _run(laptop, *command)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "internal error" not in line and f"`hpc-ddp {command[0]}` needs it" in line and "HINT:" in line, line
    assert line.split(" is not installed here")[0].rsplit(" ", 1)[-1] in ("torch", "submitit", "numpy", "cloudpickle")
