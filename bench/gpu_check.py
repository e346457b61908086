"""`make gpu-check`: everything a visit to a GPU machine has to prove, in one command and one summary
(issue 40). Three parts, each recorded whatever the others did:

1. tests: `make test-gpu`'s set (tests/gpu and tests/trainer/test_session.py) under pytest;
2. trainer: the built-in trainer on an ImageFolder of JPEGs (`make-dataset imagefolder --jpeg`), ResNet-50,
   once for each data_path (device, cpu) x precision (bf16, fp32). Each must reach its last step with a
   finite loss, and the device path's loss at the last step must be within 10% of the CPU path's in the
   same precision;
3. bench: the gpu_data rows of bench/run.py (the trainer against the model fed from GPU memory, and against
   the seeds' fp32 eager loop), written to bench/results.json as `--update` does.

The summary goes to OUT/gpu-check.json and OUT/gpu-check.md: each part's outcome, the machine, and which
GPU defaults this visit proved (what to add to hpc_ddp/trainer/speed.PROVEN, with the GPU and the date).
Exit 0 when every part passed.

A lent GPU machine has no network, and its python3 has torch, torchvision, click and jinja2 but not
submitit or pytest: `make gpu-wheels` (here) downloads those as wheels into .gpu-wheels/, which travels with
the project; this script unpacks them into OUT/site and puts that folder on the path of everything it runs.
It runs with the machine's own python3 (`make gpu-check GPU_PY=python3`, the default), never a venv.

Without a GPU, `--smoke` runs the same parts small on the CPU (a tiny CNN on 64 px JPEGs, a few steps;
the GPU tests skip, and one test of test_session.py stands in for the file): what CI runs, to keep the
command working. Its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.10           # the device path's loss at the last step, against the CPU path's
COMBOS = [("device", "bf16"), ("cpu", "bf16"), ("device", "fp32"), ("cpu", "fp32")]


def settings(smoke: bool) -> dict:
    if smoke:
        return dict(model="cnn", size=64, batch=4, steps=6, workers=1, per_class=4, gpus=0, log_every=1)
    return dict(model="resnet50", size=224, batch=128, steps=40, workers=12, per_class=520, gpus=1, log_every=5)


def unpack_wheels(wheels: Path, site: Path) -> list[str]:
    """Each *.whl under `wheels` extracted into `site` (pure-Python wheels are zip files laid out as
    site-packages); returns the names."""
    names = []
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
        names.append(wheel.name)
    return names


def child_env(site: Path, smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO), str(site), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["HPC_DDP_REGISTRY"] = str(site.parent / "registry.jsonl")   # never the user's list of runs
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run(argv: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int, float]:
    """Run `argv` with its output in `log`; (exit code, seconds). 124 when it ran past `timeout`."""
    start = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = 124
    return code, round(time.monotonic() - start, 1)


def tail(log: Path, lines: int = 6) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []


def part_tests(out: Path, env: dict[str, str], smoke: bool) -> dict:
    log = out / "tests.log"
    notes = out / "decode-race.json"
    env = {**env, "HPC_DDP_GPU_CHECK_NOTES": str(notes)}
    # The smoke run checks the wiring only (pytest from the unpacked wheels, the notes file): make test runs
    # test_session.py itself, so here one of its tests stands in for the 13 s file.
    session = "tests/trainer/test_session.py" + ("::test_the_public_surface_is_listed_and_resolves" if smoke else "")
    code, seconds = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", session],
                        log, env, timeout=300)
    result = {"passed": code == 0, "exit_code": code, "seconds": seconds, "tail": tail(log, 3), "log": str(log)}
    if notes.exists():
        result["decode_race"] = json.loads(notes.read_text())
    return result


def job_file(path: Path, data: str, s: dict, data_path: str, precision: str) -> None:
    path.write_text(f"""nodes = 1
tasks_per_node = 1
gpus = {s['gpus']}
[train]
dataset = "imagefolder"
data_dir = {json.dumps(data)}
model = "{s['model']}"
image_size = {s['size']}
epochs = 1000
max_steps = {s['steps']}
batch_size = {s['batch']}
lr = 0.05
num_workers = {s['workers']}
log_every = {s['log_every']}
eval_every_epoch = false
checkpoint_every_steps = 0
checkpoint_every_minutes = 0
data_path = "{data_path}"
precision = "{precision}"
""")


def last_loss(run_dir: Path) -> tuple[int, float] | None:
    records = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("loss"), (int, float)):
                records.append(record)
    return (records[-1]["step"], float(records[-1]["loss"])) if records else None


# What a run writes under --out (`planned`) is recorded in MADE before it is written, so a run replaces only
# what an earlier run made, never a file or folder of the user's of the same name.
MADE = ".gpu-check-made"


def made_here(out: Path) -> set[str]:
    try:
        names = json.loads((out / MADE).read_text())
    except (OSError, ValueError):
        return set()
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


PARTS = ("tests", "trainer", "bench")


def planned(parts: list[str]) -> list[str]:
    """Every name under --out that a run of `parts` writes or replaces (files and folders)."""
    names = ["site", "gpu-check.json", "gpu-check.md"]
    if "tests" in parts:
        names += ["tests.log", "decode-race.json"]
    if "trainer" in parts:
        names += ["jpegs", "make-dataset.log"]
        for data_path, precision in COMBOS:
            name = f"trainer-{data_path}-{precision}"
            names += [name, f"{name}.toml", f"{name}.log"]
    if "bench" in parts:
        names += ["bench.log", "bench-smoke"]
    return names


def replaceable(out: Path, parts: list[str] = list(PARTS)) -> list[str]:
    """What a run would write over that it may not: there, and not made by gpu-check (MADE)."""
    ours = made_here(out)
    return [n for n in planned(parts) if ((out / n).exists() or (out / n).is_symlink()) and n not in ours]


def claim(out: Path, parts: list[str]) -> None:
    """Record every name this run writes as gpu-check's, before any is written (`replaceable` found none of
    them to be another's), so a later run replaces them and nothing else."""
    (out / MADE).write_text(json.dumps(sorted(made_here(out) | set(planned(parts)))) + "\n")


def fresh(out: Path, name: str) -> Path:
    """out/name, emptied: removed only where an earlier run made it (`replaceable` refused the rest up front);
    recorded as made by this run before anything is written into it."""
    target = out / name
    if target.is_symlink() or (target.exists() and name not in made_here(out)):
        raise RuntimeError(f"{target} is not gpu-check's own: not touched")
    if target.exists():
        shutil.rmtree(target)
    (out / MADE).write_text(json.dumps(sorted(made_here(out) | {name})) + "\n")
    return target


def part_trainer(out: Path, env: dict[str, str], smoke: bool) -> dict:
    s = settings(smoke)
    data = fresh(out, "jpegs")
    code, seconds = run([sys.executable, "-m", "hpc_ddp", "make-dataset", "imagefolder", str(data), "--jpeg",
                         "--size", str(s["size"]), "--train", str(s["per_class"]), "--test", "2"],
                        out / "make-dataset.log", env, timeout=300)
    if code:
        return {"passed": False, "error": "make-dataset failed", "tail": tail(out / "make-dataset.log")}
    rows = []
    for data_path, precision in COMBOS:
        name = f"trainer-{data_path}-{precision}"
        job, run_dir = out / f"{name}.toml", fresh(out, name)
        job_file(job, str(data), s, data_path, precision)
        code, seconds = run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--run-dir",
                             str(run_dir), str(job)], out / f"{name}.log", env, timeout=420)
        last = last_loss(run_dir)
        finite = last is not None and math.isfinite(last[1])
        reached = last is not None and last[0] == s["steps"]
        rows.append({"data_path": data_path, "precision": precision, "exit_code": code, "seconds": seconds,
                     "last_step": last and last[0], "loss": last and last[1],
                     "trains": code == 0 and finite and reached,
                     "result": (f"trains: loss {last[1]:.3f} at step {last[0]}" if code == 0 and finite and reached
                                else f"fails: exit {code}" + (f", loss {last[1]} at step {last[0]}" if last else "")),
                     "tail": [] if code == 0 else tail(out / f"{name}.log")})
    comparisons = []
    for precision in ("bf16", "fp32"):
        device, cpu = (next(r for r in rows if (r["data_path"], r["precision"]) == (p, precision))
                       for p in ("device", "cpu"))
        close = device["trains"] and cpu["trains"] and abs(device["loss"] - cpu["loss"]) <= TOLERANCE * abs(cpu["loss"])
        comparisons.append({"precision": precision, "device_loss": device["loss"], "cpu_loss": cpu["loss"],
                            "within": TOLERANCE, "passed": bool(close)})
    return {"passed": all(r["trains"] for r in rows) and all(c["passed"] for c in comparisons), "settings": s,
            "rows": rows, "comparisons": comparisons}


def part_bench(out: Path, env: dict[str, str], smoke: bool) -> dict:
    log = out / "bench.log"
    argv = [sys.executable, "bench/run.py", "--only", "gpu_data", "--set", "gpu_repeats=1"]
    if smoke:
        env = {**env, "BENCH_GPU_DEVICE": "cpu"}
        argv += ["--out", str(out / "bench-smoke")]
    else:
        argv += ["--update", "--set", "gpu_steps=60", "--set", "gpu_warm=20"]
    code, seconds = run(argv, log, env, timeout=420)
    rows = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        _, found, row = line.partition("] ")[2].partition("row: ")   # bench/common.say's "[bench  12s]   row: {...}"
        if found:
            try:
                rows.append(json.loads(row))
            except ValueError:
                pass
    return {"passed": code == 0 and bool(rows), "exit_code": code, "seconds": seconds, "rows": rows,
            "tail": [] if code == 0 else tail(log)}


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
            "host": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def proved(summary: dict) -> list[str]:
    """The GPU defaults this visit proved: each trained to a finite loss on the GPU (never on --smoke)."""
    if summary["smoke"] or not summary["machine"]["gpu"]:
        return []
    trainer = summary["parts"].get("trainer", {})
    rows = {(r["data_path"], r["precision"]): r for r in trainer.get("rows", [])}
    found = []
    if rows.get(("cpu", "bf16"), {}).get("trains") and rows.get(("device", "bf16"), {}).get("trains"):
        found += ["precision", "channels_last"]
    if trainer.get("passed"):
        found.append("data_path")
    return found


def markdown(summary: dict) -> str:
    m = summary["machine"]
    lines = [f"# make gpu-check: {'passed' if summary['passed'] else 'FAILED'}", "",
             f"{m['gpu'] or 'no GPU (smoke test on the CPU: not a proof)'}, torch {m['torch']}, {m['cores']} cores, "
             f"{m['date']}, {summary['seconds']:.0f} s", ""]
    parts = summary["parts"]
    if "tests" in parts:
        t = parts["tests"]
        lines += [f"## tests: {'passed' if t['passed'] else 'FAILED'} ({t['seconds']} s)", "", *t["tail"], ""]
        if "decode_race" in t:
            lines += [f"decode race: {json.dumps(t['decode_race'])}", ""]
    if "trainer" in parts:
        t = parts["trainer"]
        lines += [f"## trainer: {'passed' if t['passed'] else 'FAILED'}", "", "| data_path | precision | result |",
                  "|---|---|---|"]
        lines += [f"| {r['data_path']} | {r['precision']} | {r['result']} |" for r in t.get("rows", [])]
        lines += [""] + [f"- {c['precision']}: device {c['device_loss']} vs cpu {c['cpu_loss']}: "
                         f"{'within' if c['passed'] else 'NOT within'} {c['within']:.0%}" for c in t.get("comparisons", [])]
        lines += [f"- {t['error']}"] if "error" in t else []
        lines.append("")
    if "bench" in parts:
        b = parts["bench"]
        lines += [f"## bench (gpu_data): {'passed' if b['passed'] else 'FAILED'} ({b['seconds']} s)", ""]
        lines += [f"- {r.get('name')}: {r.get('ours_value')} (target {r.get('target')}: "
                  f"{'met' if r.get('met') else 'missed'})" for r in b["rows"]] + b["tail"] + [""]
    lines += ["## proved", "", ", ".join(summary["proved"]) or "nothing (add a Proof to hpc_ddp/trainer/speed.PROVEN "
              "only for what a GPU visit proved)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "gpu-check"),
                   help="folder for the summary and logs [default: $OUT, else ./gpu-check]")
    p.add_argument("--wheels", default=str(REPO / ".gpu-wheels"), help="wheels to put on the path [.gpu-wheels]")
    p.add_argument("--smoke", action="store_true", help="run small on the CPU (no GPU needed; not a proof)")
    p.add_argument("--parts", default="tests,trainer,bench", help="comma-separated: tests, trainer, bench")
    args = p.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts:  # a check that ran nothing must not say "passed"
        p.error("--parts: name at least one of tests, trainer, bench")
    unknown = [part for part in parts if part not in PARTS]
    if unknown:  # before any part runs: a typo found after the tests' minutes wastes a lent GPU's time
        p.error(f"--parts: {', '.join(map(repr, unknown))} is not one of tests, trainer, bench")
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file, not a folder: nothing was touched. HINT: give a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {out}: cannot make it ({exc.strerror or exc}). HINT: give a folder you can write to")
    theirs = replaceable(out, parts)
    if theirs:
        p.error(f"--out {out} holds {', '.join(theirs)}, which gpu-check did not make and would replace: "
                "nothing was touched. HINT: give another --out (or move them away)")
    claim(out, parts)
    site = out / "site"
    wheels = unpack_wheels(Path(args.wheels), site)
    sys.path[:0] = [str(REPO), str(site)]
    env = child_env(site, args.smoke)
    start = time.monotonic()
    summary = {"smoke": args.smoke, "machine": machine(), "wheels": wheels, "parts": {}}
    for part in parts:
        runner = {"tests": part_tests, "trainer": part_trainer, "bench": part_bench}[part]
        print(f"gpu-check: {part} ...", flush=True)
        try:
            summary["parts"][part] = runner(out, env, args.smoke)
        except Exception as exc:  # noqa: BLE001 - one part's failure is recorded; the others still run
            summary["parts"][part] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"gpu-check: {part} {'passed' if summary['parts'][part]['passed'] else 'FAILED'}", flush=True)
    summary["seconds"] = round(time.monotonic() - start, 1)
    summary["passed"] = all(part["passed"] for part in summary["parts"].values())
    summary["proved"] = proved(summary)
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "gpu-check.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"gpu-check: summary in {out / 'gpu-check.md'} and {out / 'gpu-check.json'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
