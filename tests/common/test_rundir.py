"""The run dir's layout is named in one place, and nothing else in the package spells its file names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpc_ddp.common import rundir
from hpc_ddp.common.rundir import RunDir, attempt_logs, checkpoint_name, checkpoint_step

PACKAGE = Path(rundir.__file__).resolve().parents[1]


def test_paths_are_the_documented_ones(tmp_path):
    run = RunDir(tmp_path)
    assert run.spec == tmp_path / "spec.json" and run.events == tmp_path / "events.jsonl"
    assert run.rank_log("42", 3, 7) == tmp_path / "logs/job-42/attempt-3/rank-7.log"
    assert run.checkpoints / rundir.LATEST == tmp_path / "checkpoints/latest"
    assert attempt_logs("$SLURM_JOB_ID", "$ATTEMPT") == "logs/job-$SLURM_JOB_ID/attempt-$ATTEMPT"


@pytest.mark.parametrize("step,revision,name", [(0, 0, "step-000000000"), (120, 0, "step-000000120"),
                                                (160, 2, "step-000000160-r2")])
def test_checkpoint_names_round_trip(step, revision, name):
    assert checkpoint_name(step, revision) == name
    assert checkpoint_step(name) == step


@pytest.mark.parametrize("name", ["latest", "step-", "step-12x", ".tmp-step-000000001-abcdef12", "step-1-r"])
def test_other_names_are_no_checkpoint(name):
    assert checkpoint_step(name) is None


def test_rank_logs_are_found_in_attempt_then_rank_order_and_odd_files_skipped(tmp_path):
    run = RunDir(tmp_path)
    for job, attempt, rank in [("9", 1, 0), ("9", 0, 1), ("9", 0, 0), ("9", 0, 10), ("9", 0, 2)]:
        path = run.rank_log(job, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
    (run.attempt_logs("9", 0) / "rank-notanumber.log").write_text("")
    found = [(a, r) for a, r, _ in run.rank_logs()]
    assert found == [(0, 0), (0, 1), (0, 2), (0, 10), (1, 0)]
    assert [(a, r) for a, r, _ in run.rank_logs(rank=0)] == [(0, 0), (1, 0)]


# The run dir's file names, as a literal string anywhere in the package but rundir.py, mean a second
# owner of the layout: a rename in one place would split the run dir.
_SPELLED = re.compile(r"""["'](spec\.json|events\.jsonl|metrics\.jsonl|submissions\.jsonl|local\.pid|job\.sbatch|"""
                      r"""checkpoints|latest|logs)["']""")


def test_no_other_module_spells_the_run_dirs_file_names():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "rundir.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _SPELLED.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert offenders == []
