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
