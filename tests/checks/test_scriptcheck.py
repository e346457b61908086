"""The script's own text before the queue (issue 42, items 10 and 11): a script that does not compile, and
one whose mp.spawn cannot work under the tasks hpc-ddp starts, are refused in one line at submit, its dry
run and doctor; nothing is submitted. The seeds are run as a reader copied them, from ../shared/seeds."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hpc_ddp.checks.scriptcheck import compile_findings, script_findings, spawn_findings

SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"


def _spec(gpus: int, tasks: int):
    return types.SimpleNamespace(gpus=gpus, tasks_per_node=tasks, target=types.SimpleNamespace(kind="script"))


def test_a_no_break_space_is_named_with_its_line_and_the_fix():
    text = "import os\nif True:\n\u00a0   print(os.getcwd())\n"
    (finding,) = compile_findings("train.py", text)
    assert finding.level == "error"
    line = finding.line()
    assert "train.py line 3" in line and "U+00A0" in line and "no-break space" in line
    assert "sed -i 's/\\xc2\\xa0/ /g' train.py" in line and "\n" not in line


def test_another_syntax_error_names_the_line_and_py_compile():
    (finding,) = compile_findings("train.py", "x = 1\ndef f(:\n    pass\n")
    assert "train.py line 2 does not compile" in finding.message
    assert "python -m py_compile train.py" in finding.hint


def test_a_script_that_compiles_is_not_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    assert compile_findings("t.py", f"open({str(marker)!r}, 'w')\n") == []
    assert not marker.exists()


SPAWN = "import torch.multiprocessing as mp\nworld_size = 4\n\ndef main():\n    mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)\n"


@pytest.mark.parametrize("gpus,tasks,says", [
    (1, 1, "starts 4 processes with mp.spawn (nprocs=world_size=4), but each task gets 1 GPU"),
    (4, 4, "hpc-ddp starts 4 tasks per node: each would spawn 4 processes"),
    (0, 2, "hpc-ddp starts 2 tasks per node"),
])
def test_mp_spawn_that_cannot_work_is_refused(gpus, tasks, says):
    (finding,) = spawn_findings(_spec(gpus, tasks), "s.py", SPAWN)
    assert finding.level == "error" and says in finding.message, finding.message
    assert "line 5" in finding.message and "examples/spawn_mnist.py" in finding.hint


@pytest.mark.parametrize("text,gpus,tasks", [
    (SPAWN, 4, 1),                                               # one task per node, one process per GPU
    (SPAWN.replace("nprocs=world_size", "nprocs=torch.cuda.device_count()"), 1, 1),  # not known: not refused
    ("import os\nprint(os.getpid())\n", 4, 4),                   # no spawn at all
    (SPAWN.replace("nprocs=world_size", "nprocs=2"), 2, 1),      # a literal that fits
])
def test_mp_spawn_that_fits_is_left_alone(text, gpus, tasks):
    assert spawn_findings(_spec(gpus, tasks), "s.py", text) == []


def test_a_literal_nprocs_above_the_tasks_gpus_is_refused():
    (finding,) = spawn_findings(_spec(2, 1), "s.py", SPAWN.replace("nprocs=world_size", "nprocs=8"))
    assert "starts 8 processes" in finding.message and "--gpus 8 --tasks-per-node 1" in finding.hint


# ---- the seeds, as a reader submits them ----

def _submit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """hpc-ddp from the seeds' folder, with an sbatch that records being called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    called = tmp_path / "sbatch-called"
    for tool in ("sbatch", "sinfo", "scontrol", "squeue"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho \"$0 $*\" >> {called}\necho '1;cluster'\n")
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")}
    for name in ("SLURM_CONF", "SLURM_JOB_ID"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", *args[:1], "--run-dir", str(tmp_path / "run"), *args[1:]],
                          cwd=SEEDS, env=env, capture_output=True, text=True, timeout=120)
    return done, called


def _error_line(done: subprocess.CompletedProcess) -> str:
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, done.stderr
    return errors[0]


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_seed_001_as_copied_is_refused_in_one_line_at_submit(tmp_path, dry):
    done, called = _submit(tmp_path, "submit", *dry, "--executor", "sbatch", "--nodes", "2", "--gpus", "4",
                           "linear_regression_as_copied.py")
    assert done.returncode == 2, done.stderr
    line = _error_line(done)
    assert "linear_regression_as_copied.py line 30 does not compile" in line and "U+00A0" in line
    assert "HINT:" in line and "sed -i" in line and "nothing was submitted" in line
    assert not called.exists() or "sbatch " not in called.read_text().replace("--help", "")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
def test_doctor_reports_seed_001s_syntax_error(tmp_path):
    done, _ = _submit(tmp_path, "doctor", "--executor", "local", "linear_regression_as_copied.py")
    assert done.returncode == 2
    assert "error: linear_regression_as_copied.py line 30 does not compile" in done.stdout


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
@pytest.mark.parametrize("gpus,says", [("1", "but each task gets 1 GPU"), ("4", "hpc-ddp starts 4 tasks per node")])
def test_seed_000_mp_spawn_is_refused_in_one_line_at_submit(tmp_path, gpus, says):
    done, called = _submit(tmp_path, "submit", "--executor", "sbatch", "--gpus", gpus, "spawn_mnist.py")
    assert done.returncode == 2, done.stderr
    line = _error_line(done)
    assert "spawn_mnist.py line 85" in line and says in line and "examples/spawn_mnist.py" in line, line
    assert not called.exists() or "sbatch " not in called.read_text().replace("--help", "")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("example", ["jobs/hello_ddp.py", "examples/preemptible.py", "examples/spawn_mnist.py"])
def test_our_own_examples_pass_every_check_of_their_text_on_gpus(example):
    """Issue 42, item 8: our own example picked cuda:0 for every rank, and hpc-ddp warned about it."""
    from hpc_ddp.checks.preflight import device_findings
    from hpc_ddp.spec.jobspec import JobSpec, Target

    repo = Path(__file__).resolve().parents[2]
    spec = JobSpec(target=Target("script", example), job_name="x", python="python", nodes=2, gpus=4, tasks_per_node=4,
                   workdir=str(repo))
    assert [f.line() for f in device_findings(spec) if f.level != "ok"] == []


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
def test_no_preflight_submits_an_mp_spawn_script_with_a_warning(tmp_path):
    """Its processes may be a worker pool, not ranks: --no-preflight is the way out, said in the hint."""
    done, _ = _submit(tmp_path, "submit", "--dry-run", "--no-preflight", "--executor", "sbatch", "--gpus", "4",
                      "spawn_mnist.py")
    assert done.returncode == 0, done.stderr
    assert "warning: spawn_mnist.py line 85 starts its own ranks with mp.spawn" in done.stderr


# ---- issue 53: what the refusal prints is safe to paste, and blames only what breaks the code ----

def test_the_py_compile_hint_quotes_the_name_so_pasting_it_runs_nothing_else(tmp_path):
    name = "x;touch hint;.py"
    (finding,) = compile_findings(name, "def f(:\n    pass\n")
    assert "python -m py_compile 'x;touch hint;.py'" in finding.hint
    command = finding.hint.split("check with: ", 1)[1]
    subprocess.run(["bash", "-c", command.replace("python", sys.executable, 1)], cwd=tmp_path, capture_output=True)
    assert not (tmp_path / "hint").exists()


def test_a_look_alike_inside_a_string_is_not_blamed_for_another_syntax_error():
    (finding,) = compile_findings("train.py", "greeting = 'caf\u00a0\u2019s'\ndef f(:\n    pass\n")
    assert "line 2 does not compile: invalid syntax" in finding.message and "U+00A0" not in finding.message
    assert "py_compile train.py" in finding.hint


def test_no_sed_is_offered_that_would_rewrite_a_string_literal():
    text = "label = 'a\u00a0b'\nif True:\n\u00a0   print(label)\n"
    (finding,) = compile_findings("train.py", text)
    assert "U+00A0" in finding.message and "sed" not in finding.hint and "editor" in finding.hint
    # where every look-alike is outside the strings, the sed line is right, and quoted as one word per part
    (plain,) = compile_findings("my train.py", "if True:\n\u00a0   print(1)\n")
    assert "sed -i 's/\\xc2\\xa0/ /g' 'my train.py'" in plain.hint


def test_no_sed_is_offered_where_the_tokenizer_stopped_before_a_string():
    """Round 5's rerun (A4): an indentation error stops the tokenizer before the string on line 5, whose
    no-break space it then cannot see; the sed would rewrite it."""
    text = 'x = 1\u00a0+ 1\ndef f():\n        a = 1\n    b = 2\ns = "a\u00a0b"\n'
    (finding,) = compile_findings("t.py", text)
    assert "U+00A0" in finding.message and "sed" not in finding.hint and "editor" in finding.hint


DUAL_MODE = '''import os
import torch.multiprocessing as mp

def main(rank, world):
    print(rank, world)

if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # torchrun (or hpc-ddp) started this process
        main(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        mp.spawn(main, args=(4,), nprocs=4)
'''


@pytest.mark.parametrize("text", [
    DUAL_MODE,
    DUAL_MODE.replace('if "LOCAL_RANK" in os.environ:', 'if os.environ.get("RANK") is not None:'),
    "import os, torch.multiprocessing as mp\nif 'RANK' not in os.environ:\n    mp.spawn(print, nprocs=8)\n",
    "import os, torch.multiprocessing as mp\nif not os.environ.get('LOCAL_RANK'):\n    mp.spawn(print, nprocs=8)\n",
    '"""Run with mp.spawn(main, nprocs=8) or torchrun."""\nprint("no spawn here")\n',
    "HELP = 'use mp.spawn(fn, nprocs=4) to test locally'\n",
    "x = '''\nmp.spawn(fn, nprocs=4)\n'''\n",
    "def start_processes(n):\n    return n\n\nstart_processes(8)\n",
    # round 5's rerun: a test of a variable bound to the launcher's (D7b)
    "import os, torch.multiprocessing as mp\nrank = os.environ.get('RANK')\nif rank is None:\n"
    "    mp.spawn(print, nprocs=8)\nelse:\n    print(rank)\n",
    "import os\nfrom torch.multiprocessing import spawn\nlocal = os.getenv('LOCAL_RANK')\nif local:\n    print(local)\n"
    "else:\n    spawn(print, nprocs=8)\n",
], ids=["torchrun-or-spawn", "rank-is-not-none", "rank-not-in-environ", "not-local-rank", "docstring",
        "string", "multi-line-string", "own-start-processes", "rank-variable-is-none", "local-variable-else"])
def test_what_is_not_a_spawn_under_hpc_ddp_is_left_alone(text):
    """Issue 53: a dual-mode script, a spawn named in a string, and a function of the script's own were
    refused as mp.spawn."""
    assert spawn_findings(_spec(4, 4), "s.py", text) == []


@pytest.mark.parametrize("text", [
    DUAL_MODE.replace('    if "LOCAL_RANK" in os.environ:  # torchrun (or hpc-ddp) started this process\n'
                      '        main(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))\n    else:\n', "    if True:\n"),
    "from torch.multiprocessing import start_processes\nstart_processes(print, nprocs=4)\n",
    "import torch\ntorch.multiprocessing.spawn(print, nprocs=4)\n",
    "import os, torch.multiprocessing as mp\nif 'LOCAL_RANK' in os.environ:\n    mp.spawn(print, nprocs=4)\n",
    # round 5's rerun: spawn by another name (D7f)
    "from torch.multiprocessing import spawn\ndef f(i):\n    pass\nspawn(f, nprocs=4)\n",
    "from torch.multiprocessing import spawn as launch\nlaunch(print, nprocs=4)\n",
    "import torch.multiprocessing as tmp\ntmp.spawn(print, nprocs=4)\n",
    "from torch import multiprocessing\nmultiprocessing.spawn(print, nprocs=4)\n",
], ids=["under-main-only", "start-processes", "torch-multiprocessing", "spawn-under-a-launcher", "imported-spawn",
        "imported-spawn-as", "module-alias", "from-torch-import"])
def test_a_spawn_that_runs_under_hpc_ddp_is_still_refused(text):
    (finding,) = spawn_findings(_spec(4, 4), "s.py", text)
    assert "starts its own ranks" in finding.message


def _zipapp(tmp_path, shebang: bool) -> bytes:
    import zipapp

    src = tmp_path / "app"
    src.mkdir(exist_ok=True)
    (src / "__main__.py").write_text("print('from the zip')\n")
    target = tmp_path / "app.pyz"
    zipapp.create_archive(src, target, interpreter="/usr/bin/env python3" if shebang else None)
    return target.read_bytes()


@pytest.mark.parametrize("case", ["bom", "latin-1-with-cookie", "cp1252-with-cookie", "zipapp", "zipapp-shebang",
                                  "nbsp-in-a-string", "bidi-in-a-comment", "big"])
def test_the_compile_check_agrees_with_python_on_what_runs(tmp_path, case):
    """Issue 53: a UTF-8 BOM script (which Windows editors write and Python runs) was refused, a .pyz
    zipapp was refused, and a script over 4 MB was not checked at all."""
    data = {
        "bom": b"\xef\xbb\xbfprint('hi')\n",
        "latin-1-with-cookie": b"# -*- coding: latin-1 -*-\nname = 'caf\xe9'\nprint(name)\n",
        "cp1252-with-cookie": b"# coding: cp1252\nquote = '\x93hi\x94'\n",
        "nbsp-in-a-string": "x = 'a\u00a0b'\n".encode(),
        "bidi-in-a-comment": "x = 1  # \u202e comment\n".encode(),
        "big": b"x = 1\n" * (1 << 20),  # 6 MB
    }.get(case) or _zipapp(tmp_path, shebang=case == "zipapp-shebang")
    path = tmp_path / ("app.pyz" if case.startswith("zipapp") else "s.py")
    path.write_bytes(data)
    ran = subprocess.run([sys.executable, str(path)], capture_output=True)
    assert ran.returncode == 0, ran.stderr  # Python runs it
    assert script_findings(_spec(0, 1), str(path), data, None) == []


@pytest.mark.parametrize("data", [b"x = 'caf\xe9'\nprint(x)\n", b"# ok\nx = 1\ny = '\xe9t\xe9'\n"])
def test_a_script_in_another_encoding_that_names_none_is_refused_as_python_refuses_it(tmp_path, data):
    """Issue 53: a latin-1 script without a coding line passed the check (decoded with errors=replace)
    and would fail on every rank."""
    path = tmp_path / "s.py"
    path.write_bytes(data)
    assert subprocess.run([sys.executable, str(path)], capture_output=True).returncode != 0
    (finding,) = script_findings(_spec(0, 1), str(path), data, None)
    line = 1 if data.startswith(b"x") else 3
    assert finding.message == f"s.py line {line} does not compile: it is not UTF-8 (Python's encoding for source files) " \
                              "and names no other in a coding line"
    assert "coding: latin-1" in finding.hint and "python -m py_compile s.py" in finding.hint


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
def test_a_big_script_that_does_not_compile_is_refused_at_submit(tmp_path):
    from hpc_ddp.checks.preflight import MAX_COMPILED
    from hpc_ddp.job.devicescan import MAX_SOURCE

    (tmp_path / "big.py").write_bytes(b"x = 1\n" * (MAX_SOURCE // 6 + 10) + b"def broken(:\n")
    assert MAX_SOURCE < (tmp_path / "big.py").stat().st_size < MAX_COMPILED
    done, _ = _submit(tmp_path, "submit", "--executor", "sbatch", "--dry-run", str(tmp_path / "big.py"))
    assert done.returncode == 2 and "big.py line" in done.stderr and "does not compile" in done.stderr, done.stderr
