"""Ranks in a real container (charliecloud's ch-run, from Debian), in an image built from this machine's own
Python (tests/cluster/ch-image.sh): a DDP script on the Session API, on 2 nodes of the test Slurm, preempted
for real once and resumed; and through the local executor. The image has no hpc_ddp: the ranks import the
run dir's copy, and the runner's environment, checkpoint and exit 75 work as without a container."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, job_field, last_step, preempt, submit_json, wait_until

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
STEPS = 300

SCRIPT = f"""
import json, os, sys, time
import hpc_ddp
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

run = hpc_ddp.start(checkpoint_every_steps=50)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 4)
y = x.sum(1, keepdim=True)
run.track(model=model, optimizer=opt)
run.resume()
attempt = os.environ["HPC_DDP_RESTART_COUNT"]
seen = dict(rank=run.rank, node=os.environ.get("SLURMD_NODENAME", "local"), hpc_ddp=hpc_ddp.__file__,
            python=sys.executable, in_image=os.path.exists("/hpc-ddp-test-image"), start_step=run.progress.step)
with open(os.path.join(os.environ["HPC_DDP_RUN_DIR"], f"probe-{{attempt}}-{{run.rank}}.json"), "w") as fh:
    json.dump(seen, fh)
for epoch in run.epochs(int(os.environ.get("HPC_DDP_TEST_STEPS", {STEPS})), batches_per_epoch=1):
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.1)
    run.step(loss)
run.finish()
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The image, the script and a job file that runs it in the container, 2 nodes x 1 rank on CPUs."""
    root = tmp_path_factory.mktemp("container")
    built = subprocess.run(["bash", str(REPO / "tests/cluster/ch-image.sh"), str(root / "image"), sys.executable],
                           capture_output=True, text=True)
    if built.returncode == 3:
        pytest.skip(built.stderr.strip())
    assert built.returncode == 0, built.stderr
    (root / "ddp.py").write_text(SCRIPT)
    table = {"runtime": "charliecloud", "image": str(root / "image"), "python": sys.executable,
             "args": built.stdout.split()}
    (root / "job.toml").write_text(f'script = "ddp.py"\nnodes = 2\ntasks_per_node = 1\ncontainer = {_toml(table)}\n')
    return root


def _toml(table: dict) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + " }"


def probes(run_dir: Path, attempt: int) -> list[dict]:
    return [json.loads((run_dir / f"probe-{attempt}-{r}.json").read_text()) for r in range(2)]


def assert_in_the_container(seen: list[dict], run_dir: Path) -> None:
    for rank in seen:
        assert rank["in_image"], rank  # the image's root: its marker file is there
        assert rank["hpc_ddp"] == str(run_dir / "hpc-ddp-src" / "hpc_ddp" / "__init__.py"), rank  # the run dir's copy
        assert rank["python"] == sys.executable


@pytest.mark.slurm
@pytest.mark.extended
def test_ddp_in_a_container_on_two_nodes_is_preempted_and_resumed(slurm_conf, workspace):
    job = submit_json("--partition", "debug", "--run-dir", "slurm", "job.toml", cwd=workspace)["job_id"]
    run_dir = workspace / "slurm"
    wait_until(lambda: last_step(run_dir) >= 60, 240, "step 60")
    preempt(job)
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    wait_until(lambda: job_field(job, "JobState") in ended, 300, f"job {job} to end")
    log = "\n".join(p.read_text() for p in sorted(run_dir.glob("logs/**/*.*")))
    assert job_field(job, "JobState") == "COMPLETED", log[-3000:]
    first, second = probes(run_dir, 0), probes(run_dir, 1)
    assert_in_the_container(first + second, run_dir)
    assert [r["node"] for r in first] == ["hpcn1", "hpcn2"]
    assert first[0]["start_step"] == 0 and second[0]["start_step"] >= 60  # resumed from the checkpoint
    events = read_jsonl(run_dir / "events.jsonl")
    ends = [e["cause"] for e in events if e["event"] == "attempt_end"]
    assert ends == ["preempted", "completed"], events
    assert last_step(run_dir) == STEPS
    # SIGTERM reached the program inside the container: it checkpointed and asked for the requeue (75).
    assert any(e["event"] == "attempt_end" and e.get("exit_code") == 75 for e in events), events


@pytest.mark.extended
def test_ddp_in_a_container_through_the_local_executor(workspace):
    done = hpc_ddp("submit", "--executor", "local", "--run-dir", "local", "job.toml", cwd=workspace, timeout=300,
                   env={"HPC_DDP_TEST_STEPS": "20"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert_in_the_container(probes(workspace / "local", 0), workspace / "local")
    assert last_step(workspace / "local") == 20
