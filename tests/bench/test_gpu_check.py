"""make gpu-check (issue 40) on a machine without a GPU: the same three parts, small, on the CPU. It keeps the
command that a GPU visit depends on working, and checks what it concludes; its numbers mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu_check import proved  # noqa: E402


@pytest.mark.e2e
@pytest.mark.extended
def test_the_smoke_run_trains_every_row_and_compares_the_paths(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "gpu-check.json").read_text())
    assert proc.returncode == 0, (proc.stdout[-3000:], summary)
    trainer = summary["parts"]["trainer"]
    assert [(r["data_path"], r["precision"], r["trains"], r["last_step"]) for r in trainer["rows"]] == [
        ("device", "bf16", True, 6), ("cpu", "bf16", True, 6), ("device", "fp32", True, 6), ("cpu", "fp32", True, 6)]
    assert all(c["passed"] for c in trainer["comparisons"])
    assert summary["parts"]["tests"]["passed"] and summary["parts"]["bench"]["rows"]
    assert summary["proved"] == []          # a smoke test on the CPU proves nothing about GPUs
    assert "# make gpu-check: passed" in (out / "gpu-check.md").read_text()


def _summary(rows, passed=True, gpu="NVIDIA H200", smoke=False):
    return {"smoke": smoke, "machine": {"gpu": gpu},
            "parts": {"trainer": {"passed": passed, "rows": [
                {"data_path": d, "precision": p, "trains": t} for (d, p), t in rows.items()]}}}


def test_a_visit_proves_only_what_trained_on_the_gpu():
    every = {("device", "bf16"): True, ("cpu", "bf16"): True, ("device", "fp32"): True, ("cpu", "fp32"): True}
    assert proved(_summary(every)) == ["precision", "channels_last", "data_path"]
    nan = {**every, ("device", "bf16"): False}        # issue 40's first row
    assert proved(_summary(nan, passed=False)) == []
    assert proved(_summary(every, gpu=None)) == [] and proved(_summary(every, smoke=True)) == []


# ---- issue 53: gpu-check replaces only what it made, and a run of nothing does not pass ----

def _gpu_check(*args):
    return subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_a_folder_of_the_users_under_out_is_never_replaced(tmp_path):
    out = tmp_path / "out"
    (out / "jpegs").mkdir(parents=True)
    (out / "jpegs" / "mine.jpg").write_bytes(b"the user's")
    (out / "trainer-cpu-fp32").mkdir()
    done = _gpu_check("--out", str(out), "--parts", "trainer")
    assert done.returncode == 2 and "jpegs, trainer-cpu-fp32" in done.stderr and "nothing was touched" in done.stderr
    assert (out / "jpegs" / "mine.jpg").read_bytes() == b"the user's" and (out / "trainer-cpu-fp32").is_dir()


def test_what_an_earlier_run_made_is_replaced_and_nothing_else(tmp_path):
    from bench.gpu_check import MADE, fresh, replaceable

    out = tmp_path / "out"
    out.mkdir()
    made = fresh(out, "jpegs")
    made.mkdir()
    (made / "old.jpg").write_bytes(b"x")
    assert json.loads((out / MADE).read_text()) == ["jpegs"] and replaceable(out) == []
    assert not fresh(out, "jpegs").exists()     # an earlier run's: replaced
    (out / "trainer-device-bf16").symlink_to(tmp_path)
    assert replaceable(out) == ["trainer-device-bf16"]
    with pytest.raises(RuntimeError, match="not gpu-check's own"):
        fresh(out, "trainer-device-bf16")
    assert (out / "trainer-device-bf16").is_symlink()


@pytest.mark.parametrize("name", ["tests.log", "bench.log", "make-dataset.log", "trainer-device-bf16.toml",
                                  "gpu-check.md", "site"])
def test_a_file_of_the_users_of_a_name_gpu_check_writes_is_never_replaced(tmp_path, name):
    """Issue 53 (round 5 rerun): every name a run writes, not only its folders, is checked up front."""
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("mine")
    done = _gpu_check("--out", str(out), "--parts", "tests,trainer,bench")
    assert done.returncode == 2 and name in done.stderr and "nothing was touched" in done.stderr, done.stderr
    assert (out / name).read_text() == "mine" and not (out / "gpu-check.json").exists()


def test_an_unknown_part_is_refused_before_any_part_runs(tmp_path):
    done = _gpu_check("--out", str(tmp_path / "out"), "--parts", "tests,bogus")
    assert done.returncode == 2 and "'bogus' is not one of" in done.stderr
    assert "gpu-check: tests" not in done.stdout and not (tmp_path / "out").exists()


def test_out_naming_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("mine")
    done = _gpu_check("--out", str(tmp_path / "f"))
    assert done.returncode == 2 and "is a file" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "f").read_text() == "mine"


@pytest.mark.parametrize("parts", ["", " , "])
def test_no_parts_is_refused_not_passed(tmp_path, parts):
    done = _gpu_check("--out", str(tmp_path / "out"), "--parts", parts)
    assert done.returncode == 2 and "name at least one" in done.stderr
    assert not (tmp_path / "out" / "gpu-check.json").exists()
