"""`make bench`: every comparison of bench/README.md in one run; writes bench/results.json and
bench/results.png and prints the table.

    python bench/run.py                 # the full suite (about 10 minutes on 2 cores)
    python bench/run.py --quick         # every code path, few steps, 1 repeat (BENCH_QUICK=1 too);
                                        # writes bench/results-quick.*, not the published results
    python bench/run.py --only training,checkpoint
    python bench/run.py --only gpu --update   # re-take sections, keep the other rows of results.json
    python bench/run.py --only gpu --set gpu_repeats=2 --set gpu_steps=80   # other settings (recorded)

Sections: training, startup, resume, checkpoint, async_checkpoint, staging, snapshot, gpu and gpu_data (skipped
without a GPU), goodput, fsdp.
A section that fails becomes an error row; the others still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python bench/run.py`: make `bench` importable as a package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import (
    async_ckpt_bench,
    ckpt_bench,
    fsdp_bench,
    goodput_bench,
    gpu_bench,
    gpu_data_bench,
    report,
    resume_bench,
    snapshot_bench,
    stage_bench,
    startup_bench,
    train_bench,
)
from bench.common import REPO, Row, Settings, Workspace, say, settings

SECTIONS = {"training": train_bench.run, "startup": startup_bench.run, "resume": resume_bench.run,
            "checkpoint": ckpt_bench.run, "async_checkpoint": async_ckpt_bench.run, "staging": stage_bench.run,
            "snapshot": snapshot_bench.run, "gpu": gpu_bench.run, "gpu_data": gpu_data_bench.run,
            "goodput": goodput_bench.run, "fsdp": fsdp_bench.run}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="hpc-ddp benchmarks against plain alternatives (bench/README.md).")
    p.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK") == "1",
                   help="few steps, 1 repeat: checks the harness, not the numbers")
    p.add_argument("--only", help=f"comma-separated sections ({', '.join(SECTIONS)})")
    p.add_argument("--out", help="results path without suffix [default: bench/results, or bench/results-quick]")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs of every run)")
    p.add_argument("--update", action="store_true",
                   help="replace only the rows of the sections run in the existing results file; keep the others")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="change one setting of bench/common.py's Settings (repeatable); results.json records them")
    args = p.parse_args(argv)
    args.sections = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def overridden(s: Settings, pairs: list[str]) -> Settings:
    """`s` with KEY=VALUE changes, each value read as the type the setting has."""
    changes = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key == "quick" or key not in {f.name for f in dataclasses.fields(s)}:
            raise ValueError(f"--set {pair!r}: not KEY=VALUE with KEY a setting of bench/common.py's Settings")
        kind = type(getattr(s, key))
        try:
            changes[key] = kind(value)
        except ValueError:
            raise ValueError(f"--set {pair!r}: {key} takes a {kind.__name__}") from None
    return dataclasses.replace(s, **changes)


def run_sections(ws: Workspace, names: list[str]) -> list[Row]:
    rows = []
    for name in names:
        started = time.monotonic()
        try:
            rows += SECTIONS[name](ws)
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others' numbers
            traceback.print_exc()
            rows.append(Row(name, f"{name}: failed", "", "", None,
                            extra={"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}))
        say(f"{name}: {time.monotonic() - started:.0f} s")
    return rows


def cleanup_node_dirs(root: Path) -> None:
    """The local executor's per-node temp dirs (/tmp/hpc-ddp-local-*) of the runs made here."""
    from hpc_ddp.launch.executors.local import node_scratch

    for spec in root.rglob("spec.json"):
        shutil.rmtree(node_scratch(str(spec.parent), 0).parent, ignore_errors=True)


def merged(path: Path, rows: list[Row], sections: list[str]) -> tuple[list[Row], list[dict]]:
    """--update: the rows of `path` from other sections, with the new ones, in section order; and the
    earlier runs those rows came from."""
    if not path.exists():
        return rows, []
    kept, doc = report.read_json(path)
    earlier = [*doc.get("earlier_runs", []), {k: doc[k] for k in ("machine", "settings", "seconds")}]
    order = list(SECTIONS)
    rows = [r for r in kept if r.section not in sections] + rows
    return sorted(rows, key=lambda r: order.index(r.section) if r.section in order else len(order)), earlier


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        s = overridden(settings(args.quick), args.overrides)
    except ValueError as exc:
        print(f"bench/run.py: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else REPO / "bench" / ("results-quick" if s.quick else "results")
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="hpc-ddp-bench-"))
    say(f"{'quick' if s.quick else 'full'} run of {', '.join(args.sections)}; scratch {root}")
    try:
        rows = run_sections(Workspace(root, s), args.sections)
    finally:
        cleanup_node_dirs(root)
        if args.keep:
            say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    seconds, mach = time.monotonic() - started, report.machine()
    failed = any(r.extra.get("error") for r in rows)
    for row in rows:
        row.extra["taken"] = f"{mach['date']} on {mach['hostname']}" + (f" ({mach['gpu']})" if mach["gpu"] else "")
    rows, earlier = merged(out.with_suffix(".json"), rows, args.sections) if args.update else (rows, [])
    report.write_json(out.with_suffix(".json"), rows, mach, s, seconds, earlier)
    report.chart(out.with_suffix(".png"), rows, mach)
    print(f"\n{mach['cpu']}, {mach['cores']} cores, {mach['ram_gib']} GiB, torch {mach['torch']}"
          + (f", {mach['gpu']}" if mach["gpu"] else ", no GPU") + f", {mach['date']}; {seconds / 60:.1f} min\n")
    print(report.table(rows))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
