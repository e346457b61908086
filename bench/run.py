"""`make bench`: our trainer against the plain hand-written DDP loop, side by side in one run.

Same model (the small CNN), data (a generated MNIST-format set read by torchvision's MNIST), batch size,
loader workers and world size (2 ranks, gloo, CPU), both started by the local executor; runs are
interleaved A/B and repeated, and the median samples/s of each is compared. Writes bench/results.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hpc_ddp.datagen import write_mnist
from hpc_ddp.events import read_jsonl

REPO = Path(__file__).resolve().parent.parent
STEPS, BATCH, WORKERS, REPEATS = 200, 32, 2, 3

JOB = """nodes = 1
tasks_per_node = 2
[train]
dataset = "mnist"
data_dir = "{data}"
model = "cnn"
epochs = 1
max_steps = {steps}
batch_size = {batch}
lr = 0.05
num_workers = {workers}
log_every = 10
eval_every_epoch = false
"""


def hpc_ddp(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", *args], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def plain(work: Path, data: Path, n: int) -> float:
    out = work / f"plain-{n}.json"
    hpc_ddp("--tasks-per-node", "2", "--run-dir", str(work / f"plain-{n}"), str(REPO / "bench" / "plain_ddp.py"),
            "--", str(data), str(STEPS), str(BATCH), str(WORKERS), str(out), cwd=work)
    return json.loads(out.read_text())["samples_per_s"]


def ours(work: Path, job: Path, n: int) -> float:
    run_dir = work / f"ours-{n}"
    hpc_ddp("--run-dir", str(run_dir), str(job), cwd=work)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    first, last = records[0], records[-1]  # step 10 and the last step: start-up excluded, as for plain
    return (last["step"] - first["step"]) * BATCH * 2 / (last["time"] - first["time"])


def staging(work: Path, repeats: int) -> dict:
    """Our per-node staging against `cp -r` and `tar -xf` of the same data on the same disk."""
    import shutil
    import time

    from hpc_ddp.staging import stage

    src = work / "shared" / "imagefolder"
    for i in range(1000):  # 1000 files x 400 KB = 400 MB in 10 class folders
        path = src / f"class_{i % 10}" / f"{i:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(400 * 1024))
    archive = work / "shared" / "imagefolder.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(src.parent), src.name], check=True)
    nbytes = 1000 * 400 * 1024

    def timed(fn) -> float:
        dest = work / "local"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        subprocess.run(["sync"], check=True)
        started = time.perf_counter()
        fn(dest)
        subprocess.run(["sync"], check=True)  # both sides pay for getting the bytes to disk
        return nbytes / 1e6 / (time.perf_counter() - started)

    runs: dict[str, list[float]] = {"cp -r": [], "ours (dir)": [], "tar -xf": [], "ours (tar)": []}
    ops = {
        "cp -r": lambda d: subprocess.run(["cp", "-r", str(src), str(d)], check=True),
        "ours (dir)": lambda d: stage(src, d, log=lambda _m: None),
        "tar -xf": lambda d: subprocess.run(["tar", "-xf", str(archive), "-C", str(d)], check=True),
        "ours (tar)": lambda d: stage(archive, d, log=lambda _m: None),
    }
    for r in range(repeats):  # alternate which of each pair goes first, so cache effects hit both alike
        for pair in (("cp -r", "ours (dir)"), ("tar -xf", "ours (tar)")):
            for name in (pair if r % 2 == 0 else pair[::-1]):
                runs[name].append(timed(ops[name]))
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"MB_per_s": runs, "median_MB_per_s": med,
            "ratio_dir": med["ours (dir)"] / med["cp -r"], "ratio_tar": med["ours (tar)"] / med["tar -xf"],
            "target": ">= 0.90",
            "shared_reads_per_node": {"ours": 1, "every rank copies": "local ranks per node (e.g. 8)"}}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="hpc-ddp-bench-") as tmp:
        work = Path(tmp)
        data = write_mnist(work / "mnist", train=STEPS * BATCH * 2 + 512, test=64)
        job = work / "job.toml"
        job.write_text(JOB.format(data=data, steps=STEPS, batch=BATCH, workers=WORKERS))
        a, b = [], []
        for n in range(REPEATS):  # interleaved, so drifts in machine load hit both alike
            a.append(plain(work, data, n))
            b.append(ours(work, job, n))
        stage_result = staging(work, 2 * REPEATS + 1)
    result = {
        "machine": f"{platform.node()} {platform.machine()} {platform.python_version()}",
        "setup": {"world_size": 2, "backend": "gloo", "steps": STEPS, "batch_per_rank": BATCH,
                  "loader_workers": WORKERS, "repeats": REPEATS},
        "throughput": {"plain_samples_per_s": a, "ours_samples_per_s": b,
                       "plain_median": statistics.median(a), "ours_median": statistics.median(b),
                       "ratio": statistics.median(b) / statistics.median(a), "target": ">= 1.00"},
        "staging": stage_result,
    }
    out = REPO / "bench" / "results.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    t = result["throughput"]
    print(f"{'':28}{'plain DDP loop':>16}{'hpc-ddp trainer':>17}{'ratio':>8}")
    print(f"{'samples/s (median of ' + str(REPEATS) + ')':28}{t['plain_median']:>16,.0f}{t['ours_median']:>17,.0f}"
          f"{t['ratio']:>8.2f}")
    m = stage_result["median_MB_per_s"]
    print(f"{'staging a directory, MB/s':28}{m['cp -r']:>16,.0f}{m['ours (dir)']:>17,.0f}{stage_result['ratio_dir']:>8.2f}"
          "   (cp -r)")
    print(f"{'staging a tar, MB/s':28}{m['tar -xf']:>16,.0f}{m['ours (tar)']:>17,.0f}{stage_result['ratio_tar']:>8.2f}"
          "   (tar -xf)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
