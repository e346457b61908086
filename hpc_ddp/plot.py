"""`hpc-ddp plot RUN_DIR`: training loss and eval accuracy over steps from metrics.jsonl, with the
stops and resumes from events.jsonl marked, as one PNG."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .events import read_jsonl

__all__ = ["plot_run"]


def plot_run(run_dir: Path, output: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on compute or login nodes
    import matplotlib.pyplot as plt

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_acc" in m]
    if not train:
        raise UserError(f"{run_dir / 'metrics.jsonl'} has no training records yet")
    fig, ax_loss = plt.subplots(figsize=(9, 4.5), dpi=110)
    ax_loss.plot([m["step"] for m in train], [m["loss"] for m in train], color="tab:blue", lw=1.2,
                 label="training loss")
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
    path = output or run_dir / "training.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _mark_events(ax, events: list[dict]) -> None:
    styles = {"signal": ("tab:red", "--", "stop"), "resume": ("tab:purple", ":", "resume")}
    labelled = set()
    for event in events:
        style = styles.get(event.get("event"))
        if style is None:
            continue
        color, line, label = style
        ax.axvline(event.get("step", 0), color=color, ls=line, lw=1,
                   label=None if label in labelled else label)
        labelled.add(label)
