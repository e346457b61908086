"""`hpc-ddp plot RUN_DIR`: training loss and eval accuracy over steps from metrics.jsonl, with the
stops and resumes from events.jsonl marked, as one PNG. (Where the wall-clock time went is
`hpc_ddp.watch.timeline`.)"""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.rundir import RunDir

__all__ = ["plot_run", "figure"]


def plot_run(run_dir: Path, output: Path | None = None) -> Path:

    from hpc_ddp.watch.timeline import save_png

    return save_png(figure(run_dir), output or RunDir(run_dir).picture("training"))


def figure(run_dir: Path):
    """The matplotlib Figure `plot_run` saves."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute or login nodes
    import matplotlib.pyplot as plt

    from hpc_ddp.watch.status import records

    metrics = records(RunDir(run_dir).metrics)
    events = records(RunDir(run_dir).events)
    train = [m for m in metrics if isinstance(m.get("loss"), (int, float)) and isinstance(m.get("step"), int)]
    evals = [m for m in metrics if isinstance(m.get("eval_acc"), (int, float)) and isinstance(m.get("step"), int)]
    if not train:
        raise UserError(f"{RunDir(run_dir).metrics} has no training records yet")
    fig, ax_loss = plt.subplots(figsize=(9, 4.5), dpi=110)
    for i, segment in enumerate(_segments(train)):
        # One line per stretch of steps: a resume goes back to its checkpoint's step, and a line drawn
        # back across the steps redone would hide them.
        ax_loss.plot([m["step"] for m in segment], [m["loss"] for m in segment], color="tab:blue", lw=1.2,
                     label=None if i else "training loss", gid="loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    if evals:
        ax_acc = ax_loss.twinx()
        ax_acc.plot([m["step"] for m in evals], [100 * m["eval_acc"] for m in evals], "o-", color="tab:green",
                    label="eval accuracy (%)")
        ax_acc.set_ylabel("eval accuracy (%)")
        ax_acc.set_ylim(0, 100)
    _mark_events(ax_loss, events)
    ax_loss.set_title(f"{run_dir.name}: {len(train)} logged steps, "
                      f"{sum(1 for e in events if e.get('event') == 'resume')} resume(s)")
    handles = [h for ax in fig.axes for h in ax.get_legend_handles_labels()[0]]
    ax_loss.legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def _segments(train: list[dict]) -> list[list[dict]]:
    """The training records split where the step goes back (a resume from an earlier checkpoint)."""
    segments: list[list[dict]] = []
    for record in train:
        if not segments or record["step"] <= segments[-1][-1]["step"]:
            segments.append([])
        segments[-1].append(record)
    return segments


def _mark_events(ax, events: list[dict]) -> None:
    """A stop and the resume after it are usually at the same step (the stop checkpoint is where the next
    attempt resumes), so stops take the upper half of the axes and resumes the lower, each with its step
    written next to it: neither hides the other."""
    # (color, line style, y range in axes fractions, y of the text)
    styles = {"signal": ("tab:red", "--", (0.5, 1.0), 0.97, "stop"),
              "resume": ("tab:purple", ":", (0.0, 0.5), 0.03, "resume")}
    labelled = set()
    for event in events:
        style = styles.get(event.get("event"))
        step = event.get("step")
        if style is None or not isinstance(step, (int, float)):
            continue
        color, line, (low, high), text_y, label = style
        ax.axvline(step, low, high, color=color, ls=line, lw=1.2, gid=label,
                   label=None if label in labelled else label)
        ax.text(step, text_y, f" {label} {step}", transform=ax.get_xaxis_transform(), color=color, fontsize=7,
                rotation=90, ha="left", va="top" if label == "stop" else "bottom")
        labelled.add(label)
