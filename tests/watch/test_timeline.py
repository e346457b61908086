"""The run timeline: what it makes of a run dir's records, the summary's arithmetic, and the PNG."""

import json

import pytest

from hpc_ddp.watch.timeline import build_timeline, draw, duration, save_png, summarize, summary_line

T0 = 1_800_000_000.0


def preempted_run():
    """Submitted at T0, queued 60 s; attempt 0 (hpcn[1-2]) trains steps 0-100 (1 s/step), checkpoints at
    50 and at its stop at 100, is preempted; requeued, queued 120 s; attempt 1 resumes from 100... no:
    from the checkpoint at step 80 (the stop checkpoint was lost), so 20 steps are redone; completes."""
    e = []
    def ev(t, event, **kw):
        e.append({"time": T0 + t, "event": event, **kw})
    ev(60, "attempt_start", attempt=0, job_id="7", nodes="hpcn[1-2]", checkpoint_step=None)
    ev(70, "start", step=0, total_steps=200)
    ev(120, "checkpoint", step=50, seconds=2.0)
    ev(150, "checkpoint", step=80, seconds=2.0)
    ev(170, "signal", cause="preempted", step=100)
    ev(180, "attempt_end", attempt=0, exit_code=75, cause="preempted")
    ev(181, "requeue", attempt=0, reason="preempted: requeue 1 of at most 20")
    ev(301, "attempt_start", attempt=1, job_id="7", nodes="hpcn[3-4]", checkpoint_step=80)
    ev(311, "resume", step=80)
    ev(431, "checkpoint", step=200, seconds=2.0)
    ev(432, "finish", step=200)
    ev(440, "attempt_end", attempt=1, exit_code=0, cause="completed")
    metrics = [{"time": T0 + 70 + s, "step": s, "loss": 1.0, "samples_per_s": 640.0} for s in range(10, 101, 10)]
    metrics += [{"time": T0 + 311 + (s - 80), "step": s, "loss": 0.5, "samples_per_s": 600.0}
                for s in range(90, 201, 10)]
    return e, metrics


def test_attempts_waits_and_redone_steps():
    events, metrics = preempted_run()
    tl = build_timeline(events, metrics, {"7": T0})
    a, b = tl.spans
    assert (a.attempt, a.nodes, a.cause, a.allocated_s) == (0, "hpcn[1-2]", "preempted", 120)
    assert (b.attempt, b.nodes, b.cause, b.allocated_s) == (1, "hpcn[3-4]", "completed", 139)
    assert [(w[0] - T0, w[1] - T0) for w in tl.waits] == [(0, 60), (181, 301)]
    # trained: start/resume to the last step record or checkpoint
    assert a.trained_s == 100 and b.trained_s == 120
    assert (a.reached_step, b.resume_step, b.redone_steps) == (100, 80, 20)
    assert [c[1] for c in a.checkpoints] == [50, 80] and a.signals[0][1] == "preempted"
    assert tl.step_seconds == pytest.approx(1.0)
    assert tl.finished_at == T0 + 432


def test_summary_arithmetic():
    events, metrics = preempted_run()
    s = summarize(build_timeline(events, metrics, {"7": T0}))
    assert s.allocated_s == 259 and s.trained_s == 220 and s.queued_s == 60 + 120
    assert s.interruptions == {"preempted": 1}
    # untrained by the interruption: attempt 0 after its last step (170 -> 180) + attempt 1's start-up (301 -> 311)
    assert s.restart_s == pytest.approx(20)
    assert s.redone_steps == 20 and s.redo_s == pytest.approx(20)
    assert s.cost_s == pytest.approx(40)
    assert summary_line(s) == ("85% of 4 min allocated time trained, 3 min queued; "
                               "1 preemption cost 40 s (20 s restarting, 20 s redoing 20 steps)")


def test_summary_names_mixed_causes_and_no_interruption():
    events, metrics = preempted_run()
    events[5] = {**events[5], "cause": "time_limit"}
    extra = [{"time": T0 + 500, "event": "attempt_start", "attempt": 2, "job_id": "7", "nodes": "x"},
             {"time": T0 + 510, "event": "start", "step": 0}]
    s = summarize(build_timeline(events[:-1] + extra, metrics, {}))
    # attempt 1 has no end record before attempt 2 started: killed from outside
    assert s.interruptions == {"time_limit": 1, "killed": 1}
    assert "2 interruptions (1 killed, 1 time limit) cost" in summary_line(s)
    clean = summarize(build_timeline(events[:2] + events[-2:], [], {}))
    assert summary_line(clean).endswith("; no interruptions")
    # no start, resume or step recorded at all: the time trained is not measured, and not said to be 0%
    unmeasured = summary_line(summarize(build_timeline(events[:1] + events[-2:], [], {})))
    assert "time trained not measured" in unmeasured and "%" not in unmeasured
    assert summary_line(summarize(build_timeline([], [], {}))) is None


def test_a_killed_attempt_ends_at_its_last_record_and_its_late_end_record_is_matched_by_number():
    events, metrics = preempted_run()
    del events[5:7]  # no attempt_end/requeue for attempt 0: SIGKILLed
    events.insert(6, {"time": T0 + 301.5, "event": "attempt_end", "attempt": 0, "exit_code": None, "cause": "killed"})
    tl = build_timeline(events, metrics, {})
    a, b = tl.spans
    assert a.cause == "killed" and a.end == T0 + 170 and not a.end_recorded
    assert b.cause == "completed" and b.start == T0 + 301


def test_a_script_run_without_hpc_ddp_gets_one_attempt_per_start_or_resume():
    events = [{"time": T0, "event": "start", "step": 0}, {"time": T0 + 10, "event": "checkpoint", "step": 5},
              {"time": T0 + 20, "event": "resume", "step": 5}, {"time": T0 + 30, "event": "finish", "step": 9}]
    tl = build_timeline(events, [{"time": T0 + 29, "step": 9, "loss": 0.1}], {})
    assert [(s.start - T0, s.resume_step) for s in tl.spans] == [(0, 0), (20, 5)]
    assert tl.spans[1].trained_s == 9


def test_records_without_time_or_step_are_skipped():
    events, metrics = preempted_run()
    events.append({"event": "checkpoint", "step": 3})          # no time
    metrics.append({"time": "soon", "step": 4})               # a bad time
    metrics.append({"time": T0 + 5, "step": "x"})             # a bad step
    tl = build_timeline(events, metrics, {"7": T0})
    assert len(tl.spans) == 2 and len(tl.throughput) == 10 + 12


@pytest.mark.parametrize("seconds,text", [(3, "3 s"), (840, "14 min"), (7500, "2 h 05 min")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_png_has_bands_labels_and_markers(tmp_path):
    import matplotlib.image as mpimg

    events, metrics = preempted_run()
    fig = draw(build_timeline(events, metrics, {"7": T0}), "run: 1 preemption")
    ax, ax_rate = fig.axes[:2]
    labels = set(ax.get_legend_handles_labels()[1])
    assert {"queued", "attempt: preempted", "attempt: completed", "training", "checkpoint", "stop signal",
            "requeue", "resume", "steps redone", "finish"} <= labels
    texts = [t.get_text() for t in ax.texts]
    assert "attempt 0\nhpcn[1-2]" in texts and "attempt 1\nhpcn[3-4]" in texts and "20 steps redone" in texts
    assert any(t.startswith("queued 2 min") for t in texts)
    assert ax_rate.get_ylabel() == "samples/s" and "wall clock" in ax_rate.get_xlabel()
    assert len(ax.patches) >= 2 + 2 + 2 + 1  # waits, attempt bands, training bars, redone hatch
    path = save_png(fig, tmp_path / "timeline.png")
    img = mpimg.imread(path)
    assert img.shape[:2] == (605, 1210)
    assert img[..., :3].std() > 0.05  # not blank: bands and text drawn


def test_plot_shows_a_resume_at_the_same_step_as_its_stop(tmp_path):
    """The step plot draws stops in the upper half and resumes in the lower: one never hides the other."""
    from hpc_ddp.watch import plot

    events, metrics = preempted_run()
    events.append({"time": T0 + 400, "event": "signal", "cause": "preempted", "step": 150})
    events.append({"time": T0 + 500, "event": "resume", "step": 150})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    fig = plot.figure(tmp_path)
    ax = fig.axes[0]
    stops = [l for l in ax.lines if l.get_gid() == "stop"]
    resumes = [l for l in ax.lines if l.get_gid() == "resume"]
    assert [l.get_xdata()[0] for l in resumes] == [80, 150] and 150 in [l.get_xdata()[0] for l in stops]
    for stop in stops:
        for resume in resumes:
            assert max(resume.get_ydata()) <= min(stop.get_ydata())  # axes fractions: lower vs upper half
    assert {"stop 150", "resume 150"} <= {t.get_text().strip() for t in ax.texts}


def test_plot_draws_one_loss_line_per_stretch_of_steps(tmp_path):
    """A resume from step 80 after the run reached 100: the redone steps are a second line, not a line
    drawn back from 100 to 90 over them."""
    from hpc_ddp.watch import plot

    events, metrics = preempted_run()
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 2')
    fig = plot.figure(tmp_path)
    lines = [line for line in fig.axes[0].lines if line.get_gid() == "loss"]
    assert [(line.get_xdata()[0], line.get_xdata()[-1]) for line in lines] == [(10, 100), (90, 200)]
