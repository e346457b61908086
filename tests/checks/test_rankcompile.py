"""Issue 53: the compile check gives the verdict of the Python the ranks will run, where it is another
interpreter than hpc-ddp's own: asked with the script's bytes on its stdin (nothing of the user's runs), in a
bounded time, its answer validated; where it cannot be asked, this Python's verdict stands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hpc_ddp.checks import rankcompile
from hpc_ddp.checks.preflight import device_findings, gate_devices
from hpc_ddp.checks.scriptcheck import compile_findings
from hpc_ddp.common.errors import UserError

MATCH = b"match command:\n    case 'go':\n        pass\n"  # fine here (3.10+)
BROKEN = b"x = 1\ndef f(:\n    pass\n"


def _spec(tmp_path: Path, python: str, *, setup=(), container=None, script="train.py"):
    return types.SimpleNamespace(python=python, setup=tuple(setup), container=container, workdir=str(tmp_path),
                                 target=types.SimpleNamespace(kind="script", value=script), gpus=0,
                                 tasks_per_node=1, nodes=1, gpu_binding=None, executor="local")


def _fake_python(tmp_path: Path, answer: str, name: str = "py39") -> Path:
    """A stand-in for another interpreter: prints `answer` as the compile verdict, and records its argv and
    stdin, so a test sees what it was asked."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    (tmp_path / f"{name}.answer").write_text("hpc-ddp-compile " + answer + "\n")
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\ncat > {tmp_path}/stdin\n"
                    f"cat {tmp_path}/{name}.answer\n")
    path.chmod(0o755)
    return path


def _other_real_python() -> str | None:
    """A real interpreter that is not this one (Debian's /usr/bin/python3 beside the .venv's pyenv build)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.isfile(candidate) and os.path.realpath(candidate) != os.path.realpath(sys.executable):
            return candidate
    return None


def test_the_ranks_python_is_asked_only_where_it_is_another_interpreter(tmp_path):
    here = sys.executable
    assert rankcompile.ranks_python_path(_spec(tmp_path, here), os.environ) is None
    link = tmp_path / "venv-python"
    link.symlink_to(os.path.realpath(here))  # a venv's python links to its base: the same compiler
    assert rankcompile.ranks_python_path(_spec(tmp_path, str(link)), os.environ) is None
    other = _fake_python(tmp_path, '{"version": "3.9.18", "kind": "ok"}')
    assert rankcompile.ranks_python_path(_spec(tmp_path, str(other)), os.environ) == str(other)
    # not knowable here: the image's Python, a name looked up after the setup lines, one that does not exist
    assert rankcompile.ranks_python_path(_spec(tmp_path, str(other), container="img.sif"), os.environ) is None
    assert rankcompile.ranks_python_path(_spec(tmp_path, "python3", setup=["module load py"]), os.environ) is None
    assert rankcompile.ranks_python_path(_spec(tmp_path, str(tmp_path / "nope")), os.environ) is None
    assert rankcompile.ranks_python_path(_spec(tmp_path, "py\x1b39"), os.environ) is None


def test_the_ranks_verdict_is_theirs_and_named_in_this_pythons_words(tmp_path):
    (tmp_path / "train.py").write_bytes(MATCH)
    other = _fake_python(tmp_path, json.dumps({"version": "3.9.18", "kind": "syntax", "line": 1, "offset": 7,
                                               "msg": "invalid syntax", "text": "match command:\n"}))
    (finding,) = [f for f in device_findings(_spec(tmp_path, str(other)), ask_ranks=True) if f.level == "error"]
    assert finding.message == (f"train.py line 1 does not compile with the ranks' python {other} (3.9.18): "
                               "invalid syntax: match command:")
    assert finding.hint == f"fix line 1, then check with: {other} -m py_compile train.py"
    # asked with the bytes this check read, on stdin, isolated (-I), the script named, nothing else run
    assert (tmp_path / "stdin").read_bytes() == MATCH
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[0] == "-I" and argv[1] == "-c" and argv[-1] == "train.py"
    # without asking (a dry run) this Python's verdict: it compiles here
    assert [f for f in device_findings(_spec(tmp_path, str(other))) if f.level == "error"] == []


def test_a_script_this_python_refuses_goes_ahead_where_the_ranks_python_compiles_it(tmp_path):
    (tmp_path / "train.py").write_bytes(BROKEN)  # stands for syntax newer than this Python (3.14's t-strings)
    other = _fake_python(tmp_path, '{"version": "3.14.0", "kind": "ok"}', name="py314")
    warnings = []
    gate_devices(_spec(tmp_path, str(other)), warnings.append)  # the submission: theirs, and it compiles
    assert warnings == []
    # the dry run runs nothing: this Python's refusal is a warning that says whose it is
    gate_devices(_spec(tmp_path, str(other)), warnings.append, dry_run=True)
    assert len(warnings) == 1 and "train.py line 2 does not compile" in warnings[0]
    assert f"(with this python; the ranks' {other} is asked when it is submitted)" in warnings[0]
    # with this Python as the ranks', a refusal as before
    with pytest.raises(UserError, match="train.py line 2 does not compile: invalid syntax"):
        gate_devices(_spec(tmp_path, sys.executable), warnings.append)


@pytest.mark.parametrize("answer", [
    "", "hpc-ddp-compile", "hpc-ddp-compile {", "hpc-ddp-compile [1]", 'hpc-ddp-compile {"kind": "ok"}',
    'hpc-ddp-compile {"version": 3, "kind": "ok"}', 'hpc-ddp-compile {"version": "' + "9" * 40 + '", "kind": "ok"}',
    'hpc-ddp-compile {"version": "3.9.1", "kind": "syntax", "msg": 7}',
    'hpc-ddp-compile {"version": "3.9.1", "kind": "eh", "msg": "x"}', "Traceback (most recent call last):",
])
def test_an_answer_that_is_not_ours_or_is_damaged_is_no_verdict(answer):
    assert rankcompile.verdict_for("/p", answer.encode()) is None


def test_damaged_fields_of_a_syntax_answer_are_dropped_not_used():
    out = {"version": "3.9.1", "kind": "syntax", "msg": "x" * 1000, "line": True, "offset": 10**40, "text": ["a"]}
    verdict = rankcompile.verdict_for("/p", ("noise\nhpc-ddp-compile " + json.dumps(out)).encode())
    exc = verdict.error
    assert isinstance(exc, SyntaxError) and exc.lineno is None and exc.offset is None and exc.text is None
    assert len(exc.msg) == 300
    (finding,) = compile_findings("t.py", b"x = (\n", verdict)
    assert finding.message.startswith("t.py line 0 does not compile with the ranks' python /p (3.9.1): xxx")


def test_an_interpreter_that_hangs_or_cannot_start_leaves_this_pythons_verdict(tmp_path):
    def hangs(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    assert rankcompile.ask("/p", "t.py", b"x", str(tmp_path), {}, run=hangs) is None
    assert rankcompile.ask(str(tmp_path / "gone"), "t.py", b"x", str(tmp_path), {}) is None
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    assert rankcompile.ask(str(slow), "t.py", b"x", str(tmp_path), {}, timeout=0.5) is None


@pytest.mark.skipif(_other_real_python() is None, reason="no second Python interpreter on this machine")
def test_a_real_other_interpreter_gives_its_verdict_and_runs_nothing_of_the_script(tmp_path):
    python = _other_real_python()
    marker = tmp_path / "ran"
    ok = f"open({str(marker)!r}, 'w').write('x')\n".encode()
    assert rankcompile.ask(python, "t.py", ok, str(tmp_path), os.environ).error is None
    assert not marker.exists()
    verdict = rankcompile.ask(python, "t.py", BROKEN, str(tmp_path), os.environ)
    assert isinstance(verdict.error, SyntaxError) and verdict.error.lineno == 2
    assert verdict.version == subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                             capture_output=True, text=True).stdout.strip()
    # the BOM and a coding line are the file's, as py_compile reads them
    assert rankcompile.ask(python, "t.py", b"\xef\xbb\xbfx = 1\n", str(tmp_path), os.environ).error is None
    latin = rankcompile.ask(python, "t.py", b"s = '\xe9'\n", str(tmp_path), os.environ)
    (finding,) = compile_findings("t.py", b"s = '\xe9'\n", latin)
    assert "it is not UTF-8" in finding.message and f"with the ranks' python {python}" in finding.message


@pytest.mark.parametrize("dry", [False, True])
def test_submit_says_the_ranks_verdict_before_anything_queues(tmp_path, dry):
    """The whole path: `submit --python OTHER` of a script the other Python refuses. Submitted: one line,
    exit 2, sbatch never called. A dry run (which runs nothing) compiles with this Python, which accepts it."""
    (tmp_path / "train.py").write_bytes(MATCH)
    other = _fake_python(tmp_path, json.dumps({"version": "3.9.18", "kind": "syntax", "line": 1, "offset": 7,
                                               "msg": "invalid syntax", "text": "match command:\n"}))
    bin_dir = tmp_path / "bin"
    called = tmp_path / "sbatch-called"
    for tool in ("sbatch", "sinfo", "scontrol", "squeue"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {called}\necho '1;cluster'\n")
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")}
    for name in ("SLURM_CONF", "SLURM_JOB_ID"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "sbatch", "--python", str(other),
                           "--run-dir", str(tmp_path / "run"), *(["--dry-run"] if dry else []), "train.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if dry:
        assert done.returncode == 0, done.stderr
        assert "does not compile" not in done.stderr
        return
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [f"hpc-ddp: error: train.py line 1 does not compile with the ranks' python {other} (3.9.18): "
                      "invalid syntax: match command:; nothing was submitted "
                      f"HINT: fix line 1, then check with: {other} -m py_compile train.py"], done.stderr
    assert not called.exists() or "sbatch" not in called.read_text()
