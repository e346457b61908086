import pytest

from hpc_ddp.errors import SpecError
from hpc_ddp.slurmtime import format_time, parse_time
from hpc_ddp.spec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec

TARGET = Target("script", "/home/u/train.py", ("--lr", "0.1"))


def build(*layers: Layer, target: Target = TARGET) -> JobSpec:
    return build_spec(list(layers), target=target, workdir="/home/u", python="/usr/bin/python3")


def test_defaults():
    spec = build()
    assert (spec.nodes, spec.gpus, spec.tasks_per_node, spec.job_name) == (1, 0, 1, "train")
    assert spec.signal == "USR2" and spec.executor is None and spec.gpu_bind == "rank"


def test_tasks_per_node_defaults_to_gpus():
    assert build(Layer("flags", {"gpus": "8", "nodes": "4"})).tasks_per_node == 8
    assert build(Layer("flags", {"gpus": "8", "nodes": "4"})).world_size == 32


def test_precedence_flag_over_job_file_over_profile():
    profile = Layer("profile 'p'", {"partition": "gpu", "time": "1:00:00", "account": "lab"},
                    allowed=frozenset(PROFILE_KEYS))
    job = Layer("job file", {"partition": "long", "time": "2:00:00"})
    flags = Layer("command line", {"time": "30"})
    spec = build(profile, job, flags)
    assert (spec.partition, spec.time, spec.account) == ("long", 1800, "lab")


def test_spec_is_frozen_and_round_trips():
    spec = build(Layer("flags", {"nodes": "2", "gpus": "4", "sbatch_args": ["--exclusive"], "setup": ["module load x"]}))
    with pytest.raises(AttributeError):
        spec.nodes = 3  # type: ignore[misc]
    assert JobSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("key,value,message", [
    ("nodes", "0", "below the minimum of 1"),
    ("nodes", "-2", "below the minimum"),
    ("nodes", "two", "not a whole number"),
    ("gpus", "-1", "below the minimum of 0"),
    ("gpus", "1.5", "not a whole number"),
    ("time", "1:2:3:4", "not a Slurm time"),
    ("time", "0", "zero"),
    ("mem", "lots", "not a Slurm memory size"),
    ("job_name", "x\n#SBATCH --uid=0", "control character"),
    ("job_name", "a#b", "comment"),
    ("partition", "gpu\x00", "control character"),
    ("partition", 'gpu"', "quote"),
    ("account", "my lab", "whitespace"),
    ("executor", "pbs", "not one of"),
    ("sbatch_args", ["--nodes=3"], "set by hpc-ddp; use --nodes"),
    ("sbatch_args", ["--exclusiv"], "did you mean --exclusive"),
    ("sbatch_args", ["-x n1"], "long form"),
    ("sbatch_args", ["--comment=a\nb"], "control character"),
    ("sbatch_args", ["--comment=a b"], "whitespace"),
    ("signal", "KILL", "not one of"),
    ("lr", "-1", "greater than 0"),
    ("pass_local_rank", "maybe", "not true or false"),
])
def test_bad_values_name_key_and_origin(key, value, message):
    with pytest.raises(SpecError) as info:
        build(Layer("command line", {key: value}, is_cli=True))
    assert message in str(info.value)
    flag = {"sbatch_args": "--sbatch-arg"}.get(key, f"--{key.replace('_', '-')}")  # named as the user typed it
    assert str(info.value).startswith(f"{flag}:")
    assert "\n" not in str(info.value).replace("\\n", "")


def test_file_values_are_named_by_file_and_key():
    with pytest.raises(SpecError, match=r"^job file 'j.toml': nodes: 0 is below"):
        build(Layer("job file 'j.toml'", {"nodes": 0}))


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(SpecError, match="unknown key 'gpu'.*did you mean 'gpus'"):
        build(Layer("job file 'j.toml'", {"gpu": 4}))


def test_profile_refuses_job_keys():
    with pytest.raises(SpecError, match="unknown key 'script'"):
        build(Layer("profile 'p'", {"script": "x.py"}, allowed=frozenset(PROFILE_KEYS)))


def test_tasks_must_fit_gpus():
    with pytest.raises(SpecError, match="3 tasks per node do not fit 4 GPUs.*HINT"):
        build(Layer("command line", {"gpus": "4", "tasks_per_node": "3"}))
    assert build(Layer("c", {"gpus": "4", "tasks_per_node": "2"})).tasks_per_node == 2


def test_job_name_default_is_sanitized():
    spec = build(target=Target("script", "/x/my train#1.py", ()))
    assert spec.job_name == "my_train_1"


@pytest.mark.parametrize("text,seconds", [
    ("90", 5400), ("5:30", 330), ("1:00:00", 3600), ("2-0", 172800), ("1-2:30", 95400),
    ("1-00:00:01", 86401), (45, 2700), ("UNLIMITED", None), ("infinite", None),
])
def test_slurm_time_formats(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("seconds,text", [(60, "0-00:01:00"), (95400, "1-02:30:00"), (59, "0-00:00:59")])
def test_format_time(seconds, text):
    assert format_time(seconds) == text
    assert parse_time(text) == seconds


def test_signal_lead_must_leave_most_of_the_time_limit():
    with pytest.raises(SpecError, match="in its first half.*HINT: give --signal-lead at most 30 s"):
        build(Layer("c", {"time": "1", "signal_lead": "40"}))
    assert build(Layer("c", {"time": "1", "signal_lead": "30"})).signal_lead == 30
