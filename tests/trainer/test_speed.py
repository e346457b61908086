"""The trainer's speed settings (issue 34): each "auto" is on where it pays on a GPU and off on CPUs; a job
file's true/false is taken as given."""

from __future__ import annotations

import pytest

from hpc_ddp.spec.trainconfig import parse_train
from hpc_ddp.trainer.speed import COMPILE_MIN_STEPS, decide


def _decide(table=None, *, device="cuda", bf16=True, conv=True, steps=100_000, native=True, jpegs=True):
    return decide(parse_train(table or {}), device_type=device, bf16_supported=bf16, convolutional=conv,
                  total_steps=steps, native_size=native, jpegs=jpegs)


def test_on_a_gpu_auto_turns_everything_on():
    speed = _decide({"dataset": "cifar10", "data_dir": "d"})
    assert (speed.precision, speed.data_path, speed.channels_last, speed.compile) == ("bf16", "device", True, True)
    assert len(speed.notes) == 4


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
