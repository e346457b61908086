"""Shell completion: click's protocol answers with job ids, run dirs and profile names; a broken or hostile
registry or profiles file gives no completions and no traceback; bash really completes with the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.cli.completion import offerable


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A registry with three runs (one whose run dir is gone) and a profiles file with two profiles."""
    runs = tmp_path / "runs"
    for name in ("train-1", "train-2", "other"):
        (runs / name).mkdir(parents=True)
    registry = tmp_path / "registry.jsonl"
    lines = ['{"job_id": "4711", "run_dir": "%s/train-1", "executor": "sbatch"}' % runs,
             '{"job_id": "4712", "run_dir": "%s/train-2", "executor": "sbatch"}' % runs,
             '{"job_id": "777", "run_dir": "/nonexistent/run", "executor": "sbatch"}',
             '{"job_id": "local-99-1", "run_dir": "%s/other", "executor": "local"}' % runs]
    registry.write_text("\n".join(lines) + "\n")
    (tmp_path / "profiles.toml").write_text('[alpine]\npartition = "gpu"\n[bigiron]\n[alps]\nsetup = []\n'
                                           'top_level_key = 1\n')
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(registry))
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def complete(line: str, shell: str = "bash") -> list[str]:
    """What `hpc-ddp` answers a shell asking to complete `line` (its last word; "" after a space)."""
    words = line.split(" ")
    cword = words[-1] if shell == "fish" else str(len(words) - 1)  # fish passes the word itself
    env = {"_HPC_DDP_COMPLETE": f"{shell}_complete", "COMP_WORDS": line, "COMP_CWORD": cword}
    result = CliRunner().invoke(cli, [], env=env, prog_name="hpc-ddp")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return [answer for answer in result.output.splitlines() if answer]


def test_job_arguments_complete_recorded_job_ids_newest_first(home):
    for command in ("status", "logs", "cancel", "preempt", "timeline"):
        assert complete(f"hpc-ddp {command} ") == ["plain,local-99-1", "plain,4712", "plain,4711"], command
    assert complete("hpc-ddp status 47") == ["plain,4712", "plain,4711"]
    assert complete("hpc-ddp submit --after 471") == ["plain,4712", "plain,4711"]


def test_zsh_and_fish_get_the_run_dir_as_the_description(home):
    assert complete("hpc-ddp logs 4711", "zsh") == ["plain", "4711", "train-1"]
    assert complete("hpc-ddp logs 4711", "fish") == ["plain,4711\ttrain-1"]


def test_a_path_is_left_to_the_shells_directory_completion(home):
    assert complete("hpc-ddp status runs/tr") == ["dir,runs/tr"]
    assert complete("hpc-ddp status xyz") == ["dir,xyz"]  # no such job: maybe a directory


def test_run_dir_arguments_complete_the_recorded_run_dirs_here(home):
    assert complete("hpc-ddp plot ") == ["plain,runs/other", "plain,runs/train-2", "plain,runs/train-1"]
    assert complete("hpc-ddp plot runs/t") == ["plain,runs/train-2", "plain,runs/train-1"]


def test_profile_names_come_from_the_profiles_file(home):
    for command in ("submit", "doctor", "render", "run"):
        assert complete(f"hpc-ddp {command} --profile al") == ["plain,alpine", "plain,alps"]
    assert complete("hpc-ddp submit --profile ") == ["plain,alpine", "plain,alps", "plain,bigiron"]


def test_commands_and_options_complete_as_click_does(home):
    assert "plain,completion" in complete("hpc-ddp comp")
    assert complete("hpc-ddp submit --executor l") == ["plain,local"]
    assert complete("hpc-ddp submit --python ") == ["file,"]


@pytest.mark.parametrize("profiles", [
    "not toml [[[",
    "\xff\xfe binary",
    "[a]\nx = " + "[" * 5000 + "]" * 5000,
    "x" * (2 * 1024 * 1024),
])
def test_a_broken_profiles_file_gives_no_completions(home, profiles):
    Path(os.environ["HPC_DDP_PROFILES"]).write_bytes(profiles.encode("utf-8", "surrogateescape"))
    assert complete("hpc-ddp submit --profile ") == []


def test_a_profiles_file_that_is_a_fifo_or_missing_gives_none_at_once(home, monkeypatch):
    fifo = home / "fifo.toml"
    os.mkfifo(fifo)
    monkeypatch.setenv("HPC_DDP_PROFILES", str(fifo))
    assert complete("hpc-ddp submit --profile ") == []  # would hang if opened for reading
    monkeypatch.setenv("HPC_DDP_PROFILES", str(home / "nope.toml"))
    assert complete("hpc-ddp submit --profile ") == []
    monkeypatch.setenv("HPC_DDP_PROFILES", str(home))
    assert complete("hpc-ddp submit --profile ") == []


def test_hostile_registry_lines_are_never_offered(home):
    registry = Path(os.environ["HPC_DDP_REGISTRY"])
    run_dir = home / "runs" / "train-1"
    hostile = ['{"job_id": "1\\nplain,rm -rf", "run_dir": "%s"}', '{"job_id": "$(touch pwned)", "run_dir": "%s"}',
               '{"job_id": "-rf", "run_dir": "%s"}', '{"job_id": "a b", "run_dir": "%s"}',
               '{"job_id": "*", "run_dir": "%s"}', '{"job_id": "\\u001b[31m", "run_dir": "%s"}',
               '[1, 2]', 'not json', '{"job_id": 5}', '{"run_dir": 7, "job_id": "8"}']
    registry.write_text("\n".join(line.replace("%s", str(run_dir)) for line in hostile) + "\n")
    assert complete("hpc-ddp status ") == ["dir,"]
    registry.write_bytes(b"\xff\xfe\x00garbage\n")
    assert complete("hpc-ddp status ") == ["dir,"]


def test_a_hostile_run_dir_name_adds_no_completion_in_zsh_or_fish(home):
    """The run dir's name is the description zsh and fish show: one with a newline would have made `-rf` a
    completion of its own (issue 30)."""
    registry = Path(os.environ["HPC_DDP_REGISTRY"])
    run_dir = home / "runs" / "x\n-rf\nplain"
    run_dir.mkdir(parents=True)
    registry.write_text(json.dumps({"job_id": "4712", "run_dir": str(run_dir)}) + "\n")
    assert complete("hpc-ddp logs 47", "zsh") == ["plain", "4712", "_"]
    assert "-rf" not in complete("hpc-ddp logs 47", "fish")


def test_offerable():
    assert offerable("4711") and offerable("local-29404-1795442544") and offerable("runs/train-20261122-054742")
    for bad in ("", "a\nb", "a b", "-x", "$(x)", "`x`", "a;b", "*", "a\x1bb", "a\tb", "'", '"'):
        assert not offerable(bad), bad


def test_a_big_registry_is_read_from_its_end_only(home):
    registry = Path(os.environ["HPC_DDP_REGISTRY"])
    old = '{"job_id": "1%06d", "run_dir": "/nonexistent/x"}\n'
    with open(registry, "w") as fh:
        fh.writelines(old % i for i in range(100_000))  # ~5 MB of runs long gone
        fh.write('{"job_id": "4711", "run_dir": "%s"}\n' % (home / "runs" / "train-1"))
    assert complete("hpc-ddp status ") == ["plain,4711"]


def test_completion_command_prints_each_shells_script():
    for shell, marker in (("bash", "complete -o nosort -F _hpc_ddp_completion hpc-ddp"),
                          ("zsh", "#compdef hpc-ddp"), ("fish", "complete --no-files --command hpc-ddp")):
        result = CliRunner().invoke(cli, ["completion", shell], prog_name="hpc-ddp")
        assert result.exit_code == 0 and marker in result.output and "_HPC_DDP_COMPLETE" in result.output, shell
    assert CliRunner().invoke(cli, ["completion", "tcsh"]).exit_code == 2


def test_bash_really_completes_job_ids_with_the_script(home):
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "hpc-ddp").exists():
        pytest.skip("hpc-ddp is not installed beside this Python")
    script = ('eval "$(hpc-ddp completion bash)"\n'
              'COMP_WORDS=(hpc-ddp logs 471); COMP_CWORD=2; _hpc_ddp_completion hpc-ddp 471 logs\n'
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    done = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["4712", "4711"] and done.stderr == ""
