"""checks.frameworks beyond round 3's hostile cases: a Fabric loop that resumes with fabric.load is no
Lightning Trainer missing ckpt_path (it was warned as one), and every ModelCheckpoint(...) without dirpath
is named by its line, whichever line its arguments end on."""

from __future__ import annotations

import time

import pytest

from hpc_ddp.checks.frameworks import framework_notes

FABRIC = """import lightning as L
fabric = L.Fabric(accelerator="cpu")
state = {"step": 0}
if os.path.exists("ckpt"):
    fabric.load("ckpt", state)
"""


def test_a_fabric_loop_that_loads_its_state_resumes_and_one_that_does_not_is_told_how():
    assert [(n.level, n.message) for n in framework_notes(FABRIC, "loop.py")] == [
        ("ok", "loop.py uses Lightning Fabric and resumes from its own checkpoint: a preempted or timed-out job "
               "runs again and continues")]
    (note,) = framework_notes(FABRIC.replace('fabric.load("ckpt", state)', "pass"), "loop.py")
    assert note.level == "warning" and "fabric.load(PATH, state) at start" in note.hint


def test_each_model_checkpoint_without_dirpath_is_named_by_its_line():
    source = ('import lightning as L\nfrom lightning.pytorch.callbacks import ModelCheckpoint\n'
              'a = ModelCheckpoint(dirpath="fixed",\n    save_last=True)\n'
              'b = ModelCheckpoint(\n    save_last=True,\n    every_n_train_steps=5)\n'
              'trainer = L.Trainer(callbacks=[a, b])\ntrainer.fit(m, ckpt_path="last")\n')
    notes = framework_notes(source, "fit.py")
    assert [n.level for n in notes] == ["ok", "warning"] and notes[1].message.startswith("fit.py:5: ModelCheckpoint")
    # `dirpath` in a comment or string is no dirpath
    assert framework_notes(source.replace('dirpath="fixed",', '# dirpath="x"\n'), "fit.py")[1].message.startswith(
        "fit.py:3:")


def test_many_lightning_imports_stay_linear():
    source = "import lightning\n" * 50_000 + "fabric = Fabric()\n"
    started = time.monotonic()
    framework_notes(source, "big.py")
    assert time.monotonic() - started < 5


HF = """import os, time
from datetime import datetime
from transformers import Trainer, TrainingArguments
out = {out}
args = TrainingArguments(output_dir={arg}, save_steps=20)
Trainer(args=args).train(resume_from_checkpoint=True)
"""


def _moving(out: str, arg: str = "out") -> list:
    return [n for n in framework_notes(HF.format(out=out, arg=arg), "hf.py") if n.level == "warning"]


def test_an_hf_output_dir_that_is_new_at_each_attempt_is_named_with_its_line_and_the_pin():
    """Issue 54: the scan warns when the HF output_dir would move, and names the line."""
    for out, why in [('f"runs/{datetime.now():%Y%m%d-%H%M%S}"', "it holds datetime.now()"),
                     ('"runs/" + time.strftime("%H%M%S")', "it holds time.strftime('%H%M%S')"),
                     ('os.path.join("runs", os.environ["SLURM_RESTART_COUNT"])',
                      "it holds $SLURM_RESTART_COUNT, which changes at a requeue"),
                     ('f"out-{os.environ.get(\'SLURM_JOB_ID\')}"', "it holds $SLURM_JOB_ID, which changes at a chain's next job")]:
        (note,) = _moving(out)
        assert note.message == (f"hf.py:5: TrainingArguments(output_dir=...) is a new folder at each attempt ({why}): "
                                "the next attempt looks for its checkpoints there, finds none, and starts over"), note
        assert note.hint == 'output_dir=os.path.join(os.environ.get("HPC_DDP_RUN_DIR", "."), "hf-checkpoints")'
    (direct,) = _moving('"unused"', arg='f"runs/{time.time()}"')
    assert direct.message.startswith("hf.py:5:")


def test_a_fixed_folder_or_a_lightning_dirpath_of_the_run_dir_is_left_alone():
    assert _moving('"runs/bert"') == [] and _moving('os.path.join(os.environ["HPC_DDP_RUN_DIR"], "hf")') == []
    assert _moving('f"runs/{os.environ.get(\'EXPERIMENT\', \'x\')}-{3}"') == []
    lightning = ("import lightning as L, uuid\nfrom lightning.pytorch.callbacks import ModelCheckpoint\n"
                 "cb = ModelCheckpoint(dirpath=f'ckpt/{uuid.uuid4()}', save_last=True)\n"
                 "L.Trainer(callbacks=[cb]).fit(m, ckpt_path='last')\n")
    (note,) = [n for n in framework_notes(lightning, "fit.py") if n.level == "warning"]
    assert note.message.startswith("fit.py:3: ModelCheckpoint(dirpath=...) is a new folder at each attempt "
                                   "(it holds uuid.uuid4())") and '"lightning-checkpoints"' in note.hint
    assert [n.level for n in framework_notes(lightning.replace("f'ckpt/{uuid.uuid4()}'", "'ckpt'"), "fit.py")] == ["ok"]


LIGHTNING_FIT = """import lightning as L
trainer = L.Trainer(max_epochs=3)
trainer.fit(model, ckpt_path="last")
"""


@pytest.mark.parametrize("text,nodes,tasks,missing", [
    (LIGHTNING_FIT, 2, 1, "num_nodes"),
    (LIGHTNING_FIT, 1, 2, "devices"),
    (LIGHTNING_FIT, 2, 2, "num_nodes or devices"),
    (LIGHTNING_FIT.replace("import lightning as L", "import pytorch_lightning as pl").replace("L.", "pl."), 2, 1,
     "num_nodes"),
    (LIGHTNING_FIT.replace("L.Trainer(", "Trainer(").replace("import lightning as L",
                                                            "from lightning import Trainer"), 2, 1, "num_nodes"),
])
def test_a_lightning_trainer_that_does_not_say_its_size_is_named_on_a_job_of_several_ranks(text, nodes, tasks, missing):
    """Issue 54's newcomer: on 2 nodes a Trainer left at num_nodes=1 made each rank a trainer of its own."""
    from hpc_ddp.checks.frameworks import lightning_size_notes

    (note,) = lightning_size_notes(text, "fit.py", nodes, tasks)
    assert note.level == "warning" and note.message.startswith(f"fit.py:2: Trainer(...) sets no {missing}")
    assert "each trains alone" in note.message and "GROUP_WORLD_SIZE" in note.hint


@pytest.mark.parametrize("text,nodes,tasks", [
    (LIGHTNING_FIT, 1, 1),                                                       # one rank: nothing to join
    (LIGHTNING_FIT.replace("max_epochs=3", "devices=2, num_nodes=2, max_epochs=3"), 2, 2),
    (LIGHTNING_FIT.replace("max_epochs=3", "**settings"), 2, 2),                 # its sizes may be in them
    ("from transformers import Trainer\ntrainer = Trainer(model=m)\n", 2, 1),     # not Lightning's Trainer
    ("import lightning as L\n# L.Trainer(max_epochs=3)\nx = 'L.Trainer(1)'\n", 2, 1),  # comments, strings
])
def test_a_trainer_that_says_its_size_or_is_not_lightnings_is_left_alone(text, nodes, tasks):
    from hpc_ddp.checks.frameworks import lightning_size_notes

    assert lightning_size_notes(text, "fit.py", nodes, tasks) == []
