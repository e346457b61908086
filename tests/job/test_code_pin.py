"""In a rank's Python the project is imported from its snapshot (exitsite/hpc_ddp_code.py), whichever way
Python finds it: the copied script's folder, `python -m` from the working directory, a sys.path entry the
script adds, PYTHONPATH, an editable install's finder. Real interpreters, a real copy."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.common.errors import EnvError
from hpc_ddp.job import runner
from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.job.exitsite import hpc_ddp_code
from hpc_ddp.spec.code import Code
from hpc_ddp.spec.jobspec import Target, build_spec

EXITSITE = runner.EXIT_GUARD_DIR


@pytest.fixture
def tree(tmp_path):
    """A working tree and its 'snapshot' (a copy whose files say COPY instead of TREE)."""
    work, copy = tmp_path / "work", tmp_path / "run" / "code" / "abc"
    for root, word in ((work, "TREE"), (copy, "COPY")):
        (root / "pkg").mkdir(parents=True)
        (root / "src" / "lib").mkdir(parents=True)
        (root / "helper.py").write_text(f"WHERE = {word!r}\n")
        (root / "pkg" / "__init__.py").write_text("")
        (root / "pkg" / "main.py").write_text("import helper, lib\nprint(helper.WHERE, lib.WHERE, helper.__file__)\n")
        (root / "src" / "lib" / "__init__.py").write_text(f"WHERE = {word!r}\n")
        (root / "train.py").write_text("import sys\nsys.path.insert(0, '.')\nimport helper\nprint(helper.WHERE)\n")
    return work, copy


def run(args, cwd, work, copy, **extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([EXITSITE, str(work / "src")]),
           hpc_ddp_code.PROJECT_VARIABLE: str(work), hpc_ddp_code.DIR_VARIABLE: str(copy), **extra}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_python_m_from_the_working_tree_imports_the_copy(tree):
    work, copy = tree
    helper, lib, path = run(["-m", "pkg.main"], work, work, copy)
    assert (helper, lib) == ("COPY", "COPY") and path.startswith(str(copy))


def test_a_path_the_script_adds_itself_is_pinned_at_the_next_import(tree):
    work, copy = tree
    assert run([str(copy / "train.py")], work, work, copy) == ["COPY"]


def test_without_the_variables_nothing_changes(tree):
    work, copy = tree
    helper, lib, _ = run(["-m", "pkg.main"], work, work, copy,
                         **{hpc_ddp_code.PROJECT_VARIABLE: "", hpc_ddp_code.DIR_VARIABLE: ""})
    assert (helper, lib) == ("TREE", "TREE")


def test_pinned_entry_keeps_what_the_copy_does_not_have(tree, tmp_path):
    work, copy = tree
    (work / "only_here").mkdir()
    assert hpc_ddp_code.pinned_entry("", str(work), str(copy), str(work)) == str(copy)
    assert hpc_ddp_code.pinned_entry(str(work / "src"), str(work), str(copy), "/") == str(copy / "src")
    assert hpc_ddp_code.pinned_entry(str(work / "only_here"), str(work), str(copy), "/") == str(work / "only_here")
    assert hpc_ddp_code.pinned_entry("/usr/lib/python3", str(work), str(copy), "/") == "/usr/lib/python3"


def test_an_editable_finders_map_is_pinned(tree, monkeypatch):
    work, copy = tree
    finder = type(sys)("__editable___proj_0_1_finder")
    finder.MAPPING = {"pkg": str(work / "pkg"), "other": "/elsewhere/other"}
    finder.NAMESPACES = {"ns": [str(work / "src")]}
    monkeypatch.setitem(sys.modules, finder.__name__, finder)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    hpc_ddp_code.install({hpc_ddp_code.PROJECT_VARIABLE: str(work), hpc_ddp_code.DIR_VARIABLE: str(copy)})
    assert finder.MAPPING == {"pkg": str(copy / "pkg"), "other": "/elsewhere/other"}
    assert finder.NAMESPACES == {"ns": [str(copy / "src")]}
    assert getattr(sys.meta_path[0], "_hpc_ddp_code", False)


def _spec(tmp_path, code=None):
    spec = build_spec([], target=Target("script", str(tmp_path / "work" / "train.py"), ("--x", "1")),
                      workdir=str(tmp_path / "work"), python=sys.executable)
    return dataclasses.replace(spec, code=code)


DIST = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
               master_addr="127.0.0.1", master_port=29500, hosts=("localhost",), job_id="7", restart_count=0, source="test")


def test_the_runner_runs_the_copy_and_names_it_to_the_rank(tree, tmp_path):
    work, copy = tree
    code = Code(str(work), str(copy), "abc", str(copy / "train.py"))
    spec = _spec(tmp_path, code)
    assert runner.program_argv(spec, DIST, "py") == ["py", str(copy / "train.py"), "--x", "1"]
    env = runner.rank_environment(spec, DIST, {}, str(tmp_path / "run"), nvidia_driver=False)
    assert env[hpc_ddp_code.DIR_VARIABLE] == str(copy) and env["HPC_DDP_CODE_ID"] == "abc"
    unpinned = _spec(tmp_path)
    assert runner.program_argv(unpinned, DIST, "py")[1] == str(work / "train.py")
    assert hpc_ddp_code.DIR_VARIABLE not in runner.rank_environment(unpinned, DIST, {}, str(tmp_path / "run"),
                                                                    nvidia_driver=False)


def test_a_run_whose_snapshot_is_gone_stops_in_one_line(tmp_path):
    spec = _spec(tmp_path, Code(str(tmp_path / "work"), str(tmp_path / "gone"), "abc", str(tmp_path / "gone/t.py")))
    with pytest.raises(EnvError, match="the code snapshot abc of this run is gone") as err:
        runner._check_code(spec)
    assert "--no-snapshot" in err.value.hint
    Path(tmp_path / "gone").mkdir()
    runner._check_code(spec)
