"""Issue 27: the frameworks researchers use survive real preemption on the test Slurm, unmodified.

An unmodified Lightning script catches SIGTERM and leaves with exit code 0; a plain script may trap SIGTERM,
save and exit 0 too. Neither is a completion: hpc-ddp asks Slurm what happened and runs the job again, once
per stop, and the script resumes from its own checkpoint. Jobs run side by side (2 nodes x 1 task each)
and one urgent job preempts them all, so the suite pays for one preemption, not one per case. A script
that leaves with exit 0 at the time-limit warning runs under the local executor, which emulates the limit.

On Slurm (FW_HOLD_AT=40) each script's first attempt waits at step 40 for its preemption (the test's
pacing, like its sleeps; the local rehearsals that run these scripts set nothing, so nothing waits): jobs
start at different speeds (Lightning imports for tens of seconds), and on CI a plain script once trained all
its steps and completed while the test still waited for Lightning to reach its step, so it was never preempted.
"""

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import CREDENTIAL_SECOND_S, explain_job, hpc_ddp, job_field, start_now, submit_json, wait_until

pytestmark = pytest.mark.e2e

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
HOLD_ENV = {"FW_HOLD_AT": "40"}  # past every test's random step (7-29); the scripts read it, other tests leave it unset

LIGHTNING = """
# An unmodified Lightning 2 DDP script with Lightning's own checkpoints and resume: nothing of hpc_ddp.
import os, sys, time
import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1]
# the test's pacing on Slurm (FW_HOLD_AT): the first attempt waits at that step for its preemption
HOLD = int(os.environ.get("FW_HOLD_AT") or 0) if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, _index):
        while HOLD and self.global_step >= HOLD and not self.trainer.received_sigterm:
            time.sleep(0.1)
        time.sleep(0.25)
        with open(os.path.join(out, f"steps-{self.global_rank}.txt"), "a") as fh:
            fh.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {self.global_step}\\n")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(640, 8), torch.randn(640, 1))
trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_steps=80,
                     callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), save_last=True,
                                                every_n_train_steps=5)],
                     enable_progress_bar=False, logger=False)
trainer.fit(Model(), DataLoader(data, batch_size=8), ckpt_path="last")
with open(os.path.join(out, f"done-{trainer.global_rank}.txt"), "w") as fh:
    fh.write(str(trainer.global_step))
"""

HF_TRAINER = """
# A Hugging Face Trainer script: a tiny BERT built from a config (no download), its own checkpoints
# every 5 steps, and resume from the newest complete one. The Trainer writes checkpoint-N in place, and
# trainer_state.json last: get_last_checkpoint alone would pick a folder a preemption cut short.
import os, sys, time
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

out = sys.argv[1]
# the test's pacing on Slurm (FW_HOLD_AT): the first attempt waits at that step for its preemption
HOLD = int(os.environ.get("FW_HOLD_AT") or 0) if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 640

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 100, (16,), generator=g), "labels": torch.tensor(i % 2)}


class Steps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.25)
        with open(os.path.join(out, f"steps-{args.process_index}.txt"), "a") as fh:
            fh.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {state.global_step - 1}\\n")
        while HOLD and state.global_step >= HOLD:
            time.sleep(0.1)  # the test's pacing on Slurm: the first attempt waits here for its preemption


torch.manual_seed(0)
config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=32, num_labels=2)
args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=60, per_device_train_batch_size=8,
                         save_steps=5, logging_steps=10, report_to=[], use_cpu=True, disable_tqdm=True,
                         dataloader_num_workers=0)
trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens(),
                  callbacks=[Steps()])
last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
if last and not os.path.exists(os.path.join(last, "trainer_state.json")):
    done = [d for d in os.listdir(args.output_dir)
            if os.path.exists(os.path.join(args.output_dir, d, "trainer_state.json"))]
    last = os.path.join(args.output_dir, max(done, key=lambda d: int(d.split("-")[-1]))) if done else None
trainer.train(resume_from_checkpoint=last)
if trainer.is_world_process_zero():
    with open(os.path.join(out, "done.txt"), "w") as fh:
        fh.write(str(trainer.state.global_step))
"""

ACCELERATE = """
# An accelerate loop of one's own: save_state every 5 steps, load_state at start when one was saved.
# save_state writes its files in place, so a save cut short by a preemption would leave a torn folder
# (seen here: optimizer.bin empty, and every later attempt fails at load_state): each save goes to a new
# folder, and `latest` names it once every rank has written its part (os.replace is atomic).
import os, shutil, sys, time
import torch
from accelerate import Accelerator

out = sys.argv[1]
# the test's pacing on Slurm (FW_HOLD_AT): the first attempt waits at that step for its preemption
HOLD = int(os.environ.get("FW_HOLD_AT") or 0) if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0
latest = os.path.join(out, "latest")
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
start = 0
if os.path.exists(latest):
    start = int(open(latest).read())
    accelerator.load_state(os.path.join(out, f"state-{start}"))
for step in range(start, 60):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    time.sleep(0.25)
    with open(os.path.join(out, f"steps-{accelerator.process_index}.txt"), "a") as fh:
        fh.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {step}\\n")
    while HOLD and step + 1 >= HOLD:
        time.sleep(0.1)  # the test's pacing on Slurm: the first attempt waits here for its preemption
    if (step + 1) % 5 == 0:
        accelerator.save_state(os.path.join(out, f"state-{step + 1}"))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with open(latest + ".tmp", "w") as fh:
                fh.write(str(step + 1))
            os.replace(latest + ".tmp", latest)
            shutil.rmtree(os.path.join(out, f"state-{step + 1 - 5}"), ignore_errors=True)
if accelerator.is_main_process:
    with open(os.path.join(out, "done.txt"), "w") as fh:
        fh.write(str(step + 1))
"""

FABRIC = """
# A Lightning Fabric loop: fabric.save every 5 steps, fabric.load at start when the checkpoint exists.
# fabric.save is atomic (Lightning writes a temporary file and moves it into place), so as it stands.
import os, sys, time
import torch
import lightning as L

out = sys.argv[1]
# the test's pacing on Slurm (FW_HOLD_AT): the first attempt waits at that step for its preemption
HOLD = int(os.environ.get("FW_HOLD_AT") or 0) if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0
fabric = L.Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
state = {"model": model, "optimizer": opt, "step": 0}
ckpt = os.path.join(out, "fabric.ckpt")
if os.path.exists(ckpt):
    fabric.load(ckpt, state)
for step in range(state["step"], 60):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    time.sleep(0.25)
    with open(os.path.join(out, f"steps-{fabric.global_rank}.txt"), "a") as fh:
        fh.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {step}\\n")
    while HOLD and step + 1 >= HOLD:
        time.sleep(0.1)  # the test's pacing on Slurm: the first attempt waits here for its preemption
    if (step + 1) % 5 == 0:
        state["step"] = step + 1
        fabric.save(ckpt, state)
if fabric.global_rank == 0:
    with open(os.path.join(out, "done.txt"), "w") as fh:
        fh.write(str(step + 1))
"""

# handles the time-limit warning itself (SIGUSR2), saves and leaves with exit 0
HANDLES_WARNING = """
# Handles the time-limit warning itself: saves its progress and leaves with exit 0. The handler goes in
# first, before torch's seconds of import, so a warning that comes early is not missed.
import json, os, signal, sys, time
warned = []
signal.signal(signal.SIGUSR2, lambda *_: warned.append(1))
import torch, torch.distributed as dist

progress = sys.argv[1]
dist.init_process_group("gloo")
start = json.load(open(progress))["step"] if os.path.exists(progress) else 0
for step in range(start, 60):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.25)
    if dist.get_rank() == 0:
        with open(progress + ".tmp", "w") as fh:
            json.dump({"step": step + 1}, fh)
        os.replace(progress + ".tmp", progress)
    flag = torch.tensor([float(bool(warned))])
    dist.all_reduce(flag)
    if flag.item():
        print(f"rank {dist.get_rank()}: warned: saved at step {step + 1}, leaving with exit code 0", flush=True)
        sys.exit(0)
dist.destroy_process_group()
"""

# torchrun-style shapes, each with its own progress file (rank 0 writes it after every step)
PLAIN_HEAD = """
import json, os, signal, sys, time
import torch, torch.distributed as dist

progress = sys.argv[1]
# the test's pacing on Slurm (FW_HOLD_AT): the first attempt waits at that step for its preemption
HOLD = int(os.environ.get("FW_HOLD_AT") or 0) if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0
dist.init_process_group("gloo")
start = json.load(open(progress))["step"] if os.path.exists(progress) else 0
stop = []
"""
PLAIN_LOOP = """
def save(step):
    if dist.get_rank() == 0:
        with open(progress + ".tmp", "w") as fh:
            json.dump({"step": step}, fh)
        os.replace(progress + ".tmp", progress)

for step in range(start, 60):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.25)
    save(step + 1)
    while HOLD and step + 1 >= HOLD and not stop:
        time.sleep(0.1)  # the test's pacing on Slurm: the first attempt waits here for its preemption
    if stop:
        print(f"rank {dist.get_rank()}: SIGTERM: saved at step {step + 1}, leaving with exit code 0", flush=True)
        sys.exit(0)
dist.destroy_process_group()
"""
SHAPES = {
    # traps SIGTERM, saves and exits 0: the shape that was recorded "completed"
    "traps": PLAIN_HEAD + "signal.signal(signal.SIGTERM, lambda *_: stop.append(1))\n" + PLAIN_LOOP,
}
# A script that ignores SIGTERM is left to the decision tests (tests/job/test_compat_table.py): run here under
# the full suite's load, its second attempt once failed at gloo's connect (the first attempt's ranks, which
# ignore SIGTERM, were probably still being killed); to be looked into before it joins this run.


def _preempt_all(jobs: list[str]) -> None:
    """One urgent job that needs both nodes whole preempts every job; each is released at once once
    requeued (Slurm would hold it ~120 s)."""
    restarts = {job: int(job_field(job, "Restarts") or 0) for job in jobs}
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", "-o", "/dev/null",
                             "--wrap", "sleep 1"], capture_output=True, text=True, check=True).stdout.strip()
    for job in jobs:
        wait_until(lambda j=job: int(job_field(j, "Restarts") or 0) > restarts[j], 120, f"job {job} to be requeued",
                   explain=lambda j=job: explain_job(j))
    wait_until(lambda: job_field(urgent, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", None), 60, "urgent job")
    time.sleep(CREDENTIAL_SECOND_S)
    for job in jobs:
        start_now(job)


def _wait_done(job: str, timeout: float = 400) -> str:
    return wait_until(lambda: (job_field(job, "JobState") or "") in ENDED and job_field(job, "JobState"),
                      timeout, f"job {job} to end", explain=lambda: explain_job(job))


def _steps(out: Path, rank: int) -> list[tuple[int, int]]:
    """(attempt, step) for every step rank `rank` trained, in order."""
    path = out / f"steps-{rank}.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(a), int(b)) for a, b in (line.split() for line in lines)]


def _progress(path: Path) -> int:
    try:
        return json.loads(path.read_text())["step"]
    except (OSError, ValueError):
        return 0


def _resumed_at(trained: list[tuple[int, int]]) -> int:
    """The step the second attempt began at."""
    return next(step for attempt, step in trained if attempt == 1)


def _one_stop_then_completed(run_dir: Path, name: str) -> None:
    """The first attempt ended preempted. Where Slurm SIGKILLed the batch shell before it recorded the end
    (KillWait, 5 s here, after its SIGTERM at GraceTime 0; or the grace's end, when Lightning hangs: its
    2.6 SIGTERM handler calls dist.broadcast inside the signal handler, which can meet the other rank's
    all-reduce), the next attempt records it from Slurm's accounting (PREEMPTED), not as "killed"."""
    ends = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "attempt_end"]
    assert [e["cause"] for e in ends] == ["preempted", "completed"], (name, ends)


@pytest.mark.slurm
@pytest.mark.parametrize("seed", [27])
def test_unmodified_frameworks_preempted_for_real_are_run_again_and_complete(slurm_conf, tmp_path, seed):
    pytest.importorskip("pytorch_lightning", reason="a test-only dependency (make install puts it in .venv)")
    rng = random.Random(seed)
    jobs, outs = {}, {}
    # `lightning` (the unified package) at GraceTime 0, `pytorch_lightning` at GraceTime 15
    unified = LIGHTNING.replace("import pytorch_lightning as pl", "import lightning.pytorch as pl").replace(
        "from pytorch_lightning.callbacks", "from lightning.pytorch.callbacks")
    for name, partition, text in (("lightning-grace0", "debug", unified), ("lightning-grace15", "grace", LIGHTNING)):
        (tmp_path / f"{name}.py").write_text(text)
        outs[name] = tmp_path / f"{name}-out"
        outs[name].mkdir()
        jobs[name] = submit_json("--executor", "sbatch", "--partition", partition, "--nodes", "2", "--run-dir", name,
                                 f"{name}.py", str(outs[name]), cwd=tmp_path, env=HOLD_ENV)["job_id"]
    for name, text in SHAPES.items():
        (tmp_path / f"{name}.py").write_text(text)
        jobs[name] = submit_json("--executor", "sbatch", "--partition", "grace", "--nodes", "2", "--run-dir", name,
                                 f"{name}.py", str(tmp_path / f"{name}.json"), cwd=tmp_path, env=HOLD_ENV)["job_id"]
    # a random step of every job, past Lightning's first checkpoint
    at = {name: rng.randrange(7, 30) for name in jobs}
    for name in jobs:
        if name.startswith("lightning"):
            wait_until(lambda n=name: len(_steps(outs[n], 0)) >= at[n], 300, f"{name} step {at[name]}")
        else:
            wait_until(lambda n=name: _progress(tmp_path / f"{n}.json") >= at[n], 300, f"{name} step {at[name]}")
    _preempt_all(list(jobs.values()))
    states = {name: _wait_done(job) for name, job in jobs.items()}
    logs = {name: hpc_ddp("logs", job, cwd=tmp_path).stdout[-3000:] for name, job in jobs.items()}
    assert states == dict.fromkeys(jobs, "COMPLETED"), (states, logs)
    for name, job in jobs.items():
        assert job_field(job, "Restarts") == "1", name  # exactly one requeue for the one stop
        _one_stop_then_completed(tmp_path / name, name)
        status = json.loads(hpc_ddp("status", "--json", job, cwd=tmp_path).stdout)
        assert [a["ended"] for a in status["attempts"]] == ["preempted", "completed"], (name, status["attempts"])
    for name in ("lightning-grace0", "lightning-grace15"):
        out = outs[name]
        assert (out / "done-0.txt").read_text() == "80"
        trained = _steps(out, 0)
        assert {step for _, step in trained} == set(range(80)), name
        # the second attempt resumed from Lightning's own last.ckpt (a multiple of 5), not from step 0
        resumed_at = _resumed_at(trained)
        assert resumed_at % 5 == 0 and resumed_at > 0, (name, resumed_at)
    for name in SHAPES:
        assert _progress(tmp_path / f"{name}.json") == 60, name
    grace0 = [e for e in read_jsonl(tmp_path / "lightning-grace0" / "events.jsonl") if e["event"] == "requeue"]
    assert all(e["by"] == "slurm" for e in grace0)  # GraceTime 0: Slurm requeued it itself; hpc-ddp did not again


@pytest.mark.slurm
@pytest.mark.parametrize("seed", [28])
@pytest.mark.extended
def test_hugging_face_accelerate_and_fabric_preempted_for_real_resume_and_complete(slurm_conf, tmp_path, seed):
    """The Hugging Face Trainer (a tiny BERT from a config, save_steps=5, resume_from_checkpoint) at
    GraceTime 0, an accelerate loop of one's own (save_state/load_state) and a Lightning Fabric loop
    (fabric.save/load) at GraceTime 15: none handles SIGTERM, all die of it, and each runs again from its
    own newest checkpoint."""
    pytest.importorskip("transformers", reason="a test-only dependency (make install puts it in .venv)")
    pytest.importorskip("lightning", reason="a test-only dependency (make install puts it in .venv)")
    rng = random.Random(seed)
    jobs, outs = {}, {}
    for name, partition, text in (("hf-grace0", "debug", HF_TRAINER), ("accelerate-grace15", "grace", ACCELERATE),
                                  ("fabric-grace15", "grace", FABRIC)):
        (tmp_path / f"{name}.py").write_text(text)
        outs[name] = tmp_path / f"{name}-out"
        outs[name].mkdir()
        jobs[name] = submit_json("--executor", "sbatch", "--partition", partition, "--nodes", "2", "--run-dir", name,
                                 f"{name}.py", str(outs[name]), cwd=tmp_path, env=HOLD_ENV)["job_id"]
    at = {name: rng.randrange(7, 30) for name in jobs}
    for name in jobs:
        wait_until(lambda n=name: len(_steps(outs[n], 0)) >= at[n], 300, f"{name} step {at[name]}")
    _preempt_all(list(jobs.values()))
    states = {name: _wait_done(job) for name, job in jobs.items()}
    logs = {name: hpc_ddp("logs", job, cwd=tmp_path).stdout[-3000:] for name, job in jobs.items()}
    assert states == dict.fromkeys(jobs, "COMPLETED"), (states, logs)
    for name, job in jobs.items():
        assert job_field(job, "Restarts") == "1", name
        _one_stop_then_completed(tmp_path / name, name)
        assert (outs[name] / "done.txt").read_text() == "60"
        trained = _steps(outs[name], 0)
        assert {step for _, step in trained} == set(range(60)), name
        resumed_at = _resumed_at(trained)
        assert resumed_at % 5 == 0 and resumed_at > 0, (name, resumed_at)


@pytest.mark.extended
def test_a_script_that_leaves_with_exit_0_at_the_warning_runs_again_under_the_local_executor(tmp_path):
    """The time-limit warning column: the script's own SIGUSR2 handler saves and exits 0 before any
    SIGTERM; the rank recorded that the warning reached it, so the attempt is a time limit, and the local
    executor (which emulates Slurm's limit) runs it again until every step is done."""
    (tmp_path / "warned.py").write_text(HANDLES_WARNING)
    progress = tmp_path / "progress.json"
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--time", "0:25", "--signal-lead", "10",
                   "--run-dir", "run", "warned.py", str(progress), cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "leaving with exit code 0" in done.stdout
    assert _progress(progress) == 60
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert {e["rank"] for e in events if e["event"] == "warned"} == {"0", "1"}
    ends = [e["cause"] for e in events if e["event"] == "attempt_end"]
    assert ends[0] == "time_limit" and ends[-1] == "completed" and set(ends[1:-1]) <= {"time_limit"}, ends
