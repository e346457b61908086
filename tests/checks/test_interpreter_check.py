"""The ranks' Python is checked before anything queues: its findings from canned probes, real probes of
a Python that has hpc_ddp and one that has not, and `submit` refusing a job whose ranks could not start."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp import __version__
from hpc_ddp.checks.interpreter_check import Probe, probe, python_findings
from hpc_ddp.checks.preflight import Host, run_preflight
from hpc_ddp.cli import cli
from hpc_ddp.spec.interpreter import NAMED
from hpc_ddp.spec.jobspec import Layer, Target, build_spec


def spec(tmp_path, python, **values):
    return build_spec([Layer("test", values)], target=Target("script", str(tmp_path / "t.py")),
                      workdir=str(tmp_path), python=python)


def canned(result: Probe):
    calls = []

    def fake(python, cwd, environ):
        calls.append((python, cwd))
        return result
    return fake, calls


def one(findings):
    assert len(findings) == 1, findings
    return findings[0]


def test_a_python_that_imports_hpc_ddp_is_ok(tmp_path):
    fake, calls = canned(Probe(version=__version__))
    found = one(python_findings(spec(tmp_path, sys.executable), {}, "/other/python", fake))
    assert (found.level, found.message) == ("ok", f"python {sys.executable} ({NAMED}) imports hpc_ddp {__version__}")
    assert calls == [(sys.executable, str(tmp_path))]  # from the job's working directory, as the batch script


def test_a_python_without_hpc_ddp_is_an_error_naming_the_fix(tmp_path):
    fake, _ = canned(Probe(problem="ModuleNotFoundError: No module named 'hpc_ddp'", missing=True))
    env = {"VIRTUAL_ENV": str(tmp_path / "venv")}
    python = str(tmp_path / "venv" / "bin" / "python")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, python)
    found = one(python_findings(spec(tmp_path, python), env, sys.executable, fake))
    assert found.level == "error"
    assert found.message == f"python {python} (the active venv, $VIRTUAL_ENV) cannot import hpc_ddp, which every " \
                            "rank runs"
    assert found.hint == (f"install hpc-ddp into that environment ({python} -m pip install PATH, PATH a clone of "
                          "hpc-ddp or the wheel its make dist builds), or give --python")


@pytest.mark.parametrize("result,level,says", [
    (Probe(problem="SyntaxError: invalid syntax"), "error", "cannot run hpc-ddp: SyntaxError: invalid syntax"),
    (Probe(timed_out=True, problem="did not answer within 20 s"), "warning", "did not answer within 20 s"),
    (Probe(version="0.0.1"), "warning", f"has hpc-ddp 0.0.1, this command is {__version__}"),
])
def test_other_answers(tmp_path, result, level, says):
    found = one(python_findings(spec(tmp_path, sys.executable), {}, sys.executable, canned(result)[0]))
    assert found.level == level and says in found.message


def test_missing_and_unrunnable_pythons_are_refused_without_running_them(tmp_path):
    fake, calls = canned(Probe(version=__version__))
    (tmp_path / "notexec").write_text("#!/bin/sh\n")
    for python, says in [(str(tmp_path / "nope" / "python"), "does not exist"),
                         (str(tmp_path), "is not an executable file"),
                         (str(tmp_path / "notexec"), "is not an executable file"),
                         ("python-that-is-nowhere", "is not on PATH"),
                         ("/usr/bin/python3\n#SBATCH --uid=0", "'/usr/bin/python3\\n#SBATCH --uid=0' (named by")]:
        found = one(python_findings(spec(tmp_path, python), {"PATH": "/nonexistent"}, sys.executable, fake))
        assert found.level == "error" and says in found.message, (python, found)
    assert calls == []


def test_a_relative_python_is_relative_to_the_working_directory(tmp_path):
    fake, calls = canned(Probe(version=__version__))
    (tmp_path / "env" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "env" / "bin" / "python")
    assert one(python_findings(spec(tmp_path, "env/bin/python"), {}, sys.executable, fake)).level == "ok"
    assert calls == [("env/bin/python", str(tmp_path))]


def test_a_bare_name_after_setup_lines_is_left_to_the_nodes(tmp_path):
    fake, calls = canned(Probe(version=__version__))
    found = one(python_findings(spec(tmp_path, "python3", setup=["module load python/3.12"]), {}, "/x", fake))
    assert found.level == "ok" and "after the setup lines" in found.message and calls == []


def test_a_container_job_is_not_probed(tmp_path):
    fake, calls = canned(Probe(missing=True, problem="x"))

    class InContainer:
        python, workdir, setup, container = "python3", str(tmp_path), (), "img.sif"

    assert one(python_findings(InContainer(), {}, "/x", fake)).level == "ok" and calls == []


# ---- real probes ----

def test_probing_this_python_finds_this_hpc_ddp(tmp_path):
    assert probe(sys.executable, str(tmp_path), os.environ) == Probe(version=__version__)


def test_probing_a_python_without_hpc_ddp_says_so(tmp_path):
    bare = tmp_path / "bare-python"  # the base interpreter, isolated: no venv, no PYTHONPATH
    bare.write_text(f"#!/bin/sh\nexec {Path(sys.base_prefix) / 'bin' / 'python3'} -I \"$@\"\n")
    bare.chmod(0o755)
    result = probe(str(bare), str(tmp_path), os.environ)
    assert result.missing and result.problem == "ModuleNotFoundError: No module named 'hpc_ddp'"


def test_a_hung_python_is_a_warning_not_a_wait(tmp_path):
    hung = tmp_path / "hung"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    assert probe(str(hung), str(tmp_path), os.environ, timeout=0.5).timed_out


def test_preflight_asks_only_where_the_host_can_probe(tmp_path):
    from hpc_ddp.common.procs import FakeCommands

    bad = spec(tmp_path, str(tmp_path / "nope"))
    assert run_preflight(bad, FakeCommands(installed=()), Host({})).errors == ()  # a fake host: not asked
    errors = run_preflight(bad, FakeCommands(installed=()), Host({}, (), canned(Probe())[0])).errors
    assert [e.message for e in errors] == [f"python {tmp_path / 'nope'} ({NAMED}) does not exist"]


# ---- through the CLI ----

@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"sbatch": f"echo \"$*\" >> {tmp_path / 'sbatch-calls'}; echo 4711",
                       "sinfo": "echo 'debug*|up|infinite|n1|idle|4|4000|(null)'"}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{text}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX", "HPC_DDP_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_dry_run_says_which_python_and_why(project, monkeypatch):
    venv = project / "venv"
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    result = CliRunner().invoke(cli, ["submit", "--dry-run", "train.py"])
    assert result.exit_code == 0, result.output
    assert f"hpc-ddp: python {venv}/bin/python (the active venv, $VIRTUAL_ENV)\n" in result.output
    assert f"{venv}/bin/python -m hpc_ddp.job.runner" in result.output
    result = CliRunner().invoke(cli, ["submit", "--dry-run", "--python", sys.executable, "train.py"])
    assert f"hpc-ddp: python {sys.executable} ({NAMED})\n" in result.output


def test_submit_refuses_a_python_that_cannot_import_hpc_ddp(project, monkeypatch):
    venv = project / "venv"
    (venv / "bin").mkdir(parents=True)
    bare = venv / "bin" / "python"
    bare.write_text(f"#!/bin/sh\nexec {Path(sys.base_prefix) / 'bin' / 'python3'} -I \"$@\"\n")
    bare.chmod(0o755)
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    result = CliRunner().invoke(cli, ["submit", "train.py"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert errors == [f"hpc-ddp: error: python {bare} (the active venv, $VIRTUAL_ENV) cannot import hpc_ddp, which "
                      f"every rank runs; nothing was submitted HINT: install hpc-ddp into that environment ({bare} -m "
                      "pip install PATH, PATH a clone of hpc-ddp or the wheel its make dist builds), or give --python; "
                      "or skip these checks with --no-preflight"]
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()
    # The fix the hint names works: the Python running these tests has hpc_ddp.
    result = CliRunner().invoke(cli, ["submit", "--json", "--python", sys.executable, "train.py"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["job_id"] == "4711"
