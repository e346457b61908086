"""`make demo`: the whole story on this machine, through the local executor, in a few minutes on 2 cores.

1. generate a learnable MNIST-format dataset (real IDX files, read by torchvision's MNIST);
2. train jobs/demo_mnist.toml on 2 simulated nodes x 2 ranks (real DDP over gloo);
3. part-way through, send the warning signal (SIGUSR2) as Slurm would before a time limit: the ranks
   agree to stop, checkpoint, exit with "requeue me", and the executor starts the job again;
4. the new attempt resumes from the checkpoint and finishes; print the accuracy and where things are.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.data.datagen import write_mnist

REPO = Path(__file__).resolve().parent.parent
RUN_DIR = REPO / "runs" / "demo"
DATA = REPO / "data" / "demo-mnist"


def _say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def _interrupt_when_halfway(proc: subprocess.Popen, total_steps_hint: int) -> int | None:
    """Send SIGUSR2 to the executor (which forwards it to every rank) once training is under way."""
    metrics = RunDir(RUN_DIR).metrics
    while proc.poll() is None:
        steps = [r["step"] for r in read_jsonl(metrics) if "loss" in r]
        if steps and steps[-1] >= total_steps_hint:
            proc.send_signal(signal.SIGUSR2)
            return steps[-1]
        time.sleep(0.2)
    return None


def main() -> int:
    _say(f"1. Generating a learnable MNIST-format dataset in {DATA.relative_to(REPO)}")
    write_mnist(DATA, train=6000, test=1000)
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    _say("2. Training on 2 simulated nodes x 2 ranks: hpc-ddp submit --executor local jobs/demo_mnist.toml")
    cmd = [sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--run-dir", str(RUN_DIR),
           str(REPO / "jobs" / "demo_mnist.toml")]
    proc = subprocess.Popen(cmd, cwd=REPO)
    at = _interrupt_when_halfway(proc, total_steps_hint=60)
    if at is not None:
        print(f"\n=== 3. Sent SIGUSR2 (the time-limit warning) at about step {at}; "
              "the job checkpoints, exits 75 and is restarted", flush=True)
    rc = proc.wait()
    if rc != 0:
        print(f"demo: training failed with exit code {rc}; logs in {RunDir(RUN_DIR).logs}", file=sys.stderr)
        return rc
    subprocess.run([sys.executable, "-m", "hpc_ddp", "plot", str(RUN_DIR)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    _report()
    return 0


def _report() -> None:
    evals = [r for r in read_jsonl(RunDir(RUN_DIR).metrics) if "eval_acc" in r]
    events = read_jsonl(RunDir(RUN_DIR).events)
    resumes = [e for e in events if e["event"] == "resume"]
    info = json.loads(subprocess.run([sys.executable, "-m", "hpc_ddp", "inspect", "--json", str(RUN_DIR)],
                                     capture_output=True, text=True, check=True).stdout)
    _say("4. Done")
    for e in resumes:
        print(f"resumed at step {e['step']} (epoch {e['epoch'] + 1}, batch {e['batch_in_epoch']} of it) "
              f"from {Path(e['path']).name}")
    print(f"final eval accuracy: {evals[-1]['eval_acc']:.1%} (chance: 10%) after {info['step']} steps")
    print(f"run dir:     {RUN_DIR}")
    print(f"checkpoints: {RunDir(RUN_DIR).checkpoints} (latest: {Path(info['path']).name}, "
          f"model_sha256 {info['model_sha256'][:16]}...)")
    print(f"metrics:     {RunDir(RUN_DIR).metrics}")
    print(f"events:      {RunDir(RUN_DIR).events}")
    print(f"plot:        {RUN_DIR / 'training.png'}")


if __name__ == "__main__":
    sys.exit(main())
