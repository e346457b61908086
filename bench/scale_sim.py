"""`make scale`: hpc-ddp's launcher-side paths at 2 to 256 nodes x 8 ranks, simulated on one machine,
and how each cost grows with the number of nodes. Writes bench/scale_results.json and prints the table.

    python bench/scale_sim.py                        # 2, 8, 32, 128, 256 nodes (about 6 minutes on 2 cores),
                                                      # stored as "after", compared with "before"
    python bench/scale_sim.py --nodes 2,8 --label try # a quick look; keeps the other labels' results
    python bench/scale_sim.py --callers 64            # failure paths: only 64 survivors call (for code
                                                      # whose every survivor does O(world) requests)
    python bench/scale_sim.py --nodes 2 --quick --out /tmp/s.json  # every path, short holds (the smoke test)
    python bench/scale_sim.py --report                # the tables of the runs in scale_results.json

Each size runs in fresh processes (bench/scale/): the staging step (sim_stage), the trainer's
rendezvous against a real TCPStore (sim_rendezvous), the attempts policy plus `status` over a run
dir of 2,048 ranks' logs with hundreds of attempts (sim_rundir), and a resume on half the ranks
(sim_elastic: the position arithmetic and the sampler; also run at 1,024 nodes every time). The ranks are threads; the files, the
store and the functions are the real ones. bench/README.md ("Scale") explains every column.

Growth: the exponent k of cost ~ nodes^k between the smallest and the largest size (1 = linear), and
the local one between the two largest sizes, which the 1,024-node trend uses. The trend only extends the
last step: where the code caps a rate (the pollers' backoff), the cap is the answer, and bench/README.md
works out the 1,024-node numbers from the code's constants instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "scale_results.json"
SIZES = (2, 8, 32, 128, 256)
BASELINE = "before"  # the run on the code before the scale fixes (f14e276, ad61bbe, 5517c1d, 62ddd29)

# (column, phase, path in that phase's result, unit): what the table shows and the growth is computed for.
COLUMNS = [
    ("env derivation", "stage", ("env_ms_per_rank",), "ms/rank"),
    ("staging: all-ready after the last node", "stage", ("time_to_all_ready_s",), "s"),
    ("staging: shared-FS ops/s while waiting (asked)", "stage", ("shared_ops_per_s_asked",), "ops/s"),
    ("staging: shared-FS ops/s (measured here)", "stage", ("shared_ops_per_s_measured",), "ops/s"),
    ("staging: shared-FS ops, whole step", "stage", ("shared_ops_total",), "ops"),
    ("join: all-ready after the last rank", "rdv", ("join", "time_to_all_ready_s"), "s"),
    ("join: store requests/s while waiting (asked)", "rdv", ("join", "requests_per_s_asked"), "req/s"),
    ("join: store requests/s (measured here)", "rdv", ("join", "requests_per_s_measured"), "req/s"),
    ("health check: requests per rank", "rdv", ("health", "requests_per_rank"), "req"),
    ("heartbeats: store requests/s", "rdv", ("heartbeats", "requests_per_s"), "req/s"),
    ("a rank stops beating: requests until all know", "rdv", ("fail_peer", "requests"), "req"),
    ("a rank misses the health check: requests", "rdv", ("fail_health", "requests"), "req"),
    ("a rank misses a barrier (join, checkpoint): requests", "rdv", ("fail_barrier", "requests"), "req"),
    ("attempts begin+end: ms per attempt", "rundir", ("attempts", "ms_per_attempt"), "ms"),
    ("attempts begin+end: shared-FS ops per attempt", "rundir", ("attempts", "shared_ops_per_attempt"), "ops"),
    ("status: seconds", "rundir", ("status", "seconds"), "s"),
    ("status: shared-FS ops", "rundir", ("status", "shared_ops"), "ops"),
    ("status: directory entries read", "rundir", ("status", "entries_listed"), "entries"),
    ("resume on half the ranks: sampler, ms per rank", "elastic", ("sampler_ms_per_rank",), "ms"),
    ("resume on half the ranks: shares checked, all ranks", "elastic", ("check_ms_all_ranks",), "ms"),
]
ELASTIC_AT = 1024   # issue 32: the position arithmetic and the sampler at 1,024 nodes x 8 ranks, every run


def say(message: str) -> None:
    print(f"[scale {time.monotonic() - _T0:5.0f}s] {message}", file=sys.stderr, flush=True)


_T0 = time.monotonic()


def _phase(module: str, nodes: int, per_node: int, extra: list[str], timeout: float = 900) -> dict:
    argv = [sys.executable, "-m", f"bench.scale.{module}", "--nodes", str(nodes), "--per-node", str(per_node), *extra]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise RuntimeError(f"{module} at {nodes} nodes failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _value(result: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result if isinstance(result, (int, float)) else None


def exponent(x0: float, y0: float | None, x1: float, y1: float | None) -> float | None:
    """k in y ~ x^k between two points; None where a value is missing or zero."""
    if not y0 or not y1 or y0 <= 0 or y1 <= 0 or x0 == x1:
        return None
    return math.log(y1 / y0) / math.log(x1 / x0)


def growth(sizes: dict[int, dict], target: int = 1024) -> dict[str, dict]:
    """Per column: the values by size, the exponent over the whole range and over the last step, and
    the value at `target` nodes if the last step's exponent holds."""
    out = {}
    nodes = sorted(sizes)
    for name, phase, path, unit in COLUMNS:
        values = {n: _value(sizes[n].get(phase, {}), path) for n in nodes}
        lo, hi = nodes[0], nodes[-1]
        whole = exponent(lo, values[lo], hi, values[hi])
        last = exponent(nodes[-2], values[nodes[-2]], hi, values[hi]) if len(nodes) > 1 else None
        known = values[hi] is not None and last is not None
        at_target = values[hi] * (target / hi) ** max(last, 0.0) if known else None
        out[name] = {"unit": unit, "values": values, "exponent": whole, "exponent_last_step": last,
                     f"at_{target}_nodes": at_target}
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3f}"


def _k(k: float | None) -> str:
    return "-" if k is None else f"{k:.2f}"


def _markdown(rows: list[list[str]]) -> str:
    rows = [rows[0], ["---"] + ["---:"] * (len(rows[0]) - 1), *rows[1:]]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def table(grown: dict[str, dict], nodes: list[int]) -> str:
    rows = [["", *[f"{n} nodes" for n in nodes], "growth k", "1,024 nodes (trend)"]]
    for name, g in grown.items():
        rows.append([f"{name} ({g['unit']})", *[_fmt(g["values"][n]) for n in nodes],
                     _k(g["exponent"]), _fmt(g["at_1024_nodes"])])
    return _markdown(rows)


def compare(old: dict[str, dict], new: dict[str, dict], nodes: list[int]) -> str:
    """One table of two runs: "old → new" in every cell, for the sizes both have."""
    def cell(a: str, b: str) -> str:
        return b if a == b else f"{a} → {b}"

    rows = [["", *[f"{n} nodes" for n in nodes], "growth k", "1,024 nodes (trend)"]]
    for name, g in new.items():
        o = old.get(name, {"values": {}, "exponent": None, "at_1024_nodes": None})
        rows.append([f"{name} ({g['unit']})", *[cell(_fmt(o["values"].get(n)), _fmt(g["values"][n])) for n in nodes],
                     cell(_k(o["exponent"]), _k(g["exponent"])),
                     cell(_fmt(o["at_1024_nodes"]), _fmt(g["at_1024_nodes"]))])
    return _markdown(rows)


def _sizes(run: dict) -> dict[int, dict]:
    return {int(n): r for n, r in run["sizes"].items()}


def _title(label: str, run: dict) -> str:
    return (f"{label}: commit {run['commit']}, {run['date']}, {run['machine']}, {run['seconds']} s"
            + (f", failure paths with {run['callers']} callers" if run.get("callers") else ""))


def _comparison(runs: dict[str, dict], label: str) -> str | None:
    """`label` against the baseline run, over the sizes both have; None without a baseline."""
    if label == BASELINE or BASELINE not in runs or label not in runs:
        return None
    old, new = _sizes(runs[BASELINE]), _sizes(runs[label])
    common = sorted(set(old) & set(new))
    if len(common) < 2:
        return None
    return (f"\n{BASELINE} → {label}\n"
            + compare(growth({n: old[n] for n in common}), growth({n: new[n] for n in common}), common))


def report(path: Path) -> int:
    """Each stored run's table, the growth recomputed from its raw results, then each against the baseline."""
    runs = json.loads(path.read_text())["runs"]
    for label, run in runs.items():
        sizes = _sizes(run)
        print(f"\n{_title(label, run)}")
        print(table(growth(sizes), sorted(sizes)))
    for label in runs:
        text = _comparison(runs, label)
        if text:
            print(text)
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hpc_ddp", "bench/scale"], cwd=REPO,
                           capture_output=True, text=True, check=False).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default=",".join(map(str, SIZES)), help="comma-separated node counts")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--callers", type=int, default=None, help="survivors that call in the failure paths")
    parser.add_argument("--label", default="after", help="key of this run in scale_results.json")
    parser.add_argument("--quick", action="store_true", help="short holds and windows in every phase (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--phase-timeout", type=float, default=900, help="seconds one phase at one size may take")
    parser.add_argument("--report", action="store_true", help="print the tables of the runs already in --out")
    args = parser.parse_args()
    if args.report:
        return report(args.out)
    nodes = [int(n) for n in args.nodes.split(",")]
    started = time.monotonic()
    sizes: dict[int, dict] = {}
    quick = ["--quick"] if args.quick else []
    for n in nodes:
        say(f"{n} nodes x {args.per_node} ranks")
        t, sizes[n], took = args.phase_timeout, {}, {}
        for phase, module, extra in (("stage", "sim_stage", quick), ("rundir", "sim_rundir", quick),
                                     ("elastic", "sim_elastic", quick),
                                     ("rdv", "sim_rendezvous",
                                      quick + (["--callers", str(args.callers)] if args.callers else []))):
            t0 = time.monotonic()
            sizes[n][phase] = _phase(module, n, args.per_node, extra, t)
            took[phase] = round(time.monotonic() - t0, 1)
        sizes[n]["phase_seconds"] = took
    grown = growth(sizes)
    print(table(grown, nodes))
    at_scale = _phase("sim_elastic", ELASTIC_AT, args.per_node, quick, args.phase_timeout)
    print(f"\nresume on another size at {ELASTIC_AT} nodes x {args.per_node} ranks ({at_scale['world']:,} ranks, saved by "
          f"{at_scale['saved_world']:,}): resize {at_scale['resize_us']} us, one rank's sampler "
          f"{at_scale['sampler_ms_per_rank']} ms, every rank's share checked exact in {at_scale['check_ms_all_ranks']} ms")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.setdefault("runs", {})[args.label] = {
        "commit": _commit(), "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "per_node": args.per_node, "callers": args.callers, "quick": args.quick,
        "seconds": round(time.monotonic() - started),
        "growth": {name: {k: v for k, v in g.items() if k != "values"} for name, g in grown.items()},
        "sizes": {str(n): r for n, r in sizes.items()},
        f"elastic_at_{ELASTIC_AT}_nodes": at_scale,
    }
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    text = _comparison(results["runs"], args.label)
    if text:
        print(text)
    say(f"done in {time.monotonic() - started:.0f} s; wrote {args.out.name} [{args.label}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
