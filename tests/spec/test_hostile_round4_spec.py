"""Hardening round 4 (issue 43), round 3's leftovers and the spec's own rows: --elastic with a fixed --nodes
is refused, not ignored; --debug-rank counts a node range's most ranks; --stage says how it read a colon; an
error line is one line whatever its values hold; Slurm unreachable is exit 1 (the table's), not 2; preempt
names where a bad signal came from; the notebook API's bad kwargs and a submit without Slurm are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc_ddp.common.errors import SubmitError, UserError
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.slurm.queue import SchedulerRefused, sbatch

CLI = [sys.executable, "-m", "hpc_ddp"]


def _dry(tmp_path, *args, env=None):
    (tmp_path / "t.py").write_text("print(1)\n")
    return subprocess.run([*CLI, "submit", "--dry-run", "--executor", "local", *args, "t.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("nodes", ["1", "2"])
def test_elastic_with_a_fixed_node_count_is_refused_not_ignored(tmp_path, nodes):
    done = _dry(tmp_path, "--nodes", nodes, "--elastic", "keep_per_rank_batch")
    assert done.returncode == 2 and "--elastic applies to a node range" in done.stderr and "HINT" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_elastic_with_a_node_range_is_taken(tmp_path):
    done = _dry(tmp_path, "--nodes", "1-2", "--elastic", "keep_per_rank_batch")
    assert done.returncode == 0, done.stderr


def test_a_profiles_elastic_does_not_refuse_a_fixed_job(tmp_path):
    (tmp_path / "profiles.toml").write_text('[p]\nelastic = "keep_per_rank_batch"\n')
    done = _dry(tmp_path, "--profile", "p", "--nodes", "2", env={"HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")})
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("rank", "ok"), [(2, True), (3, False)])
def test_debug_rank_counts_a_node_ranges_most_ranks(tmp_path, rank, ok):
    done = _dry(tmp_path, "--nodes", "1-3", "--debug-rank", str(rank))
    if ok:
        assert "outside the job" not in done.stderr, done.stderr
    else:
        assert done.returncode == 2 and "outside the job's 3 rank(s)" in done.stderr


STAGES = {
    "a path with a colon": ("{tmp}/a:b", "a path with a colon, and --stage reads SRC:NAME at its last colon"),
    "a path's tail as the name": ("{tmp}/d:x/y", "reads as SRC"),
    "a name with a newline": ("{tmp}/d:ab\n", "dataset name 'ab\\n' must be a letter"),
    "a source with a newline": ("{tmp}/d\n", "dataset name 'd\\n' must be a letter"),
}


@pytest.mark.parametrize("case", sorted(STAGES))
def test_stage_values_are_refused_in_one_line_saying_how_they_were_read(tmp_path, case):
    (tmp_path / "a:b").mkdir()
    (tmp_path / "d").mkdir()
    value, said = STAGES[case]
    done = _dry(tmp_path, "--stage", value.format(tmp=tmp_path))
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_stage_src_name_still_names_the_copy(tmp_path):
    from hpc_ddp.spec.jobspec import split_stage

    (tmp_path / "d").mkdir()
    assert split_stage(f"{tmp_path}/d:train") == (f"{tmp_path}/d", "train")
    assert split_stage(f"{tmp_path}/d:") == (f"{tmp_path}/d", "")
    assert split_stage(f"{tmp_path}/d") == (f"{tmp_path}/d", "")


@pytest.mark.parametrize("said", ["sbatch: error: Batch job submission failed: Unable to contact slurm controller "
                                  "(connect failure)", "sbatch: error: Batch job submission failed: Zero Bytes were "
                                  "transmitted or received", "sbatch: error: Slurm temporarily unable to accept job, "
                                  "sleeping and retrying", "sbatch: fatal: Could not establish a configuration source"])
def test_slurm_unreachable_is_exit_1_not_a_refusal(tmp_path, said):
    fake = FakeCommands({"sbatch": lambda argv: Completed(tuple(argv), 1, "", said)})
    with pytest.raises(SubmitError) as err:
        sbatch(fake, tmp_path, dependency="afterok:5")
    assert not isinstance(err.value, UserError) and err.value.exit_code == 1


def test_a_real_refusal_is_still_exit_2(tmp_path):
    fake = FakeCommands({"sbatch": lambda argv: Completed(tuple(argv), 1, "", "sbatch: error: Invalid partition")})
    with pytest.raises(SchedulerRefused):
        sbatch(fake, tmp_path)


def test_preempt_names_the_specs_signal_not_none(tmp_path):
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("t", {})], target=Target("script", "t.py"), workdir=str(tmp_path), python=sys.executable)
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps({**spec.to_dict(), "signal": "BOGUS"}))
    (run / "submissions.jsonl").write_text(json.dumps({"job_id": "1", "executor": "local"}) + "\n")
    done = subprocess.run([*CLI, "preempt", str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the job's signal 'BOGUS'" in done.stderr and "None" not in done.stderr


@pytest.mark.parametrize("kwargs", [5, [1], {1: 2}, "a=1"])
def test_bad_notebook_kwargs_are_named_not_a_hint_about_locks(kwargs):
    from hpc_ddp import notebook

    with pytest.raises(UserError) as err:
        notebook.launch(print, kwargs=kwargs)
    assert "kwargs= is" in str(err.value) and "locks" not in str(err.value)


def test_notebook_submit_without_sbatch_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from hpc_ddp import notebook

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(tmp_path / "runs.jsonl"))
    with pytest.raises(UserError, match="there is no sbatch or srun on this machine"):
        notebook.submit(print)


def test_notebook_submit_that_sbatch_fails_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    from hpc_ddp import notebook

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error' >&2\n"
                    "echo 'sbatch: fatal: Could not establish a configuration source' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(tmp_path / "runs.jsonl"))
    with pytest.raises(SubmitError) as err:
        notebook.submit(print)
    assert "Could not establish a configuration source" in str(err.value) and "\n" not in str(err.value)
