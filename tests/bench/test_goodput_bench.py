"""The goodput bench's parts that need no Slurm (issue 44, item 4): its trace is seeded and has one
interruption of each kind at about one a minute, Meta's model, and the skipped row without the test Slurm."""

from __future__ import annotations

import pytest

from bench import goodput_bench


def test_the_trace_is_seeded_with_one_interruption_of_each_kind_about_a_minute_apart():
    events = goodput_bench.trace()
    assert events == goodput_bench.trace(goodput_bench.SEED)
    assert sorted(e["kind"] for e in events) == ["crash", "node", "preempt"]
    gaps = [b["at_s"] - a["at_s"] for a, b in zip([{"at_s": 0.0}] + events, events)]
    assert all(0.7 * goodput_bench.RATE_S <= g <= 1.3 * goodput_bench.RATE_S for g in gaps)


def test_metas_model():
    assert goodput_bench.model(u0=0.0, dt=10.0, w=0.0, rate_per_s=0.0) == 1.0
    assert goodput_bench.model(u0=15.0, dt=5.0, w=0.0, rate_per_s=1 / 60) == pytest.approx(1 - 17.5 / 60)
    assert goodput_bench.model(u0=0.0, dt=10.0, w=1.0, rate_per_s=0.0) == pytest.approx(1 / 1.1)


def test_without_the_test_slurm_the_section_is_one_skipped_row(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_CONF", raising=False)
    [row] = goodput_bench.run(None)
    assert row.section == "goodput" and row.ours_value is None and "SLURM_CONF unset" in row.skipped


def test_allocated_time_is_split_into_start_training_and_the_gaps_between():
    from bench import goodput_bench as g

    steps = [10.0 + 0.5 * i for i in range(10)] + [30.0 + 0.5 * i for i in range(4)]  # a gap from 14.5 to 30
    counted = [(0.0, 10.0, 4), (10.0, 14.0, 4), (14.0, 20.0, 4), (20.0, 30.0, 2), (30.0, 32.0, 3), (32.0, 40.0, 3)]
    split = g.where_it_went(counted, steps)
    assert split == {"start": 40.0, "training": 16.0 + 6.0, "between": 24.0 + 20.0 + 24.0}
    assert sum(split.values()) == sum((b - a) * n for a, b, n in counted)


def test_a_node_kill_stops_every_process_then_kills_children_before_parents(monkeypatch):
    """A node that vanishes lets none of its processes react to another's death: srun's shepherd, seeing
    srun die first, would cancel srun's step on another node (the batch host guard's, issue 44's CI hang)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '30'])"])
    try:
        def children():
            return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                    and goodput_bench._parent(int(p.name)) == parent.pid]
        deadline = time.monotonic() + 20
        while not children() and time.monotonic() < deadline:
            time.sleep(0.05)
        [child] = children()
        sent = []
        monkeypatch.setattr(goodput_bench.os, "kill", lambda pid, sig: sent.append((pid, sig)))
        goodput_bench.kill_at_once([parent.pid, child])   # parent first, as a scan of /proc finds them
        assert sent == [(child, signal.SIGSTOP), (parent.pid, signal.SIGSTOP),
                        (child, signal.SIGKILL), (parent.pid, signal.SIGKILL)]
    finally:
        monkeypatch.undo()
        subprocess.run(["pkill", "-P", str(parent.pid)], check=False)
        parent.kill()
        parent.wait()
