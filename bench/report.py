"""The benchmark's outputs: the machine it ran on, a markdown table (printed, and the one in
bench/README.md), results.json and a PNG chart of the ratios against their targets."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from .common import Row, Settings

HEADER = ("| | baseline | hpc-ddp | ratio | paired | target | met |", "|---|---:|---:|---:|---:|---:|:---:|")


def machine() -> dict[str, Any]:
    import torch
    import torchvision

    def first(path: str, key: str) -> str | None:
        try:
            with open(path) as fh:
                return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(key)), None)
        except OSError:
            return None

    mem_kb = first("/proc/meminfo", "MemTotal")
    return {
        "cpu": first("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "hostname": platform.node(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return ""
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "steps":
        return f"{value:g} step" + ("" if value == 1 else "s")
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:,.1f} {unit}"


def line(row: Row) -> str:
    if row.skipped:
        return f"| {row.name} | | | | | | {row.skipped} |"
    if row.extra.get("error"):
        return f"| {row.name} | | | | | | error: {row.extra['error']} |"
    base = f"{_num(row.baseline_value, row.unit)} ({row.baseline})" if row.baseline else ""
    how = f"{row.aggregate if row.aggregate in ('median', 'mean') else 'worst'} of {row.repeats}"
    ours = _num(row.ours_value, row.unit) + (f" ({how})" if row.repeats > 1 else "")
    ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
    paired = f"{row.paired_ratio:.2f}" if row.paired_ratio is not None else ""
    met = {True: "yes", False: "**no**", None: ""}[row.met]
    return f"| {row.name} | {base} | {ours} | {ratio} | {paired} | {row.target or ''} | {met} |"


def table(rows: list[Row]) -> str:
    return "\n".join([*HEADER, *(line(r) for r in rows)])


def write_json(path: Path, rows: list[Row], mach: dict[str, Any], s: Settings, seconds: float,
               earlier: list[dict[str, Any]] = ()) -> None:
    """`earlier`: the runs whose rows were kept (run.py --update), each {machine, settings, seconds}."""
    doc = {"machine": mach, "settings": dataclasses.asdict(s), "seconds": round(seconds, 1),
           "earlier_runs": list(earlier), "rows": [r.to_json() for r in rows]}
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def read_json(path: Path) -> tuple[list[Row], dict[str, Any]]:
    doc = json.loads(path.read_text())
    return [Row.from_json(r) for r in doc["rows"]], doc


def _title(rows: list[Row], mach: dict[str, Any]) -> str:
    """The machine of the run; rows kept from earlier runs (--update) say where each was taken instead."""
    runs = {r.extra.get("taken") for r in rows if r.skipped is None}
    if len(runs) > 1:
        return f"hpc-ddp benchmark: rows from {len(runs)} runs (each row's machine: results.json, extra.taken)"
    return (f"hpc-ddp benchmark: {mach['cpu']}, {mach['cores']} cores" + (f", {mach['gpu']}" if mach.get("gpu") else "")
            + f", {mach['date'][:10]}")


def chart(path: Path, rows: list[Row], mach: dict[str, Any]) -> None:
    """One horizontal bar per row: the ratio (or, for absolute rows, the value) and its target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratio_rows = [r for r in rows if not (r.target and r.target.on == "value")]
    value_rows = [r for r in rows if r.target and r.target.on == "value"]
    panels = [(rs, label, fn, ref) for rs, label, fn, ref in (
        (ratio_rows, "hpc-ddp / baseline (ratio); black tick: target", lambda r: r.ratio, 1.0),
        (value_rows, "value (steps); black tick: target", lambda r: r.ours_value, None)) if rs]
    heights = [len(p[0]) for p in panels] or [1]
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, 0.45 * sum(heights) + 1.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (rs, label, fn, ref) in zip(axes[:, 0], panels):
        _panel(ax, rs, label, fn, ref)
    fig.suptitle(_title(rows, mach), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, rows: list[Row], xlabel: str, value, reference: float | None) -> None:
    labels = [f"{r.name}  [{r.target}]" if r.target else r.name for r in rows][::-1]
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=9)
    top = 0.0
    for i, r in enumerate(rows[::-1]):
        v = value(r)
        if v is None:
            ax.text(0.02, i, r.skipped or r.extra.get("error", "not measured"), va="center", fontsize=8,
                    transform=ax.get_yaxis_transform())
            continue
        color = {True: "tab:green", False: "tab:red", None: "tab:gray"}[r.met]
        ax.barh(i, v, color=color, height=0.6)
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
        top = max(top, v)
        if r.target:
            ax.plot([r.target.value] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2)
            top = max(top, r.target.value)
    if reference is not None:
        ax.axvline(reference, color="gray", linestyle=":", linewidth=1)
    ax.set_xlim(0, max(top * 1.2, 1.5))
    ax.set_ylim(-0.7, max(len(rows), 1) - 0.3)
