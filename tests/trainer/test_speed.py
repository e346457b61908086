"""The trainer's speed settings (issue 34): each "auto" is on where it pays on a GPU and off on CPUs; a job
file's true/false is taken as given."""

from __future__ import annotations

import pytest

from hpc_ddp.spec.trainconfig import parse_train
from hpc_ddp.trainer.speed import COMPILE_MIN_STEPS, PROVEN, Proof, decide, proof_table

EVERYTHING = {name: (Proof("a GPU", "2026-01-01", "a test"),) for name in PROVEN}


def _decide(table=None, *, device="cuda", bf16=True, conv=True, steps=100_000, native=True, jpegs=True,
            proven=EVERYTHING):
    return decide(parse_train(table or {}), device_type=device, bf16_supported=bf16, convolutional=conv,
                  total_steps=steps, native_size=native, jpegs=jpegs, proven=proven)


def test_on_a_gpu_auto_turns_everything_proven_on():
    speed = _decide({"dataset": "cifar10", "data_dir": "d"})
    assert (speed.precision, speed.data_path, speed.channels_last, speed.compile) == ("bf16", "device", True, True)
    assert len(speed.notes) == 4


@pytest.mark.parametrize("name,table,field,off", [
    ("data_path", {"dataset": "imagefolder", "data_dir": "d"}, "data_path", "cpu"),
    ("precision", {}, "precision", "fp32"),
    ("channels_last", {}, "channels_last", False),
    ("compile", {}, "compile", False),
])
def test_auto_never_picks_what_no_gpu_has_proven(name, table, field, off):
    """Issue 40: a default must have trained on the hardware it is for; until then it is opt-in, the log
    line says so and names the setting, and setting it by hand still works."""
    unproven = {**EVERYTHING, name: ()}
    speed = _decide(table, proven=unproven)
    assert getattr(speed, field) == off
    (note,) = [n for n in speed.notes if "opt-in" in n]
    assert "proven on a GPU" in note and "make gpu-check" in note and name in note
    forced = {"data_path": "device", "precision": "bf16", "channels_last": True, "compile": True}[name]
    assert getattr(_decide({**table, name: forced}, proven=unproven), field) == forced


def test_the_shipped_defaults_keep_the_gpu_data_path_opt_in():
    """Until make gpu-check has shown the device data path training on a GPU (issue 40), "auto" is the
    CPU path, and the trainer's log line says why."""
    speed = _decide({"dataset": "imagefolder", "data_dir": "d"}, proven=None)
    assert speed.data_path == "cpu"
    assert 'data on cpu (the GPU data path is opt-in until proven on a GPU (make gpu-check): set data_path = "device")' \
        in speed.notes
    assert all(p.gpu and p.date and p.how for proofs in PROVEN.values() for p in proofs)


def test_the_trainer_docs_show_where_each_default_was_proven():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    assert "\n".join(proof_table()) in text


def test_on_cpus_auto_changes_nothing():
    speed = _decide({"dataset": "cifar10", "data_dir": "d"}, device="cpu", bf16=False)
    assert (speed.precision, speed.data_path, speed.channels_last, speed.compile) == ("fp32", "cpu", False, False)


@pytest.mark.parametrize("table,kw,field,want", [
    ({}, {"bf16": False}, "precision", "fp32"),                              # a V100: no bf16
    ({"precision": "fp16"}, {}, "precision", "fp16"),
    ({"dataset": "fake"}, {}, "data_path", "cpu"),                           # nothing to decode
    ({"dataset": "imagefolder", "data_dir": "d"}, {"jpegs": False}, "data_path", "cpu"),   # PNGs
    ({"dataset": "imagefolder", "data_dir": "d"}, {"jpegs": True, "native": False}, "data_path", "device"),
    ({"dataset": "mnist", "data_dir": "d", "image_size": 64}, {"native": False}, "data_path", "cpu"),
    ({"dataset": "mnist", "data_dir": "d", "data_path": "cpu"}, {}, "data_path", "cpu"),
    ({}, {"conv": False}, "channels_last", False),                           # an MLP
    ({"channels_last": False}, {}, "channels_last", False),
    ({}, {"steps": COMPILE_MIN_STEPS - 1}, "compile", False),                # too short to earn it back
    ({"compile": True}, {"steps": 10}, "compile", True),
    ({"compile": False}, {}, "compile", False),
])
def test_each_setting(table, kw, field, want):
    assert getattr(_decide(table, **kw), field) == want


def test_auto_settings_are_said_and_chosen_ones_are_not():
    speed = _decide({"precision": "bf16", "compile": False, "channels_last": True, "data_path": "cpu"})
    assert speed.notes == ()
    assert speed.describe() == "precision bf16, data on cpu, channels_last on, compile off"


@pytest.mark.parametrize("table,message", [
    ({"compile": "yes"}, 'not true, false or "auto"'),
    ({"channels_last": 1}, 'not true, false or "auto"'),
    ({"data_path": "gpu"}, "not one of auto, cpu, device"),
])
def test_bad_values_name_the_key(table, message):
    with pytest.raises(ValueError, match=message):
        parse_train(table)


def test_the_log_line_the_trainer_docs_show_is_the_one_decide_gives():
    from pathlib import Path

    speed = decide(parse_train({"dataset": "imagefolder", "data_dir": "d", "model": "resnet50"}), device_type="cuda",
                   bf16_supported=True, convolutional=True, total_steps=40, native_size=False, jpegs=True)
    line = f"hpc-ddp: {speed.describe()} ({'; '.join(speed.notes)})"   # as trainer/train.py logs it
    assert line in (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()


def test_the_readme_says_of_each_gpu_default_what_proven_allows():
    """Issue 54: the README said JPEGs were decoded on the GPU by default after "auto" stopped doing that. A
    setting with no proof is named opt-in there; one with a proof is not."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    paragraph = readme[readme.index("The built-in trainer (a job file's `[train]` table)"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    assert ('opt-in (`data_path = "device"`)' in paragraph) == (not PROVEN["data_path"])
    for name, words in (("precision", "bf16 autocast"), ("channels_last", "channels_last"),
                        ("compile", "torch.compile")):
        assert (words in paragraph) == bool(PROVEN[name]), name
