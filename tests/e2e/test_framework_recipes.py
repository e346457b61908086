"""The framework recipes of docs/frameworks.md, run from the page itself (issue 54): the Lightning Trainer
script there, as written, is preempted with `hpc-ddp preempt --signal TERM` under the local executor and its
next attempt goes on from Lightning's own checkpoint, not from step 0; the warnings the page shows are what
`submit`'s scan says of that script without its resume, and without its pinned `dirpath`; and without it,
the start over that follows is a line in `status` and `timeline`. The accelerate and Hugging Face recipes, as
written, and Fabric's, are stopped the same way on two ranks and go on from their own checkpoint, and after a
save cut short the first two go on from the whole checkpoint before it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.checks.frameworks import framework_notes
from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, stop, wait_until

pytestmark = pytest.mark.e2e
PAGE = Path(__file__).resolve().parents[2] / "docs" / "frameworks.md"


def recipe(name: str) -> str:
    text = PAGE.read_text()
    found = re.search(rf"<!-- recipe: {name} -->\n```python\n(.*?)\n```", text, re.S)
    assert found, f"no recipe {name!r} in {PAGE}"
    return found.group(1) + "\n"


def test_the_warnings_shown_are_what_the_scan_says_of_the_recipe_without_its_resume_or_its_dirpath():
    script = recipe("lightning")
    assert [n.level for n in framework_notes(script, "fit.py")] == ["ok"]  # the recipe itself: nothing to say
    shown = [line for line in PAGE.read_text().splitlines() if line.startswith("hpc-ddp: warning: fit")]
    said = [framework_notes(script.replace(', ckpt_path="last"', ""), "fit.py")[0],
            framework_notes(script.replace("dirpath=checkpoints, ", ""), "fit2.py")[1]]
    assert shown == [f"hpc-ddp: warning: {n.message} HINT: {n.hint}" for n in said]


def _preempted_once(tmp_path: Path, script: str, ready, *options: str, env: dict | None = None) -> str:
    """Submit `script` under the local executor, send SIGTERM once `ready()`, return the whole output."""
    (tmp_path / "fit.py").write_text(script)
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", *options,
                             "--run-dir", "run", "fit.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "EPOCHS": "30", **(env or {})})
    try:
        wait_until(lambda: ready() or proc.poll() is not None, 180, "the first checkpoint")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        sent = hpc_ddp("preempt", "--signal", "TERM", "run", cwd=tmp_path, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        out, _ = proc.communicate(timeout=400)
    finally:
        stop(proc)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_the_lightning_recipe_preempted_here_goes_on_from_its_own_checkpoint(tmp_path):
    """On 2 nodes (issue 54's newcomer: without devices and num_nodes each rank trained alone, both "rank 0",
    resuming at different steps): the ranks join one DDP job, and both resume at the same step."""
    out = _preempted_once(tmp_path, recipe("lightning"),
                          lambda: (tmp_path / "run" / "lightning-checkpoints" / "last.ckpt").exists(),
                          "--nodes", "2", "--tasks-per-node", "1")
    ends = [e["cause"] for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e.get("event") == "attempt_end"]
    assert ends == ["preempted", "completed"], (ends, out[-3000:])
    assert out.count("MEMBER: 2/2") == 2, out[-3000:]   # each attempt: one DDP job of 2 ranks
    starts = [int(s) for s in re.findall(r"training from step (\d+)", out)]
    assert starts[:2] == [0, 0] and len(starts) == 4 and starts[2] == starts[3] > 0, (starts, out[-3000:])
    assert "is available on your system but is not used" not in out  # Lightning's srun remark: not here
    assert out.count("there is no last checkpoint available") == 1  # the first attempt's, which has none yet


def test_a_lightning_run_that_started_over_says_so_in_status_and_timeline(tmp_path):
    """The recipe without its dirpath: Lightning saves under lightning_logs/version_0, the next attempt looks in
    version_1, finds nothing and trains from step 0; status and timeline say so, with the fix."""
    script = recipe("lightning").replace("dirpath=checkpoints, ", "")
    out = _preempted_once(tmp_path, script, lambda: bool(list(tmp_path.glob("lightning_logs/version_0/checkpoints/*"))))
    assert out.count("there is no last checkpoint available") == 2, out[-3000:]  # the start over itself
    said = ('! attempt 1 started over from step 0: Lightning found no checkpoint to resume ("there is no last '
            'checkpoint available") HINT: give ModelCheckpoint a dirpath that stays the same across attempts')
    status = hpc_ddp("status", "run", cwd=tmp_path)
    assert said in status.stdout, status.stdout
    timeline = hpc_ddp("timeline", "run", cwd=tmp_path)
    assert timeline.returncode == 0 and said in timeline.stdout, timeline.stdout + timeline.stderr


# On two ranks, with a sleep after each optimizer step (the recipes train a tiny model in milliseconds a
# step) so that the stop lands while they train.
SLOW_STEP = ("    opt.zero_grad()\n", "    opt.zero_grad()\n    __import__('time').sleep(0.02)\n")


def _ends(run: Path) -> list[str]:
    return [e["cause"] for e in read_jsonl(run / "events.jsonl") if e.get("event") == "attempt_end"]


@pytest.mark.extended
def test_the_accelerate_recipe_preempted_on_two_ranks_goes_on_from_its_own_save(tmp_path):
    script = recipe("accelerate").replace(*SLOW_STEP)
    assert [n.level for n in framework_notes(recipe("accelerate"), "fit.py")] == ["ok"]
    out = _preempted_once(tmp_path, script, lambda: (tmp_path / "run" / "accelerate-latest").exists(), "--nodes", "2",
                          env={"STEPS": "600"})
    assert _ends(tmp_path / "run") == ["preempted", "completed"], out[-3000:]
    starts = [int(s) for s in re.findall(r"\[rank 0\] training from step (\d+)", out)]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] > 0 and starts[1] % 20 == 0, (starts, out[-3000:])
    assert (tmp_path / "run" / "accelerate-latest").read_text() == "600"
    assert [p.name for p in (tmp_path / "run").glob("accelerate-state-*")] == ["accelerate-state-600"]


@pytest.mark.extended
def test_the_fabric_recipe_preempted_on_two_ranks_goes_on_from_its_own_checkpoint(tmp_path):
    assert [n.level for n in framework_notes(recipe("fabric"), "fit.py")] == ["ok"]
    out = _preempted_once(tmp_path, recipe("fabric").replace(*SLOW_STEP),
                          lambda: (tmp_path / "run" / "fabric.ckpt").exists(), "--nodes", "2", env={"STEPS": "600"})
    assert _ends(tmp_path / "run") == ["preempted", "completed"], out[-3000:]
    starts = [int(s) for s in re.findall(r"\[rank 0\] training from step (\d+)", out)]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] > 0 and starts[1] % 20 == 0, (starts, out[-3000:])


def test_the_hugging_face_recipe_preempted_on_two_ranks_goes_on_from_its_own_checkpoint(tmp_path):
    assert [n.level for n in framework_notes(recipe("hf"), "fit.py")] == ["ok"]
    saved = lambda: bool(list((tmp_path / "run" / "hf-checkpoints").glob("checkpoint-*/trainer_state.json")))  # noqa: E731
    # info, so that the Trainer says when it resumes (and a start over would be seen: hpc_ddp.watch.startover)
    out = _preempted_once(tmp_path, recipe("hf"), saved, "--nodes", "2",
                          env={"STEPS": "1200", "TRANSFORMERS_VERBOSITY": "info"})
    assert _ends(tmp_path / "run") == ["preempted", "completed"], out[-3000:]
    resumed = {int(s) for s in re.findall(r"Resuming training from checkpoint with epoch \d+ and global step (\d+)", out)}
    assert len(resumed) == 1 and min(resumed) > 0 and min(resumed) % 20 == 0, out[-3000:]  # both ranks, one step
    status = hpc_ddp("status", "run", cwd=tmp_path)
    assert "started over" not in status.stdout, status.stdout
    assert (tmp_path / "run" / "hf-checkpoints" / "checkpoint-1200" / "trainer_state.json").exists()


def _plain(tmp_path: Path, name: str, steps: int) -> subprocess.CompletedProcess:
    """The recipe as one plain process (no hpc-ddp), in `tmp_path`/run as its run dir."""
    (tmp_path / f"train_{name}.py").write_text(recipe(name))  # not accelerate.py, which would shadow accelerate
    env = {**os.environ, "HPC_DDP_RUN_DIR": str(tmp_path / "run"), "STEPS": str(steps), "TRANSFORMERS_VERBOSITY": "info"}
    for name_ in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name_, None)
    done = subprocess.run([sys.executable, f"train_{name}.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.extended
def test_after_a_save_cut_short_the_accelerate_recipe_goes_on_from_the_whole_save_before_it(tmp_path):
    (tmp_path / "run").mkdir()
    _plain(tmp_path, "accelerate", 40)
    torn = tmp_path / "run" / "accelerate-state-60"  # what a preemption during save_state leaves
    shutil.copytree(tmp_path / "run" / "accelerate-state-40", torn)
    (torn / "optimizer.bin").write_bytes(b"")
    done = _plain(tmp_path, "accelerate", 80)
    assert "training from step 40" in done.stdout, done.stdout
    assert (tmp_path / "run" / "accelerate-latest").read_text() == "80"


def test_after_a_save_cut_short_the_hugging_face_recipe_goes_on_from_the_whole_checkpoint_before_it(tmp_path):
    (tmp_path / "run").mkdir()
    _plain(tmp_path, "hf", 40)
    folder = tmp_path / "run" / "hf-checkpoints"
    torn = folder / "checkpoint-60"  # cut short before the Trainer wrote trainer_state.json
    shutil.copytree(folder / "checkpoint-40", torn)
    (torn / "trainer_state.json").unlink()
    (torn / "optimizer.pt").write_bytes(b"")
    done = _plain(tmp_path, "hf", 80)
    said = done.stdout + done.stderr
    assert "Resuming training from checkpoint with epoch 0 and global step 40" in said, said[-3000:]
    assert (folder / "checkpoint-80" / "trainer_state.json").exists()
