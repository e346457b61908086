"""Where a run's wall-clock time went: queue waits, attempts, checkpoints, stops, requeues, resumes and
steps redone, built from the run dir's records (events.jsonl, metrics.jsonl, the submission times), plus
the one-line summary `status` prints and the picture `hpc-ddp timeline` draws.

Everything but `draw` and `save_png` is pure. The built-in trainer and a user's script on the public
API (`hpc_ddp.trainer.session`) write the same records, so both get the same timeline; a script run outside
hpc-ddp (no attempt records) gets one attempt per start/resume record.

Definitions (the summary says them in one line, the tests pin them down):
- allocated: an attempt's attempt_start to its attempt_end; an attempt with no end record (killed from
  outside, or still running) to its last record.
- trained: from the attempt's start/resume record to its last step record or checkpoint before it ended.
- steps redone: at a resume, the highest step any earlier attempt reached minus the step resumed from.
- a restart in place (a "restarted" record: the ranks started again as a new srun step of the same
  attempt) costs the time from the step's last step record or checkpoint to the new step's resume record,
  plus the steps it redid x step time; that time is allocated, not trained.
- step time: the median seconds per step between consecutive metric records of one attempt.
- what the interruptions (preempted, time limit, killed) cost: the allocated time they left untrained
  (an interrupted attempt's time after its last step or checkpoint, and the start-up of the attempt that
  followed, up to its resume) plus steps redone x step time. The first attempt's start-up and the final
  checkpoint would be spent without any interruption, so they are not part of the cost.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import write_file
from hpc_ddp.common.terminal import printable
from hpc_ddp.slurm.nodelist import MAX_HOSTS

__all__ = ["Span", "Timeline", "Summary", "build_timeline", "summarize", "summary_line", "draw", "save_png",
           "INTERRUPTIONS"]

INTERRUPTIONS = ("preempted", "time_limit", "killed", "node_failure")


@dataclasses.dataclass
class Restart:
    """A restart in place: the attempt's ranks started again as a new srun step of its allocation."""
    time: float                           # its "restarted" record
    cause: str | None
    node_count: int | None                # the nodes of the new step
    trained_until: float | None           # the step before it: its last step record or checkpoint
    reached_step: int | None              # ... and the highest step it recorded
    resumed_at: float | None = None       # the new step's start/resume record
    resume_step: int | None = None

    @property
    def gap_s(self) -> float:
        """Allocated time nobody trained in: from the last step before it to the resume after it."""
        if self.trained_until is None or self.resumed_at is None:
            return 0.0
        return max(self.resumed_at - self.trained_until, 0.0)

    @property
    def redone_steps(self) -> int:
        if self.reached_step is None or self.resume_step is None:
            return 0
        return max(self.reached_step - self.resume_step, 0)


@dataclasses.dataclass
class Span:
    """One attempt: when it held its nodes and what it did there."""
    attempt: int
    job_id: str | None
    nodes: str | None
    start: float
    end: float
    end_recorded: bool = False           # False: killed from outside, or still running (end = last record)
    cause: str | None = None             # completed, preempted, time_limit, killed, failed, cancelled, ...
    exit_code: int | None = None
    train_start: float | None = None     # its start/resume record
    trained_until: float | None = None   # its last step record or checkpoint
    resume_step: int | None = None       # the step it started training from (0: from scratch)
    reached_step: int | None = None      # the highest step it recorded
    redone_steps: int = 0
    requeued_at: float | None = None
    checkpoints: list[tuple[float, int, float]] = dataclasses.field(default_factory=list)  # (time, step, seconds)
    signals: list[tuple[float, str, int | None]] = dataclasses.field(default_factory=list)  # (time, cause, step)
    restarts: list[Restart] = dataclasses.field(default_factory=list)  # in place, in this attempt's allocation

    @property
    def allocated_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def trained_s(self) -> float:
        if self.train_start is None or self.trained_until is None:
            return 0.0
        return max(self.trained_until - self.train_start - sum(r.gap_s for r in self.restarts), 0.0)

    @property
    def interrupted(self) -> bool:
        return self.cause in INTERRUPTIONS


@dataclasses.dataclass
class Timeline:
    spans: list[Span]
    waits: list[tuple[float, float]]                 # (queued from, started at)
    throughput: list[tuple[float, int, float]]       # (time, step, samples/s) from metrics.jsonl
    gave_up: list[tuple[float, str]]
    finished_at: float | None
    step_seconds: float | None

    @property
    def t0(self) -> float | None:
        times = [w[0] for w in self.waits] + [s.start for s in self.spans]
        return min(times) if times else None


@dataclasses.dataclass(frozen=True)
class Summary:
    allocated_s: float
    trained_s: float
    queued_s: float
    interruptions: dict[str, int]   # cause -> how many attempts ended so
    restart_s: float                # allocated time the interruptions left untrained
    redone_steps: int
    redo_s: float                   # redone_steps x step time
    step_seconds: float | None
    restarted_in_place: int = 0     # restarts inside the allocation (new srun steps of an attempt)
    in_place_s: float = 0.0         # what they cost: untrained time to each resume, plus steps redone x step time
    measured: bool = True           # some attempt reported its training (a start/resume record, or steps)

    @property
    def trained_fraction(self) -> float | None:
        return self.trained_s / self.allocated_s if self.allocated_s > 0 else None

    @property
    def cost_s(self) -> float:
        return self.restart_s + self.redo_s


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _step(record: Mapping[str, Any]) -> int | None:
    value = record.get("step")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def build_timeline(events: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]],
                   submitted: Mapping[str, float] | None = None) -> Timeline:
    """The timeline of a run dir's records. `submitted`: job id -> when it was submitted (the queue
    wait before a job's first attempt starts there). Records without a numeric time are skipped."""
    events = [e for e in events if _num(e.get("time")) is not None]
    metrics = sorted((m for m in metrics if _num(m.get("time")) is not None and _step(m) is not None),
                     key=lambda m: m["time"])
    spans = _spans(events)
    if not spans:
        spans = _spans_from_sessions(events)
    _fill(spans, events, metrics)
    waits = _waits(spans, submitted or {})
    throughput = [(m["time"], _step(m), float(m["samples_per_s"])) for m in metrics
                  if _num(m.get("samples_per_s")) is not None]
    gave_up = [(e["time"], _str(e.get("reason") or "") or "") for e in events if e.get("event") == "gave_up"]
    finished = next((e["time"] for e in reversed(events) if e.get("event") == "finish"), None)
    return Timeline(spans, waits, throughput, gave_up, finished, _step_seconds(spans, metrics))


def _spans(events: Sequence[Mapping[str, Any]]) -> list[Span]:
    spans: list[Span] = []
    for e in events:
        kind = e.get("event")
        if kind == "attempt_start":
            spans.append(Span(int(e.get("attempt") or 0), _str(e.get("job_id")), _str(e.get("nodes")),
                              e["time"], e["time"]))
        elif kind == "attempt_end":
            # attempts.begin records a killed attempt's end only when the next one starts: match by number.
            span = next((s for s in reversed(spans) if s.attempt == e.get("attempt") and not s.end_recorded
                         and s.cause is None), None)
            if span is None:
                continue
            span.cause, span.exit_code = _str(e.get("cause")), e.get("exit_code")
            if e.get("exit_code") is not None:
                span.end, span.end_recorded = e["time"], True
    return spans


def _spans_from_sessions(events: Sequence[Mapping[str, Any]]) -> list[Span]:
    """A script run without hpc-ddp's batch script: each start/resume record begins an attempt."""
    return [Span(i, _str(e.get("job_id")), None, e["time"], e["time"])
            for i, e in enumerate(e for e in events if e.get("event") in ("start", "resume"))]


def _str(value: Any) -> str | None:
    """A record's text as it is shown (printed, or drawn: matplotlib passes an ESC on in its warnings)."""
    return None if value is None else printable(str(value))


def _owner(spans: Sequence[Span], t: float) -> Span | None:
    """The attempt a record written at `t` belongs to: the last one started at or before it."""
    found = None
    for span in spans:
        if span.start <= t:
            found = span
    return found


def _fill(spans: list[Span], events: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]]) -> None:
    for e in events:
        span = _owner(spans, e["time"])
        if span is None:
            continue
        kind, step = e.get("event"), _step(e)
        if not span.end_recorded and kind not in ("attempt_end", "gave_up"):
            span.end = max(span.end, e["time"])  # no end record (yet): it held the nodes at least this long
        if kind in ("start", "resume") and span.train_start is None:
            span.train_start, span.resume_step = e["time"], step or 0
        elif kind in ("start", "resume") and span.restarts and span.restarts[-1].resumed_at is None:
            span.restarts[-1].resumed_at, span.restarts[-1].resume_step = e["time"], step or 0
        elif kind == "restarted":
            count = e.get("node_count")
            count = count if type(count) is int and 0 < count <= MAX_HOSTS else None  # a damaged count: unknown
            span.restarts.append(Restart(e["time"], _str(e.get("cause")), count, None, None))
        elif kind == "checkpoint":
            span.checkpoints.append((e["time"], step or 0, _num(e.get("seconds")) or 0.0))
            span.trained_until = max(span.trained_until or 0.0, e["time"])
        elif kind == "signal":
            span.signals.append((e["time"], _str(e.get("cause") or "stop"), step))
            if span.cause is None and e.get("cause"):
                span.cause = _str(e["cause"])
        elif kind == "requeue":
            span.requeued_at = e["time"]
        if step is not None and kind in ("checkpoint", "signal", "requeue_requested", "finish"):
            span.reached_step = max(span.reached_step or 0, step)
    for m in metrics:
        span = _owner(spans, m["time"])
        if span is None:
            continue
        if span.train_start is None:  # a script that logs without calling resume()
            span.train_start = m["time"]
        if not span.end_recorded:
            span.end = max(span.end, m["time"])
        if m["time"] <= span.end:
            span.trained_until = max(span.trained_until or 0.0, m["time"])
        span.reached_step = max(span.reached_step or 0, _step(m))
    for span in spans:
        for r in span.restarts:  # how far the step before each restart got: its last step record or checkpoint
            points = [(m["time"], _step(m)) for m in metrics if span.start <= m["time"] < r.time] + \
                [(t, step) for t, step, _ in span.checkpoints if t < r.time]
            if points:
                r.trained_until, r.reached_step = max(t for t, _ in points), max(s for _, s in points)
        if span.cause is None and not span.end_recorded and span is not spans[-1]:
            span.cause = "killed"
        if span.trained_until is not None:
            span.trained_until = min(span.trained_until, span.end)
    reached = None
    for span in spans:
        if span.resume_step is not None and reached is not None:
            span.redone_steps = max(reached - span.resume_step, 0)
        if span.reached_step is not None:
            reached = max(reached or 0, span.reached_step)


def _waits(spans: Sequence[Span], submitted: Mapping[str, float]) -> list[tuple[float, float]]:
    waits = []
    for i, span in enumerate(spans):
        before = spans[i - 1] if i else None
        if before is not None and before.job_id == span.job_id:
            queued_from = before.requeued_at or before.end
        else:
            queued_from = submitted.get(span.job_id or "")
        if queued_from is not None and queued_from < span.start:
            waits.append((queued_from, span.start))
    return waits


def _step_seconds(spans: Sequence[Span], metrics: Sequence[Mapping[str, Any]]) -> float | None:
    """Median seconds per step between consecutive training records of one attempt."""
    rates = []
    previous: tuple[Span | None, float, int] | None = None
    for m in metrics:
        if "loss" not in m and "samples_per_s" not in m:
            continue  # an eval record: its time includes the evaluation
        span = _owner(spans, m["time"])
        if previous and previous[0] is span and _step(m) > previous[2]:
            rates.append((m["time"] - previous[1]) / (_step(m) - previous[2]))
        previous = (span, m["time"], _step(m))
    return statistics.median(rates) if rates else None


def summarize(timeline: Timeline) -> Summary:
    spans = timeline.spans
    interruptions: dict[str, int] = {}
    restart = 0.0
    for i, span in enumerate(spans):
        if not span.interrupted:
            continue
        interruptions[span.cause] = interruptions.get(span.cause, 0) + 1
        restart += span.end - (span.trained_until or span.train_start or span.start)
        after = spans[i + 1] if i + 1 < len(spans) else None
        if after is not None:
            restart += (after.train_start or after.end) - after.start
    redone = sum(s.redone_steps for s in spans)
    step_s = timeline.step_seconds
    in_place = [r for s in spans for r in s.restarts]
    in_place_s = sum(r.gap_s + r.redone_steps * (step_s or 0.0) for r in in_place)
    return Summary(allocated_s=sum(s.allocated_s for s in spans), trained_s=sum(s.trained_s for s in spans),
                   queued_s=sum(b - a for a, b in timeline.waits), interruptions=interruptions,
                   restart_s=max(restart, 0.0), redone_steps=redone, redo_s=redone * (step_s or 0.0),
                   step_seconds=step_s, restarted_in_place=len(in_place), in_place_s=in_place_s,
                   measured=any(s.train_start is not None for s in spans))


def duration(seconds: float) -> str:
    """3 s, 14 min, 2 h 05 min: rounded the way a person reads it."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours, rest = divmod(round(seconds / 60), 60)
    return f"{hours} h {rest:02d} min"


def in_place_line(s: Summary) -> str:
    """'restarted in place 1 time, cost 14 s' (restarts inside the allocation, no trip through the queue)."""
    n = s.restarted_in_place
    return f"restarted in place {n} time{'s' if n != 1 else ''}, cost {duration(s.in_place_s)}"


_CAUSE_WORDS = {"preempted": ("preemption", "preempted"), "time_limit": ("time limit", "time limit"),
                "killed": ("kill", "killed"), "node_failure": ("lost node", "lost nodes")}


def summary_line(s: Summary) -> str | None:
    """'72% of 2 h 10 min allocated time trained, 5 min queued; 3 preemptions cost 14 min (4 min
    restarting, 10 min redoing 120 steps)'. None when nothing ran yet."""
    if not s.allocated_s:
        return None
    if not s.measured:  # a script that reports no steps: hpc-ddp cannot tell trained time from the rest
        return (f"{duration(s.allocated_s)} allocated; time trained not measured: the script reports no steps "
                f"(hpc_ddp.start()'s run.step(), or a framework hpc-ddp reads, measure it: docs/session-api.md)")
    head = f"{s.trained_fraction:.0%} of {duration(s.allocated_s)} allocated time trained"
    if s.queued_s >= 1:
        head += f", {duration(s.queued_s)} queued"
    if s.restarted_in_place:
        head += f"; {in_place_line(s)}"
    count = sum(s.interruptions.values())
    if not count:
        return head + ("" if s.restarted_in_place else "; no interruptions")
    if len(s.interruptions) == 1:
        word = _CAUSE_WORDS[next(iter(s.interruptions))][0]
        what = f"{count} {word}{'s' if count > 1 else ''}"
    else:
        what = f"{count} interruptions (" + ", ".join(
            f"{n} {_CAUSE_WORDS[c][1]}" for c, n in sorted(s.interruptions.items())) + ")"
    parts = [f"{duration(s.restart_s)} restarting"]
    if s.redone_steps:
        parts.append(f"{duration(s.redo_s)} redoing {s.redone_steps} steps" if s.step_seconds
                     else f"{s.redone_steps} steps redone")
    return f"{head}; {what} cost {duration(s.cost_s)} ({', '.join(parts)})"


# ---- the picture (side effects from here on) ----

_COLORS = {"completed": "tab:green", "preempted": "tab:orange", "time_limit": "tab:purple", "killed": "tab:red",
           "node_failure": "tab:brown",
           "failed": "tab:red", "cancelled": "tab:gray", None: "tab:blue"}


def draw(timeline: Timeline, title: str):
    """The figure: attempts as bands over wall-clock time (queue waits, checkpoints, stops, requeues,
    resumes, steps redone) above samples/s and the step reached. Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute or login nodes
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    def when(t: float) -> float:
        return mdates.date2num(datetime.datetime.fromtimestamp(t, datetime.timezone.utc))

    def days(seconds: float) -> float:
        return seconds / 86400.0

    fig, (ax, ax_rate) = plt.subplots(2, 1, figsize=(11, 5.5), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [1.1, 1]})
    for a, b in timeline.waits:
        if b - a < 1:
            continue  # a local run's "wait" is the executor starting: nothing to see
        ax.barh(0, days(b - a), left=when(a), height=0.5, color="lightgray", hatch="..", edgecolor="gray",
                label="queued" if "queued" not in _labels(ax) else None)
        ax.text(when(a) + days(b - a) / 2, -0.4, f"queued {duration(b - a)}", ha="center", va="top", fontsize=7)
    for span in timeline.spans:
        color = _COLORS.get(span.cause, "tab:blue")
        ax.barh(0, days(span.allocated_s), left=when(span.start), height=0.5, color=color, alpha=0.35,
                edgecolor=color, label=f"attempt: {span.cause or 'running'}"
                if f"attempt: {span.cause or 'running'}" not in _labels(ax) else None)
        if span.trained_s:
            ax.barh(0, days(span.trained_s), left=when(span.train_start), height=0.2, color=color,
                    label="training" if "training" not in _labels(ax) else None)
        ax.text(when(span.start) + days(span.allocated_s) / 2, 0.32,
                f"attempt {span.attempt}\n{span.nodes or 'local'}", ha="center", va="bottom", fontsize=7)
        if span.redone_steps and timeline.step_seconds and span.train_start is not None:
            ax.barh(0, days(span.redone_steps * timeline.step_seconds), left=when(span.train_start), height=0.5,
                    color="none", hatch="//", edgecolor="black",
                    label="steps redone" if "steps redone" not in _labels(ax) else None)
        if span.redone_steps:
            ax.text(when(span.train_start or span.start), -0.4, f"{span.redone_steps} steps redone",
                    ha="left", va="top", fontsize=7)
        _marks(ax, [when(t) for t, _, _ in span.checkpoints], "|", "black", "checkpoint", size=14)
        _marks(ax, [when(t) for t, _, _ in span.signals], "X", "red", "stop signal", size=8)
        _marks(ax, [when(span.requeued_at)] if span.requeued_at else [], ">", "tab:brown", "requeue", size=8)
        _marks(ax, [when(r.time) for r in span.restarts], "D", "tab:olive", "restart in place", size=7)
        if span.resume_step:
            _marks(ax, [when(span.train_start)], "^", "tab:purple", "resume", size=8)
    if timeline.finished_at:
        _marks(ax, [when(timeline.finished_at)], "*", "gold", "finish", size=12)
    ax.set_yticks([])
    ax.set_ylim(-0.9, 1.0)
    ax.set_ylabel("attempts")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=7, ncol=5, bbox_to_anchor=(0, -0.02), frameon=False)

    if timeline.throughput:
        # One line per attempt: a line across a queue wait would draw throughput that never was.
        by_span: dict[int, list[tuple[float, int, float]]] = {}
        for point in timeline.throughput:
            by_span.setdefault(id(_owner(timeline.spans, point[0])), []).append(point)
        for i, points in enumerate(by_span.values()):
            ax_rate.plot([when(t) for t, _, _ in points], [r for _, _, r in points], ".-", color="tab:blue", lw=1,
                         ms=3, label=None if i else "samples/s")
        ax_rate.set_ylim(bottom=0)
        ax_step = ax_rate.twinx()
        ax_step.plot([when(t) for t, _, _ in timeline.throughput], [s for _, s, _ in timeline.throughput], ".",
                     color="tab:gray", ms=2, label="step")
        ax_step.set_ylabel("step")
    ax_rate.set_ylabel("samples/s")
    ax_rate.set_xlabel("wall clock (UTC)")
    ax_rate.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    fig.autofmt_xdate()
    fig.tight_layout()
    return fig


def _labels(ax) -> set[str]:
    return set(ax.get_legend_handles_labels()[1])


def _marks(ax, xs: Iterable[float], marker: str, color: str, label: str, size: float) -> None:
    xs = list(xs)
    if xs:
        ax.plot(xs, [0] * len(xs), marker, color=color, ms=size, ls="none",
                label=label if label not in _labels(ax) else None)


def save_png(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png")
    finally:
        plt.close(fig)
    write_file(path, buffer.getvalue())  # never through a link planted at the default path
    return path
