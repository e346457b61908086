"""A sharded model (FSDP2, `fully_shard`) through the Session API on the local executor, every rank writing
its shards (trainer.sharded), issue 52: a 4-rank checkpoint resumes on 4 ranks bitwise, and on 2 and on 3
ranks with the uninterrupted run's exact (epoch, index) multiset and its weights to within float rounding;
a checkpoint missing one rank's shard, or with a corrupt one, is never loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_ddp.trainer.checkpoint import CheckpointManager
from hpc_ddp.trainer.consolidate import consolidated_state

from .helpers import hpc_ddp, trained_keys

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).with_name("elastic_keys.py")
FSDP = {"KEYS_FSDP": "1"}


def _submit(where: Path, run_dir: str, *options: str, env: dict | None = None):
    keys = where / f"{run_dir}-keys"
    keys.mkdir(exist_ok=True)
    return hpc_ddp("submit", "--executor", "local", *options, "--run-dir", run_dir, "elastic_keys.py", "--",
                   str(keys), cwd=where, env={**FSDP, **(env or {})})


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = CheckpointManager(run_dir / "checkpoints", log=lambda _m: None).candidates()[0]
    return consolidated_state(latest)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """An uninterrupted 4-rank run, and one stopped at step 5 (a sharded checkpoint of 4 ranks)."""
    where = tmp_path_factory.mktemp("sharded")
    shutil.copy(SCRIPT, where)
    whole = _submit(where, "whole", "--nodes", "4")
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    cut = _submit(where, "cut", "--nodes", "4", "--max-preemptions", "0", env={"HPC_DDP_FAULT_STOP_AT": "5"})
    assert cut.returncode != 0 and "checkpointed" in cut.stderr, cut.stdout[-2000:] + cut.stderr[-3000:]
    shards = sorted(p.name for p in (where / "cut" / "checkpoints").glob("step-*/__*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]  # every rank wrote
    return where


def _resume_copy(where: Path, name: str, *nodes: str, env: dict | None = None):
    shutil.copytree(where / "cut", where / name)
    shutil.copytree(where / "cut-keys", where / f"{name}-keys")
    return _submit(where, name, *nodes, env=env)


@pytest.mark.parametrize("nodes,world", [("4", 4), ("1-2", 2), ("1-3", 3)])
def test_a_4_rank_sharded_checkpoint_resumes_on_4_2_and_3_ranks_with_the_exact_samples(stopped, nodes, world):
    name = f"on{world}"
    done = _resume_copy(stopped, name, "--nodes", nodes)   # locally a range runs on its most
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "resumed from" in out and "(step 5," in out
    if world != 4:
        assert f"resumed on {world} ranks (saved by 4)" in out
    assert trained_keys(stopped / f"{name}-keys") == trained_keys(stopped / "whole-keys")
    whole, resumed = _weights(stopped / "whole"), _weights(stopped / name)
    if world == 4:  # the same shards, the same reduction order: bitwise
        assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    else:
        # The same samples and the same global batch, summed in another order (accumulation over micro-steps,
        # an all-reduce over fewer ranks): fp32 rounding differs in the last bits of a step's gradient, and
        # AdamW carries that along for 19 steps. Measured (2026-12-02): at most 1.2e-7 apart (one ulp at 1.0),
        # 4e-6 relative on the smallest weight. The bound is 8 ulps at 1.0 or 1e-5 relative; a sample more or
        # less, or a wrong loss weight, moved weights by 1e-2 here (a sum loss with loss_weight(), which is for
        # a mean: 0.0134).
        for k in whole:
            assert torch.allclose(whole[k], resumed[k], rtol=1e-5, atol=1e-6), (k, (whole[k] - resumed[k]).abs().max())


@pytest.mark.parametrize("damage", [pytest.param("missing", marks=pytest.mark.extended), "corrupt"])
def test_a_checkpoint_missing_a_rank_shard_or_with_a_corrupt_one_is_never_loaded(stopped, damage):
    """A second checkpoint (step 9) on top of step 5; one rank's shard of it is taken away, or one bit of it
    flipped: every rank skips it, says why, and resumes from step 5."""
    name = f"damaged-{damage}"
    again = _resume_copy(stopped, name, "--nodes", "4", "--max-preemptions", "0",
                         env={"HPC_DDP_FAULT_STOP_AT": "9"})
    assert again.returncode != 0 and "checkpointed" in again.stderr, again.stderr[-3000:]
    step9 = CheckpointManager(stopped / name / "checkpoints", log=lambda _m: None).candidates()[0]
    assert step9.name == "step-000000009"
    shard = step9 / "__2_0.distcp"
    if damage == "missing":
        shard.unlink()
    else:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    done = _submit(stopped, name, "--nodes", "1-3")   # and on another world size: every rank agrees to skip it
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    why = "is missing (the manifest lists it)" if damage == "missing" else "is damaged: sha256 does not match"
    assert f"checkpoint file {shard} {why}" in out and "trying the previous checkpoint" in out, out[-4000:]
    assert "(step 5," in out and "(step 9," not in out


@pytest.mark.extended
def test_export_writes_one_file_the_unsharded_model_loads_and_its_outputs_match_the_sharded_ones(stopped):
    """`hpc-ddp export` of the uninterrupted 4-rank run: torch.load (weights only) into a plain, unsharded
    model, whose outputs on a probe are the sharded model's as the run computed them at its end."""
    to = stopped / "exported.pt"
    done = hpc_ddp("export", "whole", "--to", str(to), cwd=stopped)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {to}: the model of whole/checkpoints/step-000000024 (step 24), 4 tensors")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    plain.load_state_dict(torch.load(to, weights_only=True))
    ours = plain(torch.linspace(0, 1, 7).view(-1, 1)).detach().view(-1)
    theirs = torch.tensor(json.loads((stopped / "whole-keys" / "probe.json").read_text()))
    assert torch.equal(ours, theirs), (ours, theirs)
    inspected = json.loads(hpc_ddp("inspect", "--json", "whole", cwd=stopped).stdout)
    assert done.stdout.split("sha256 of its state ")[1][:16] == inspected["model_sha256"][:16]
    again = hpc_ddp("export", "whole", "--to", str(to), cwd=stopped)
    assert again.returncode == 2 and "exists; export never replaces a file" in again.stderr
    wrong = hpc_ddp("export", "whole", "--step", "7", "--to", str(stopped / "x.pt"), cwd=stopped)
    assert wrong.returncode == 2 and "no checkpoint of step 7" in wrong.stderr and "steps there: 24" in wrong.stderr


GPT_JOB = """[train]
dataset = "tokens"
data_dir = "tokens"
model = "gpt"
strategy = "fsdp"
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
batch_size = 4
epochs = 2
optimizer = "adamw"
lr = 0.003
weight_decay = 0.0
num_workers = 0
log_every = 8
checkpoint_every_steps = 10
"""


@pytest.fixture(scope="module")
def gpt_project(tmp_path_factory):
    where = tmp_path_factory.mktemp("gpt")
    made = hpc_ddp("make-dataset", "tokens", "tokens", "--train", "6000", "--test", "1200", cwd=where)
    assert made.returncode == 0, made.stderr
    (where / "job.toml").write_text(GPT_JOB)
    return where


def test_the_trainer_shards_a_gpt_stops_and_resumes_it_bitwise_and_exports_it(gpt_project):
    """strategy = "fsdp" with the gpt model on nanoGPT-format tokens, 2 ranks: saved in the background every 10
    steps, stopped at step 23 (mid-epoch 1 of 2, 46 steps each), requeued, resumed, it ends with the uninterrupted
    run's weights; the memory per rank is in the log and in status; `hpc-ddp export` loads into the
    unsharded model."""
    def submit(run_dir, env=None):
        return hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--tasks-per-node", "1", "--run-dir", run_dir,
                       "job.toml", cwd=gpt_project, env=env, timeout=600)

    whole = submit("whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    out = whole.stdout + whole.stderr
    assert "memory per rank:" in out and "(sharded over 2 ranks)" in out and "eval loss" in out
    cut = submit("cut", env={"HPC_DDP_FAULT_STOP_AT": "23"})
    out = cut.stdout + cut.stderr
    assert cut.returncode == 0 and "checkpointing at step 23" in out and "resumed from" in out, out[-3000:]
    shas = [json.loads(hpc_ddp("inspect", "--json", run, cwd=gpt_project).stdout)["model_sha256"]
            for run in ("whole", "cut")]
    assert shas[0] == shas[1]
    records = [json.loads(line) for line in (gpt_project / "cut" / "events.jsonl").read_text().splitlines()]
    saves = [(r["step"], r["reason"], r.get("background", False)) for r in records if r["event"] == "checkpoint"]
    assert saves[:3] == [(10, "periodic", True), (20, "periodic", True), (23, "stop", False)], saves
    assert saves[-1] == (92, "final", False) and {s[2] for s in saves if s[1] == "periodic"} == {True}, saves
    status = hpc_ddp("status", "cut", cwd=gpt_project).stdout
    assert "memory per rank" in status and "(fsdp, 2 ranks)" in status, status

    from hpc_ddp.trainer.models import GPT

    assert hpc_ddp("export", "cut", "--to", "gpt.pt", cwd=gpt_project).returncode == 0
    model = GPT(vocab=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model.load_state_dict(torch.load(gpt_project / "gpt.pt", weights_only=True))
    tokens = torch.from_numpy(__import__("numpy").fromfile(gpt_project / "tokens" / "val.bin", dtype="<u2")[:17]
                              .astype("int64"))
    loss = torch.nn.functional.cross_entropy(model(tokens[None, :16]), tokens[None, 1:])
    assert loss < 5.3  # ln(256) = 5.55 untrained: the exported weights are the trained ones


def test_the_gpt_job_file_plans_as_shipped(tmp_path):
    """jobs/gpt_tokens_fsdp.toml, beside the tokens its comment says to make: the dry run plans it as an
    FSDP job of 4 nodes x 8 GPUs (nothing submitted)."""
    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "jobs", tmp_path / "jobs")
    assert hpc_ddp("make-dataset", "tokens", "data/tokens", "--train", "5000", "--test", "500",
                   cwd=tmp_path).returncode == 0
    done = hpc_ddp("submit", "--dry-run", "--json", "jobs/gpt_tokens_fsdp.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout[done.stdout.index("{"):])
    assert "#SBATCH --nodes=4" in plan["script"] and "#SBATCH --gpus-per-node=8" in plan["script"], plan["script"][:800]
    import tomllib

    from hpc_ddp.spec.trainconfig import parse_train

    cfg = parse_train(tomllib.loads((tmp_path / "jobs" / "gpt_tokens_fsdp.toml").read_text())["train"])
    assert (cfg.strategy, cfg.model, cfg.dataset) == ("fsdp", "gpt", "tokens")


SAVE_ON_RANK_0 = """
import hpc_ddp, torch
from torch.distributed.fsdp import fully_shard
run = hpc_ddp.start()
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
fully_shard(model)
run.track(model=model, optimizer=torch.optim.AdamW(model.parameters()))
if run.rank == 0:
    run.save()
"""


def test_a_sharded_save_on_one_rank_only_is_named_before_any_shard_is_written(tmp_path):
    (tmp_path / "misuse.py").write_text(SAVE_ON_RANK_0)
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--tasks-per-node", "1", "--run-dir", "misuse",
                   "misuse.py", cwd=tmp_path, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "failed (exit code 2)" in done.stderr, out[-3000:]
    assert ("save() is collective, but rank 1 (localhost) left the run (finished) without calling it (rank 0 did) "
            "HINT: call run.save() on every rank; every rank writes its shards of the checkpoint") in out, out[-3000:]
    assert "Traceback" not in out and not list((tmp_path / "misuse" / "checkpoints").glob("*step-*"))


def test_a_checkpoint_of_the_other_kind_is_refused_in_one_line(tmp_path):
    """A DDP run's checkpoint resumed with the model sharded, and a sharded one resumed under DDP: one line
    each, exit 2, the fix named; nothing is loaded."""
    shutil.copy(SCRIPT, tmp_path)
    for name, first, then, said, hint in (
            ("ddp", {}, FSDP, "it was saved from an unsharded model (DDP or plain), and this run's model is sharded",
             "HINT: resume with the model the run saved"),
            ("fsdp", FSDP, {}, "they were saved from a sharded model (fully_shard), and this run's model is not "
             "sharded", "hpc-ddp export RUN --to model.pt")):
        keys = tmp_path / f"{name}-keys"
        keys.mkdir()
        run = ("submit", "--executor", "local", "--nodes", "2", "--run-dir", name, "elastic_keys.py", "--", str(keys))
        env = {k: v for k, v in os.environ.items() if k != "KEYS_FSDP"}
        stopped = subprocess.run([sys.executable, "-m", "hpc_ddp", *run[:1], "--max-preemptions", "0", *run[1:]],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                 env={**env, **first, "HPC_DDP_FAULT_STOP_AT": "3"})
        assert "checkpointed" in stopped.stderr, stopped.stderr[-3000:]
        again = subprocess.run([sys.executable, "-m", "hpc_ddp", *run], cwd=tmp_path, capture_output=True, text=True,
                               timeout=300, env={**env, **then})
        out = again.stdout + again.stderr
        assert again.returncode != 0 and "failed (exit code 2)" in again.stderr, out[-3000:]
        assert said in out and hint in out and "Traceback" not in out, out[-3000:]
