"""The srun executor on the test Slurm, inside a real `salloc`: a 2-node gloo DDP job runs as a step of
the allocation (the ranks' environment, their logs, status COMPLETED), through `submit --executor srun`
and `hpc-ddp run`; Ctrl-C typed at a terminal (a pty: salloc makes its command the foreground job)
checkpoints and cancels, twice kills; `hpc-ddp cancel` and `hpc-ddp preempt` from another shell reach
the step (a preempted trainer restarts within the allocation and resumes); bad input is exit 2, one line,
nothing written: outside an allocation, or asking for more than it has."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import check_probe, copy_probe, hpc_ddp, last_step, read_probe

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

# One rank per GPU needs a CPU per rank: salloc gives one CPU per node unless asked for tasks.
SALLOC = ["salloc", "-N2", "--gpus-per-node=2", "--ntasks-per-node=2", "--time=5"]
HPC_DDP = [sys.executable, "-m", "hpc_ddp"]

# A user's program that checkpoints on SIGTERM and asks to be requeued (the trainer's protocol).
SCRIPT = """
import os, signal, sys, time
from pathlib import Path
rank = os.environ["RANK"]
def stop(*_):
    if os.environ.get("IGNORE_TERM"):
        return
    time.sleep(float(os.environ.get("SAVE_S", "0")))
    Path(f"saved-{rank}").write_text(os.environ["SLURMD_NODENAME"])
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
Path(f"pid-{rank}").write_text(str(os.getpid()))
time.sleep(600)
"""

TRAIN = """tasks_per_node = 2
[train]
dataset = "fake"
fake_size = 4096
image_size = 8
model = "mlp"
epochs = 200
batch_size = 8
num_workers = 0
log_every = 1
eval_every_epoch = false
"""


@pytest.fixture
def ws(slurm_conf, tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "long.toml").write_text(TRAIN)
    copy_probe(tmp_path)
    return tmp_path


def _allocation_id(text: str) -> str | None:
    m = re.search(r"Granted job allocation (\d+)", text)
    return m.group(1) if m else None


def _status(ws: Path, run: str = "run") -> dict:
    done = hpc_ddp("status", "--json", run, cwd=ws)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _steps(alloc: str) -> str:
    return subprocess.run(["squeue", "--noheader", "--steps", f"--jobs={alloc}", "--format=%i|%j"],
                          capture_output=True, text=True).stdout


class Salloc:
    """`salloc ... COMMAND` on a terminal of its own (a pty), as typed at a prompt: salloc makes the command
    the terminal's foreground job, so a typed Ctrl-C reaches the command, not salloc."""

    def __init__(self, command: list[str], cwd: Path, env: dict | None = None, salloc: list[str] = SALLOC):
        master, slave = os.openpty()
        self.master, self.out = master, b""
        self.proc = subprocess.Popen([*salloc, *command], cwd=cwd, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=_take_terminal,
                                     env={**os.environ, **(env or {})})
        os.close(slave)

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")

    def read(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.out += os.read(self.master, 65536)
                except OSError:  # the terminal's other side is closed: everything was read
                    return

    def until(self, predicate, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > end or self.proc.poll() is not None:
                raise AssertionError(f"timed out waiting for {what}:\n{self.text[-3000:]}")
            self.read(0.2)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait(self, timeout: float) -> tuple[int, str]:
        end = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > end:
                raise AssertionError(f"salloc did not end within {timeout} s:\n{self.text[-3000:]}")
            self.read(0.2)
        self.read(0.5)
        return self.proc.returncode, self.text

    def close(self) -> None:
        """Whatever happened, give the allocation back."""
        alloc = _allocation_id(self.text)
        if self.proc.poll() is None:
            if alloc:
                subprocess.run(["scancel", alloc], capture_output=True)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        os.close(self.master)


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _ranks_up(ws: Path, n: int = 4) -> bool:
    return all((ws / f"pid-{r}").exists() for r in range(n))


# ---- a DDP job as a step of the allocation ----

@pytest.mark.parametrize("how", [["submit", "--executor", "srun"], ["run"]])
def test_a_two_node_ddp_job_runs_as_a_step_of_the_allocation(ws, how):
    """No --nodes, no --gpus: the allocation's 2 nodes x 2 GPUs, one rank per GPU."""
    done = subprocess.run([*SALLOC, *HPC_DDP, *how, "--json", "--run-dir", "run", "allreduce_probe.py", "--",
                           "--lr", "0.1"], cwd=ws, capture_output=True, text=True, timeout=300)
    alloc = _allocation_id(done.stderr)
    assert done.returncode == 0 and alloc, done.stdout + done.stderr
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["executor"] == "srun" and result["state"] == "COMPLETED" and result["returncode"] == 0
    job_id = result["job_id"]
    assert job_id.startswith(f"{alloc}-srun-")
    seen = read_probe(ws / "run")
    check_probe(seen, nodes=2, tasks=2, master="hpcn1", node_names=["hpcn1", "hpcn2"])
    assert all(r["argv"] == ["--lr", "0.1"] and r["HPC_DDP_HOSTS"] == "hpcn1,hpcn2" for r in seen)
    logs = sorted((ws / "run").glob(f"logs/job-{job_id}/attempt-0/rank-*.log"))
    assert [p.name for p in logs] == [f"rank-{r}.log" for r in range(4)]
    assert all(f"rank {r}/4: all_reduce=6.0" in logs[r].read_text() for r in range(4))
    for r in range(4):  # and echoed here, prefixed by rank
        assert f"[rank {r}] rank {r}/4: all_reduce=6.0" in done.stdout
    status = _status(ws)
    assert status["state"] == "COMPLETED" and status["executor"] == "srun" and status["job_id"] == job_id
    assert not (ws / "run" / "srun.pid").exists()


# ---- stopping it: Ctrl-C, hpc-ddp cancel, hpc-ddp preempt ----

def test_ctrl_c_at_the_terminal_checkpoints_and_cancels(ws):
    term = Salloc([*HPC_DDP, "run", "--run-dir", "run", "job.py"], ws, env={"SAVE_S": "2"})
    try:
        term.until(lambda: _ranks_up(ws), 120, "the ranks to start")
        alloc = _allocation_id(term.text)
        term.type(b"\x03")
        rc, out = term.wait(60)
    finally:
        term.close()
    assert rc == 130 and "cancelling: asking every rank to checkpoint" in out, out[-3000:]
    assert sorted(p.read_text() for p in ws.glob("saved-*")) == ["hpcn1", "hpcn1", "hpcn2", "hpcn2"]  # all saved
    status = _status(ws)
    assert status["state"] == "CANCELLED" and [a["ended"] for a in status["attempts"]] == ["cancelled"], status
    assert "Relinquishing job allocation" in out and alloc not in _steps(alloc)


def test_a_second_ctrl_c_stops_ranks_that_do_not_stop(ws):
    term = Salloc([*HPC_DDP, "run", "--run-dir", "run", "job.py"], ws, env={"IGNORE_TERM": "1"})
    try:
        term.until(lambda: _ranks_up(ws), 120, "the ranks to start")
        term.type(b"\x03")
        term.until(lambda: "cancelling: asking" in term.text, 10, "the first Ctrl-C")
        term.read(2)
        assert term.proc.poll() is None  # the ranks may take their time to save
        term.type(b"\x03")
        started = time.monotonic()
        rc, out = term.wait(30)
    finally:
        term.close()
    assert rc == 130 and time.monotonic() - started < 15 and "killing every rank now" in out, out[-3000:]
    assert _status(ws)["state"] == "CANCELLED"


def test_hpc_ddp_cancel_from_another_shell_stops_the_step(ws):
    term = Salloc([*HPC_DDP, "submit", "--executor", "srun", "--run-dir", "run", "job.py"], ws)
    try:
        term.until(lambda: _ranks_up(ws), 120, "the ranks to start")
        assert _status(ws)["state"] == "RUNNING"
        done = hpc_ddp("cancel", "run", cwd=ws, timeout=120)
        assert done.returncode == 0 and "Cancelled job" in done.stdout, done.stdout + done.stderr
        rc, out = term.wait(60)
    finally:
        term.close()
    assert rc == 130, out[-3000:]
    assert len(list(ws.glob("saved-*"))) == 4 and _status(ws)["state"] == "CANCELLED"


def test_a_preempted_trainer_restarts_in_the_allocation_and_resumes(ws):
    """`hpc-ddp preempt` sends the warning signal to every rank through the step; the trainer checkpoints,
    the requeue policy restarts it as attempt 1 of the same run, which resumes from that checkpoint."""
    term = Salloc([*HPC_DDP, "run", "--run-dir", "run", "long.toml"], ws, salloc=[*SALLOC[:-1], "--time=10"])
    run = ws / "run"
    try:
        term.until(lambda: last_step(run) >= 3, 180, "a few training steps")
        done = hpc_ddp("preempt", "run", cwd=ws, timeout=60)
        assert done.returncode == 0 and "Sent SIGUSR2" in done.stdout, done.stdout + done.stderr
        term.until(lambda: any(e.get("event") == "resume" for e in read_jsonl(run / "events.jsonl")), 180,
                   "the restarted attempt to resume")
        hpc_ddp("cancel", "run", cwd=ws, timeout=120)
        rc, out = term.wait(120)
    finally:
        term.close()
    assert "restarting (preempted: requeue 1 of at most 20)" in out, out[-3000:]
    status = _status(ws)
    assert [a["ended"] for a in status["attempts"]] == ["preempted", "cancelled"], status["attempts"]
    assert status["resumes"] and status["resumes"][0]["step"] >= 3
    job_id = status["job_id"]
    for attempt in (0, 1):  # every attempt's logs, as under sbatch
        assert len(list(run.glob(f"logs/job-{job_id}/attempt-{attempt}/rank-*.log"))) == 4


# ---- bad input: exit 2, one line, nothing written ----

def test_outside_an_allocation_it_is_refused(ws):
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "SLURM_JOBID")}
    done = subprocess.run([*HPC_DDP, "submit", "--executor", "srun", "--run-dir", "run", "job.py"], cwd=ws,
                          capture_output=True, text=True, timeout=60, env=env)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "SLURM_JOB_ID is not set" in errors[0] and "salloc" in errors[0]
    assert not (ws / "run").exists()


def test_asking_for_more_than_the_allocation_has_is_refused(ws):
    """`salloc -N2 --gpus-per-node=2` alone: 2 nodes, 2 GPUs and 1 CPU per node."""
    run = " ".join(shlex.quote(w) for w in HPC_DDP)
    script = "; ".join(f'{run} run --run-dir run{i} {args} job.py; echo "rc=$?"' for i, args in
                       enumerate(["--nodes 3", "--gpus 3", ""]))
    done = subprocess.run(["salloc", "-N2", "--gpus-per-node=2", "--time=2", "bash", "-c", script], cwd=ws,
                          capture_output=True, text=True, timeout=300)
    assert re.findall(r"rc=(\d+)", done.stdout) == ["2", "2", "2"], done.stdout + done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(errors) == 3, done.stderr
    assert "--nodes 3" in errors[0] and "has 2 node(s)" in errors[0]
    assert "--gpus 3" in errors[1] and "has 2 GPU(s) per node" in errors[1]
    assert "need 2 CPUs per node" in errors[2] and "has 1" in errors[2] and "--ntasks-per-node=2" in errors[2]
    assert not any(ws.glob("run*"))
