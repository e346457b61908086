"""The CLI's habits: -v/-q on the group, --json on logs/cancel/preempt with stable keys, and a missing
optional dependency named with its extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.common import verbosity
from hpc_ddp.common.rundir import RunDir


@pytest.fixture
def project(tmp_path, monkeypatch):
    """train.py, and fake sbatch, sinfo and scancel on PATH (scancel records what it was asked)."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"sbatch": "echo 4711", "sinfo": "echo 'debug*|up|infinite|n1|idle|4|4000|(null)'",
             "scancel": f"echo \"$*\" >> {tmp_path / 'scancel-calls'}"}
    for name, text in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{text}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(tmp_path / "registry.jsonl"))
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX", "HPC_DDP_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    verbosity.set_level(verbosity.NORMAL)


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def submitted(project) -> str:
    result = invoke("submit", "--json", "--run-dir", "run", "train.py")
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{"):])["run_dir"]


# ---- -q / -v ----

def test_quiet_keeps_warnings_and_errors_only(project):
    loud = invoke("submit", "--dry-run", "--run-dir", "/tmp/x", "train.py").output
    assert "hpc-ddp: executor sbatch (Slurm's sbatch was found)" in loud and "hpc-ddp: python " in loud
    quiet = invoke("-q", "submit", "--dry-run", "--run-dir", "/tmp/x", "train.py").output
    assert "hpc-ddp: executor" not in quiet and "hpc-ddp: python" not in quiet and "#!/bin/bash" in quiet
    result = invoke("-q", "submit", "--nodes", "0", "train.py")
    assert result.exit_code == 2 and result.output == "hpc-ddp: error: --nodes: 0 is below the minimum of 1\n"


def test_quiet_keeps_lines_that_are_warnings():
    verbosity.set_level(verbosity.QUIET)
    try:
        for line, shown in (("executor local (as requested)", False), ("warning: /tmp is local", True),
                            ("error: no such partition", True)):
            assert _said(verbosity.say, line) == (f"hpc-ddp: {line}\n" if shown else "")
        assert _said(verbosity.warning, "x") == "hpc-ddp: warning: x\n"
    finally:
        verbosity.set_level(verbosity.NORMAL)


def _said(fn, line):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        fn(line)
    return err.getvalue()


def test_verbose_shows_the_commands_run(project):
    result = invoke("-v", "submit", "train.py")
    assert result.exit_code == 0, result.output
    assert "hpc-ddp: running sinfo " in result.output
    assert "hpc-ddp: running sbatch --parsable job.sbatch (in " in result.output
    assert "hpc-ddp: checking the ranks' python: " in result.output
    assert "running sbatch" not in invoke("submit", "train.py").output  # the default level resets it


def test_verbose_and_quiet_together_is_a_usage_error(project):
    result = invoke("-v", "-q", "list")
    assert result.exit_code == 2 and result.output == "hpc-ddp: error: give -v or -q, not both\n"


# ---- --json on cancel, preempt, logs ----

def test_cancel_json(project):
    run_dir = submitted(project)
    out = json.loads(invoke("cancel", "--json", "4711").output)
    assert out == {"action": "cancel", "job_id": "4711", "run_dir": run_dir, "executor": "sbatch",
                   "message": f"Cancelled job 4711 ({run_dir})"}
    assert (project / "scancel-calls").read_text() == "4711\n"


def test_preempt_json(project, monkeypatch):
    from hpc_ddp.cli import cmd_manage

    run_dir = submitted(project)
    out = json.loads(invoke("preempt", "--json", "run").output)
    assert out == {"action": "preempt", "job_id": "4711", "run_dir": run_dir, "executor": "sbatch", "signal": "USR2",
                   "message": "Sent SIGUSR2 to every rank of job 4711"}
    assert (project / "scancel-calls").read_text() == "--signal USR2 4711\n"
    # a TERM rehearsal of a Slurm job: recorded first; ranks that have not left after KillWait are killed
    monkeypatch.setattr(cmd_manage, "REHEARSAL_KILL_WAIT_S", 0.2)
    (project / "bin" / "squeue").write_text("#!/bin/bash\nprintf '4711.0\\n4711.batch\\n4711.extern\\n'\n")
    (project / "bin" / "squeue").chmod(0o755)
    term = json.loads(invoke("preempt", "--json", "--signal", "sigterm", "run").output)
    assert term["signal"] == "TERM" and "were killed, as Slurm kills them after a preemption" in term["message"]
    assert (project / "scancel-calls").read_text().splitlines()[1:] == ["--signal TERM 4711", "4711.0"]
    events = [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]
    assert [e["signal"] for e in events if e["event"] == "preempt_rehearsed"] == ["TERM"]


def test_cancel_and_preempt_refusals_stay_one_line_with_json(project):
    for command in ("cancel", "preempt"):
        result = invoke(command, "--json", "424242")
        assert result.exit_code == 2
        assert result.output.startswith("hpc-ddp: error: no run dir or known job '424242'") and "{" not in result.output


def test_logs_json_is_one_object_per_line(project):
    run_dir = RunDir(submitted(project))
    for attempt, rank, text in ((0, 0, "step 1\nhpc-ddp: stop requested\n"), (0, 1, "[rank 1] x]\n"),
                                (1, 0, "resumed token=ghp_abcdefghijklmnopqrstuvwxyz0123456789\n")):
        log = run_dir.path / "logs" / "job-4711" / f"attempt-{attempt}" / f"rank-{rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    result = invoke("logs", "--json", "4711")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    assert records[:3] == [{"attempt": 0, "rank": 0, "line": "step 1"},
                           {"attempt": 0, "rank": 0, "line": "hpc-ddp: stop requested"},
                           {"attempt": 0, "rank": 1, "line": "[rank 1] x]"}]
    assert records[3]["attempt"] == 1 and "ghp_abc" not in records[3]["line"]  # masked, as without --json
    plain = invoke("logs", "4711").output.splitlines()
    assert plain[2] == "[attempt 0 rank 1] [rank 1] x]" and len(plain) == len(records)
    assert [json.loads(line) for line in invoke("logs", "--json", "--rank", "1", "4711").output.splitlines()] == \
        [records[2]]


# ---- a missing extra ----

def test_plot_without_matplotlib_names_the_extra(project, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    run = project / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    result = invoke("plot", str(run))
    assert result.exit_code == 2
    assert result.output == ("hpc-ddp: error: matplotlib is not installed here, and this command draws with it "
                             "(hpc-ddp's [plot] extra) HINT: pip install 'hpc-ddp[plot]' (installed with pipx: "
                             "pipx inject hpc-ddp matplotlib)\n")


def test_other_missing_modules_stay_bugs():
    from hpc_ddp.cli.app import missing_extra

    assert missing_extra(ModuleNotFoundError("No module named 'yaml'", name="yaml")) is None
    assert missing_extra(ValueError("matplotlib")) is None
    found = missing_extra(ModuleNotFoundError("x", name="matplotlib.dates"))
    assert found.exit_code == 2 and found.hint.startswith("pip install 'hpc-ddp[plot]'")
