"""Start-up: wall time from spawning the launcher to the end of the first training step, 2 ranks on CPU.

Ours: `hpc-ddp submit --executor local JOB.toml` (CLI -> local executor -> per-rank runner -> trainer);
the first step's time is the trainer's metrics record for step 1 (log_every = 1). Baseline: a plain
torchrun launch (`python -m torch.distributed.run --nproc-per-node 2 bench/plain_ddp.py ...`) of the
plain loop on the same data, model, batch and loader workers; rank 0 records the wall time at which its
first step finished. Both clocks are time.time() on this machine, read just before Popen.
"""

from __future__ import annotations

import json
import subprocess
import time

from .common import PLAIN, PY, Row, Target, Workspace, compare, free_port, interleaved, metrics, say, trainer_job, wait

SECTION = "startup"


def _ours(ws: Workspace):
    s = ws.s
    job = trainer_job(ws.fresh("startup-job").with_suffix(".toml"), data=str(ws.mnist()), steps=s.startup_steps,
                      batch=s.batch, workers=s.workers, tasks=2, log_every=1)

    def run(n: int) -> float:
        run_dir = ws.fresh("startup-ours")
        started = time.time()
        proc, log = ws.spawn(ws.submit_argv("--run-dir", str(run_dir), str(job)), "startup-ours")
        wait(proc, log)
        first = next(r for r in metrics(run_dir) if r["step"] == 1)
        return first["time"] - started
    return run


def _plain(ws: Workspace):
    s = ws.s

    def run(n: int) -> float:
        out = ws.fresh("startup-plain").with_suffix(".json")
        argv = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(PLAIN),
                "--data", str(ws.mnist()), "--steps", str(s.startup_steps), "--batch", str(s.batch),
                "--workers", str(s.workers), "--warm", "1", "--out", str(out)]
        started = time.time()
        proc, log = ws.spawn(argv, "startup-plain")
        wait(proc, log)
        return json.loads(out.read_text())["first_step_time"] - started
    return run


def cold_imports() -> dict[str, float]:
    """How long `import torch` and the CLI's imports take in a fresh interpreter (what every launch pays)."""
    out = {}
    for name, code in (("python", "pass"), ("import torch", "import torch"),
                       ("import hpc_ddp.cli", "import hpc_ddp.cli")):
        started = time.perf_counter()
        subprocess.run([PY, "-c", code], check=True)
        out[name] = round(time.perf_counter() - started, 3)
    return out


def run(ws: Workspace) -> list[Row]:
    s = ws.s
    say(f"start-up to the first step, 2 ranks: {s.repeats} repeats")
    runs = interleaved({"torchrun + plain loop": _plain(ws), "hpc-ddp submit --executor local": _ours(ws)},
                       s.repeats, "s")
    return [compare(SECTION, "start-up to first step, CPU, 2 ranks", "s", ours="hpc-ddp submit (local executor)",
                    ours_samples=runs["hpc-ddp submit --executor local"], baseline="torchrun + plain loop",
                    baseline_samples=runs["torchrun + plain loop"], target=Target("<=", 1.10),
                    extra={"cold_import_s": cold_imports()},
                    note="spawn of the launcher -> end of step 1 on rank 0; lower is better")]
