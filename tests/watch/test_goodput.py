"""Goodput (ETTR) and restarts in place in the timeline (issue 44): the definitions of watch/goodput.py on
records whose times are chosen, so every number is known."""

from __future__ import annotations

import pytest

from hpc_ddp.watch.goodput import goodput, goodput_line
from hpc_ddp.watch.timeline import build_timeline, summarize, summary_line


def _metrics(steps, t0, dt=1.0):
    return [{"step": s, "time": t0 + i * dt, "loss": 1.0, "samples_per_s": 10.0} for i, s in enumerate(steps)]


def test_a_run_without_interruptions_counts_only_its_start_up_and_last_save_as_overhead():
    events = [{"event": "attempt_start", "attempt": 0, "nodes": "n[1-4]", "time": 0.0},
              {"event": "start", "time": 10.0},
              {"event": "attempt_end", "attempt": 0, "exit_code": 0, "cause": "completed", "time": 100.0}]
    timeline = build_timeline(events, _metrics(range(1, 81), 11.0))   # steps 1..80 at 11..90 s
    g = goodput(timeline)
    assert g.allocated_node_s == pytest.approx(400.0) and g.useful_node_s == pytest.approx(4 * 80.0)
    assert g.ratio == pytest.approx(0.8)
    assert goodput_line(g, 4) == "80% of allocated GPU time (21 min of 27 min trained and kept)"


def test_a_restart_in_place_costs_its_gap_and_the_steps_it_redid_on_the_nodes_left():
    """4 nodes train steps 1-30 (10-39 s, the last checkpoint at step 25); a node is lost at 45 s;
    the restart on 3 resumes at step 25 at 55 s and trains to step 60 at 90 s; the run ends at 95 s."""
    events = [{"event": "attempt_start", "attempt": 0, "nodes": "n[1-4]", "time": 0.0},
              {"event": "start", "time": 9.0},
              {"event": "checkpoint", "step": 25, "time": 34.0},
              {"event": "restarted", "attempt": 0, "cause": "node_failure", "node_count": 3, "time": 45.0,
               "checkpoint_step": 25},
              {"event": "resume", "step": 25, "time": 55.0},
              {"event": "attempt_end", "attempt": 0, "exit_code": 0, "cause": "completed", "time": 95.0}]
    metrics = _metrics(range(1, 31), 10.0) + _metrics(range(26, 61), 56.0)
    timeline = build_timeline(events, metrics)
    [span] = timeline.spans
    [restart] = span.restarts
    assert (restart.gap_s, restart.redone_steps) == (pytest.approx(16.0), 5)   # 39 s -> 55 s; steps 26-30 again
    summary = summarize(timeline)
    assert summary.restarted_in_place == 1 and summary.in_place_s == pytest.approx(16.0 + 5 * 1.0)
    assert "restarted in place 1 time, cost 21 s" in summary_line(summary)
    g = goodput(timeline)
    # allocated: 45 s x 4 + 50 s x 3; useful: (39 - 9 - 5 redone) x 4 + (90 - 55) x 3
    assert g.allocated_node_s == pytest.approx(45 * 4 + 50 * 3)
    assert g.useful_node_s == pytest.approx(25 * 4 + 35 * 3)


def test_nothing_ran_yet_has_no_goodput():
    assert goodput(build_timeline([], [])).ratio is None and goodput_line(goodput(build_timeline([], []))) is None
