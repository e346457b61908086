"""Staging: our per-node staging against `cp -r` and `tar -xf` of the same data on the same disk, and
the bytes each node reads from the shared source.

Speed: a directory of `stage_files` random files (and a tar of it) staged by `hpc_ddp.data.staging.stage`
vs `cp -r` / `tar -xf` into an empty directory. Both sides end with a `sync` inside the timing (ours
makes the copy durable before its completion marker, so the plain tools pay for the same), and each
pair alternates which side goes first.

Bytes read: one simulated node of `stage_ranks` local ranks (processes) stages the directory at the
same time, as in a job (local rank 0 stages, the others wait for its completion marker), against the
naive job where every rank copies the data itself (`cp -r`). Each rank process reads its own
/proc/self/io `rchar` before and after; `rchar` counts every byte passed through read(2)/copy_file_range(2)
by the process and by the children it has reaped (the `cp`/`tar` it runs). The node's bytes are the sum
over its ranks. (`read_bytes` would count only page-cache misses, which depend on what was cached.)
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import (
    PY,
    REPO,
    Row,
    Settings,
    Target,
    Workspace,
    compare,
    interleaved,
    say,
)

SECTION = "staging"


def _noop(_message: str) -> None:
    """The stager's progress log, silenced: its lines would land inside the timing."""


def make_source(ws: Workspace) -> tuple[Path, Path, int]:
    s = ws.s
    src = ws.root / "shared" / "imagefolder"
    for i in range(s.stage_files):  # random bytes in 10 class folders
        path = src / f"class_{i % 10}" / f"{i:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(s.stage_file_kb * 1024))
    archive = src.parent / "imagefolder.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(src.parent), src.name], check=True)
    return src, archive, s.stage_files * s.stage_file_kb * 1024


def speed(ws: Workspace, src: Path, archive: Path, nbytes: int) -> dict[str, list[float]]:
    from hpc_ddp.data.staging import stage

    dest = ws.root / "local"

    def timed(op):
        def run(_n: int) -> float:
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            os.sync()
            started = time.perf_counter()
            op(dest)
            os.sync()  # both sides pay for getting the bytes to disk
            return nbytes / 1e6 / (time.perf_counter() - started)
        return run

    ops = {
        "cp -r": timed(lambda d: subprocess.run(["cp", "-r", str(src), str(d)], check=True)),
        "ours (dir)": timed(lambda d: stage(src, d, log=_noop)),
        "tar -xf": timed(lambda d: subprocess.run(["tar", "-xf", str(archive), "-C", str(d)], check=True)),
        "ours (tar)": timed(lambda d: stage(archive, d, log=_noop)),
    }
    repeats = 2 * ws.s.repeats + 1 if not ws.s.quick else 1
    runs = {}
    for pair in (("cp -r", "ours (dir)"), ("tar -xf", "ours (tar)")):
        runs.update(interleaved({name: ops[name] for name in pair}, repeats, "MB/s"))
    shutil.rmtree(dest, ignore_errors=True)
    return runs


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def _rank(kind: str, src: str, scratch: str, local_rank: int, queue) -> None:
    from hpc_ddp.data.staging import stage, wait_for_stage

    before, started = _rchar(), time.monotonic()
    if kind == "naive":
        subprocess.run(["cp", "-r", src, os.path.join(scratch, f"rank-{local_rank}")], check=True)
    elif local_rank == 0:  # what the per-rank runner does (hpc_ddp.job.stagejob)
        stage(src, scratch, name="data", log=_noop)
    else:
        wait_for_stage(src, scratch, name="data", timeout=600)
    queue.put((local_rank, _rchar() - before, time.monotonic() - started))


def node_reads(ws: Workspace, src: Path, kind: str) -> tuple[int, float]:
    """(bytes read by the node's ranks together, seconds until the last rank had its data)."""
    scratch = ws.fresh(f"node-{kind}")
    scratch.mkdir()
    os.sync()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(kind, str(src), str(scratch), r, queue)) for r in range(ws.s.stage_ranks)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a {kind} staging rank failed: exit codes {[p.exitcode for p in procs]}")
    shutil.rmtree(scratch, ignore_errors=True)
    return sum(b for _, b, _ in results), max(t for _, _, t in results)


def measure(ws: Workspace) -> dict:
    s = ws.s
    src, archive, nbytes = make_source(ws)
    say(f"staging {nbytes / 1e6:,.0f} MB in {s.stage_files} files")
    runs = speed(ws, src, archive, nbytes)
    say(f"bytes read per node, {s.stage_ranks} local ranks")
    ours_b, ours_s = node_reads(ws, src, "ours")
    naive_b, naive_s = node_reads(ws, src, "naive")
    say(f"  ours {ours_b / 1e6:,.1f} MB in {ours_s:.2f} s; "
        f"every rank copies: {naive_b / 1e6:,.1f} MB in {naive_s:.2f} s")
    shutil.rmtree(src.parent, ignore_errors=True)
    return {"runs": runs, "nbytes": nbytes, "ours": [ours_b, ours_s], "naive": [naive_b, naive_s]}


def run(ws: Workspace) -> list[Row]:
    """Measured in a fresh interpreter that never imports torch, like the per-rank runner that stages
    in a job: `stage` starts cp/tar with a preexec_fn, which makes Python fork instead of vfork, and a
    fork of this process (torch imported, checkpoints built) would cost ~50 ms per cp/tar."""
    out = ws.fresh("staging").with_suffix(".json")
    argv = [PY, "-m", "bench.stage_bench", str(ws.root), json.dumps(dataclasses.asdict(ws.s)), str(out)]
    subprocess.run(argv, check=True, cwd=REPO, env=ws.env())
    m = json.loads(out.read_text())
    s, runs, nbytes = ws.s, m["runs"], m["nbytes"]
    (ours_b, ours_s), (naive_b, naive_s) = m["ours"], m["naive"]
    mb = nbytes / 1e6
    sync_note = "a sync inside the timing on both sides"
    return [
        compare(SECTION, f"staging a directory ({mb:,.0f} MB, {s.stage_files} files)", "MB/s",
                ours="hpc-ddp stage", ours_samples=runs["ours (dir)"], baseline="cp -r",
                baseline_samples=runs["cp -r"], target=Target(">=", 0.90), note=sync_note),
        compare(SECTION, f"staging a tar of it ({mb:,.0f} MB)", "MB/s", ours="hpc-ddp stage",
                ours_samples=runs["ours (tar)"], baseline="tar -xf", baseline_samples=runs["tar -xf"],
                target=Target(">=", 0.90), note=sync_note),
        compare(SECTION, f"bytes read from the shared source per node ({s.stage_ranks} local ranks)", "MB",
                ours="per-node staging (local rank 0 copies)", ours_samples=[ours_b / 1e6],
                baseline="every rank copies (cp -r)", baseline_samples=[naive_b / 1e6],
                extra={"dataset_MB": mb, "ours_x_dataset": ours_b / nbytes, "naive_x_dataset": naive_b / nbytes,
                       "node_seconds": {"ours": ours_s, "every rank copies": naive_s}},
                note="measured with /proc/self/io rchar of every rank (children included); one run; "
                     "lower is better"),
    ]


if __name__ == "__main__":  # the fresh interpreter of run()
    root, settings_json, out_path = sys.argv[1:4]
    result = measure(Workspace(Path(root), Settings(**json.loads(settings_json))))
    Path(out_path).write_text(json.dumps(result))
