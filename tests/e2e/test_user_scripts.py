"""Users' own scripts get the whole promise (issue 10), end to end.

- The adapted examples (examples/, the seeds plus a few lines of hpc_ddp) stop, checkpoint, requeue and end
  bitwise identical to an uninterrupted run at the same world size: through the local executor, and on the
  test Slurm preempted twice at random steps by real partition-priority preemption (PreemptMode=REQUEUE).
- An unmodified plain script that keeps its own progress file is run again after each real preemption
  in a partition with a GraceTime (where Slurm alone would record it FAILED) and completes.
- A cancel is not a preemption: never requeued.
- Misuse of the API across ranks (save() on rank 0 only) ends in one line naming the fix.
"""

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.data.datagen import write_mnist

from .helpers import hpc_ddp, job_field, last_step, preempt, submit_json, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SEEDS = REPO.parent / "shared" / "seeds"
MNIST_ARGS = ("--epochs", "2", "--batch-size", "32", "--lr", "0.001", "--pass-local-rank")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-scripts")
    write_mnist(root / "mnist", train=2048, test=128)
    return root


def _sha(run_dir: Path) -> tuple[int, str]:
    done = hpc_ddp("inspect", "--json", str(run_dir), cwd=run_dir)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    return info["step"], info["model_sha256"]


def _local(workspace, run, *args, env=None, timeout=400):
    return hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--tasks-per-node", "1", "--run-dir", run,
                   *args, cwd=workspace, env=env, timeout=timeout)


def _mnist(workspace, run, env=None, **kw):
    return _local(workspace, run, *MNIST_ARGS, "--stage", str(workspace / "mnist"),
                  str(EXAMPLES / "managed_platform_mnist.py"), env=env, **kw)


@pytest.fixture(scope="module")
def mnist_baseline(workspace):
    done = _mnist(workspace, "mnist-base")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "eval accuracy" in done.stdout
    return _sha(workspace / "mnist-base")


@pytest.mark.parametrize("example,args", [
    ("linear_regression.py", ()),
    pytest.param("spawn_mnist.py", ("--stage",), marks=pytest.mark.extended),
    ("fsdp_preemptible.py", ()),   # sharded (FSDP2): every rank writes its shards, and reads them back
])
def test_examples_stop_and_resume_bitwise_under_the_local_executor(workspace, example, args):
    extra = ("--stage", f"{workspace / 'mnist'}:mnist") if args else ()
    env = {"EPOCHS": "3"}
    base = _local(workspace, f"{example}-base", *extra, str(EXAMPLES / example), env=env)
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    stop_at = {"linear_regression.py": 2, "fsdp_preemptible.py": 45}.get(example, 37)
    cut = _local(workspace, f"{example}-cut", *extra, str(EXAMPLES / example),
                 env={**env, "HPC_DDP_FAULT_STOP_AT": str(stop_at)})
    assert cut.returncode == 0, cut.stdout[-3000:] + cut.stderr[-3000:]
    out = cut.stdout + cut.stderr
    assert f"checkpointing at step {stop_at}" in out and "resumed from" in out
    assert _sha(workspace / f"{example}-cut") == _sha(workspace / f"{example}-base")


@pytest.mark.extended
def test_managed_platform_example_stops_twice_and_resumes_bitwise(workspace, mnist_baseline):
    done = _mnist(workspace, "mnist-cut", env={"HPC_DDP_FAULT_STOP_AT": "23,64"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _sha(workspace / "mnist-cut") == mnist_baseline
    status = json.loads(hpc_ddp("status", "--json", str(workspace / "mnist-cut"), cwd=workspace).stdout)
    assert [a["ended"] for a in status["attempts"]] == ["preempted", "preempted", "completed"]


SAVE_ON_RANK_0 = """
import hpc_ddp, torch
run = hpc_ddp.start()
run.track(model=torch.nn.Linear(2, 1))
if run.rank == 0:
    run.save()
"""


def test_save_on_one_rank_only_names_the_rank_that_did_not_call_it(workspace):
    (workspace / "misuse.py").write_text(SAVE_ON_RANK_0)
    done = _local(workspace, "misuse", "--collective-timeout", "10", "misuse.py", timeout=120)
    assert done.returncode != 0 and "failed (exit code 2)" in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    # rank 1 left (its script ended) without calling it: named at once, not after the 10 s (issue 43)
    assert ("hpc-ddp: error: save() is collective, but rank 1 (localhost) left the run (finished) without calling it "
            "(rank 0 did) HINT: call run.save() on every rank") in done.stdout
    assert "Traceback" not in done.stdout
    assert not list((workspace / "misuse" / "checkpoints").glob("step-*"))


def test_the_examples_differ_little_from_the_seeds():
    """docs/session-api.md shows these diffs: adopting the API is a few lines, not a rewrite."""
    if not SEEDS.is_dir():
        pytest.skip("../shared/seeds is not beside this checkout")
    for name, most in (("managed_platform_mnist.py", 24), ("linear_regression.py", 28), ("spawn_mnist.py", 50)):
        diff = subprocess.run(["diff", str(SEEDS / name), str(EXAMPLES / name)], capture_output=True, text=True)
        changed = [line for line in diff.stdout.splitlines() if line[:2] in ("< ", "> ")]
        assert 0 < len(changed) <= most, (name, len(changed))


# ---- on the real test Slurm: partition-priority preemption ----

def wait_until_done(job_id: str, timeout: float = 400) -> str:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    return wait_until(lambda: (job_field(job_id, "JobState") or "") in ended and job_field(job_id, "JobState"),
                      timeout, f"job {job_id} to end")


@pytest.mark.slurm
@pytest.mark.extended
def test_adapted_example_preempted_twice_for_real_ends_bitwise_identical(slurm_conf, workspace, mnist_baseline):
    rng = random.Random(10)
    job = submit_json("--executor", "sbatch", "--partition", "debug", "--nodes", "2", "--gpus", "1",
                      "--run-dir", "mnist-slurm", *MNIST_ARGS, "--stage", str(workspace / "mnist"),
                      str(EXAMPLES / "managed_platform_mnist.py"), cwd=workspace)["job_id"]
    run_dir = workspace / "mnist-slurm"
    at = 0
    for _ in range(2):
        at = max(at, last_step(run_dir)) + rng.randint(10, 30)
        wait_until(lambda: last_step(run_dir) >= at, 300, f"step {at}")
        preempt(job)
    assert wait_until_done(job) == "COMPLETED"
    assert _sha(run_dir) == mnist_baseline
    status = json.loads(hpc_ddp("status", "--json", job, cwd=workspace).stdout)
    assert [a["ended"] for a in status["attempts"]] == ["preempted", "preempted", "completed"]
    assert len(status["resumes"]) == 2


PLAIN = """
# A plain env:// script with its own progress file: nothing of hpc_ddp in it.
import json, os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
progress = sys.argv[1]
start = json.load(open(progress))["step"] if os.path.exists(progress) else 0
print(f"rank {dist.get_rank()} starts at step {start}", flush=True)
for step in range(start, 40):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.5)
    if dist.get_rank() == 0:
        with open(progress + ".tmp", "w") as fh:
            json.dump({"step": step + 1}, fh)
        os.replace(progress + ".tmp", progress)
dist.destroy_process_group()
"""


@pytest.mark.slurm_core
@pytest.mark.slurm
def test_plain_script_is_run_again_after_each_real_preemption_with_a_grace_time(slurm_conf, workspace):
    (workspace / "plain.py").write_text(PLAIN)
    progress = workspace / "plain-progress.json"
    job = submit_json("--executor", "sbatch", "--partition", "grace", "--nodes", "2", "--gpus", "1",
                      "--run-dir", "plain", "plain.py", str(progress), cwd=workspace)["job_id"]

    def step():
        return json.loads(progress.read_text())["step"] if progress.exists() else 0
    for at in (6, 18):
        wait_until(lambda: step() >= at, 240, f"plain step {at}")
        preempt(job)
    assert wait_until_done(job) == "COMPLETED"
    assert step() == 40
    events = read_jsonl(workspace / "plain" / "events.jsonl")
    ends = [e for e in events if e["event"] == "attempt_end"]
    assert [e["cause"] for e in ends] == ["preempted", "preempted", "completed"], ends
    assert all("PreemptTime=" in e["note"] for e in ends[:2])
    status = hpc_ddp("status", job, cwd=workspace).stdout
    assert "ended: preempted (exit code 143)" in status and "failed" not in status


@pytest.mark.slurm_core
@pytest.mark.slurm
def test_a_cancelled_plain_script_is_not_requeued(slurm_conf, workspace):
    (workspace / "plain.py").write_text(PLAIN)
    progress = workspace / "cancel-progress.json"
    job = submit_json("--executor", "sbatch", "--nodes", "2", "--gpus", "1", "--run-dir", "cancelled",
                      "plain.py", str(progress), cwd=workspace)["job_id"]
    wait_until(lambda: progress.exists(), 120, "the script to start")
    subprocess.run(["scancel", job], check=True)
    assert wait_until_done(job, 60) == "CANCELLED"
    time.sleep(3)
    assert job_field(job, "Restarts") == "0"
    ends = [e for e in read_jsonl(workspace / "cancelled" / "events.jsonl") if e["event"] == "attempt_end"]
    assert [e["cause"] for e in ends] in ([], ["cancelled"])  # the batch shell may be killed before it says so
    if sys.platform:  # status reads Slurm's word for it
        assert "CANCELLED" in hpc_ddp("status", job, cwd=workspace).stdout


# Lightning's way with SIGTERM, without its import: trap it, stop at the next step, exit 0.
TRAPS = PLAIN.replace('dist.init_process_group("gloo")', """dist.init_process_group("gloo")
import signal
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))""").replace(
    "    t = torch.ones(1)", "    if stop:\n        print('Bypassing SIGTERM', flush=True)\n        sys.exit(0)\n    t = torch.ones(1)")


@pytest.mark.slurm
def test_a_rehearsed_preemption_of_a_script_that_exits_0_at_sigterm_runs_it_again(slurm_conf, workspace):
    """Issue 54's newcomer: `hpc-ddp preempt --signal TERM` of a Lightning run on Slurm ended it COMPLETED at
    60% of its epochs (Lightning exits 0 at SIGTERM, and Slurm knows nothing of a rehearsal). The rehearsal
    is recorded now, so the attempt is preempted and the job runs again, to the end."""
    from .helpers import run_through_requeues

    (workspace / "traps.py").write_text(TRAPS)
    progress = workspace / "traps-progress.json"
    job = submit_json("--executor", "sbatch", "--nodes", "2", "--run-dir", "traps", "traps.py", str(progress),
                      cwd=workspace)["job_id"]
    wait_until(lambda: progress.exists() and json.loads(progress.read_text())["step"] >= 5, 120, "step 5")
    sent = hpc_ddp("preempt", "--signal", "TERM", job, cwd=workspace)
    assert sent.returncode == 0 and "counts as preempted" in sent.stdout + sent.stderr, sent.stdout + sent.stderr
    assert "leaves SIGTERM alone" not in sent.stdout + sent.stderr
    assert run_through_requeues(job, timeout=300, run_dir=workspace / "traps") == "COMPLETED"
    assert json.loads(progress.read_text())["step"] == 40
    ends = [e for e in read_jsonl(workspace / "traps" / "events.jsonl") if e["event"] == "attempt_end"]
    assert [(e["cause"], e["exit_code"]) for e in ends] == [("preempted", 0), ("completed", 0)], ends
    assert "rehearsed preemption" in ends[0]["note"]


def test_plain_script_sigtermed_under_the_local_executor_runs_again(workspace):
    """The local executor's rehearsal of a preemption: SIGTERM to the executor reaches every rank; a
    script with no handler dies of it, and that attempt is preempted, not failed."""
    (workspace / "plain.py").write_text(PLAIN)
    progress = workspace / "local-progress.json"
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "2",
                             "--tasks-per-node", "1", "--run-dir", "plain-local", "plain.py", str(progress)],
                            cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: progress.exists() and json.loads(progress.read_text())["step"] >= 5, 120, "step 5")
    proc.send_signal(subprocess.signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert json.loads(progress.read_text())["step"] == 40
    ends = [e for e in read_jsonl(workspace / "plain-local" / "events.jsonl") if e["event"] == "attempt_end"]
    assert [e["cause"] for e in ends] == ["preempted", "completed"], ends


LIGHTNING = """
# An unmodified Lightning DDP script: Lightning finds its ranks from Slurm's variables itself.
import json, os, sys
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", max_epochs=2,
                     enable_progress_bar=False, enable_checkpointing=False, logger=False)
trainer.fit(Model(), DataLoader(data, batch_size=16))
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank-{trainer.global_rank}.json"), "w") as fh:
    json.dump({"global_rank": trainer.global_rank, "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
               "world_size": trainer.world_size, "env": type(trainer.strategy.cluster_environment).__name__,
               "steps": trainer.global_step}, fh)
"""


@pytest.mark.slurm
def test_an_unmodified_lightning_script_runs_on_2_by_2(slurm_conf, workspace):
    pytest.importorskip("pytorch_lightning", reason="a test-only dependency (make install puts it in .venv)")
    (workspace / "lightning_ddp.py").write_text(LIGHTNING)
    out = workspace / "lightning-out"
    job = submit_json("--executor", "sbatch", "--nodes", "2", "--gpus", "2", "--run-dir", "lightning",
                      "lightning_ddp.py", str(out), cwd=workspace)["job_id"]
    assert wait_until_done(job, 300) == "COMPLETED", hpc_ddp("logs", job, cwd=workspace).stdout[-3000:]
    seen = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["global_rank"])
    assert [(r["global_rank"], r["node_rank"], r["local_rank"]) for r in seen] == [(0, 0, 0), (1, 0, 1), (2, 1, 0),
                                                                                  (3, 1, 1)]
    assert {r["world_size"] for r in seen} == {4} and {r["steps"] for r in seen} == {8}  # 256 / 4 ranks / 16 x 2


@pytest.mark.slurm_core
@pytest.mark.slurm
def test_plain_script_through_submitit_is_run_again_after_a_real_preemption(slurm_conf, workspace):
    (workspace / "plain.py").write_text(PLAIN)
    progress = workspace / "submitit-progress.json"
    job = submit_json("--executor", "submitit", "--partition", "grace", "--nodes", "2", "--gpus", "1",
                      "--run-dir", "plain-submitit", "plain.py", str(progress), cwd=workspace)["job_id"]
    wait_until(lambda: progress.exists() and json.loads(progress.read_text())["step"] >= 6, 240, "step 6")
    preempt(job)
    assert wait_until_done(job) == "COMPLETED"
    assert json.loads(progress.read_text())["step"] == 40
    ends = [e for e in read_jsonl(workspace / "plain-submitit" / "events.jsonl") if e["event"] == "attempt_end"]
    assert [e["cause"] for e in ends] == ["preempted", "completed"], ends
