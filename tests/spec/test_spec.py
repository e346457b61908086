from pathlib import Path

import pytest

from hpc_ddp.common.errors import SpecError
from hpc_ddp.slurm.helptext import parse_help
from hpc_ddp.slurm.slurmtime import format_time, parse_time
from hpc_ddp.spec.jobspec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec

TARGET = Target("script", "/home/u/train.py", ("--lr", "0.1"))


HELP = Path(__file__).parent / "helptext"


def oracle(tool: str) -> frozenset[str]:
    """What the test Slurm's sbatch and srun (22.05) accept, as their --help lists it."""
    return parse_help((HELP / f"{tool}-22.05.txt").read_text())


def build(*layers: Layer, target: Target = TARGET) -> JobSpec:
    return build_spec(list(layers), target=target, workdir="/home/u", python="/usr/bin/python3", options=oracle)


def test_defaults():
    spec = build()
    assert (spec.nodes, spec.gpus, spec.tasks_per_node, spec.job_name) == (1, 0, 1, "train")
    assert spec.signal == "USR2" and spec.executor is None and spec.gpu_bind == "auto"


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
    # NaN passes every range check (it compares false), infinity is no learning rate.
    ("lr", "nan", "'nan' is not a finite number"),
    ("lr", "NaN", "is not a finite number"),
    ("lr", "inf", "is not a finite number"),
    ("lr", "-inf", "is not a finite number"),
    ("lr", "1e400", "is not a finite number"),
    ("lr", float("nan"), "nan is not a finite number"),
    ("lr", 10**400, "is too large"),
    # Ceilings: no count without one.
    ("nodes", "99999999999999999999999", "99999999999999999999999 is above the maximum of 100000"),
    ("nodes", "100001", "above the maximum of 100000"),
    ("nodes", "9" * 5000, "is not a whole number"),  # beyond Python's int-from-text limit
    ("gpus", "4097", "above the maximum of 4096"),
    ("tasks_per_node", "100000", "above the maximum of 4096"),
    ("cpus_per_task", "1000000", "above the maximum of 4096"),
    ("signal_lead", "65536", "above the maximum of 65535"),
    ("max_requeues", "1000000", "above the maximum of 10000"),
    ("max_preemptions", "99999999999", "above the maximum"),
    ("epochs", "10000000000", "above the maximum of 1000000"),
    ("batch_size", "10000000000", "above the maximum of 1000000"),
    ("stage_timeout", "99999999999", "above the maximum of 604800"),
    ("rendezvous_timeout", "99999999999", "above the maximum of 604800"),
    ("collective_timeout", "604801", "above the maximum of 604800"),
    ("master_port", "99999999999999999999", "not a port we can listen on"),
    ("time", "400-0", "is more than 365 days"),
    ("time", "99999999999999999999", "is more than 365 days"),
    # The job name names the run dir: one path component, short enough for NAME_MAX.
    ("job_name", "a/b", "contains '/'"),
    ("job_name", "../../x", "contains '/'"),
    ("job_name", "/etc", "contains '/'"),
    ("job_name", "a" * 201, "is 201 bytes long; at most 200"),
    ("job_name", "é" * 101, "is 202 bytes long"),
    ("template", "/etc/shadow", "is not a jinja2 template"),
    ("template", 5, "is not a usable string"),
    ("setup", ["#SBATCH --array=0-3"], "would add an #SBATCH directive"),
    ("setup", ["ok", 5], "expected a list of strings"),
    ("args", ["a\x00b"], "NUL"),
    ("args", [1, {"a": 1}], "expected a list of strings"),
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


def test_ceilings_are_inclusive():
    spec = build(Layer("c", {"nodes": "100000", "gpus": "4096", "signal_lead": "65535", "time": "365-0",
                             "collective_timeout": "604800", "job_name": "a" * 200}))
    assert (spec.nodes, spec.gpus, spec.signal_lead, spec.time) == (100000, 4096, 65535, 365 * 86400)


TRAINER = Target("trainer", "/home/u/job.toml")


@pytest.mark.parametrize("key,value,message", [
    ("lr", float("nan"), "train: lr: nan is not a finite number"),
    ("lr", float("inf"), "train: lr: inf is not a finite number"),
    ("lr", "nan", "train: lr: 'nan' is not a finite number"),
    ("momentum", float("nan"), "momentum: nan is not a finite number"),
    ("momentum", 1.5, "momentum: 1.5 is above the maximum of 1.0"),
    ("weight_decay", float("inf"), "weight_decay: inf is not a finite number"),
    ("weight_decay", float("-inf"), "weight_decay: -inf is not a finite number"),
    ("clip_grad", float("nan"), "clip_grad: nan is not a finite number"),
    ("checkpoint_every_minutes", float("nan"), "checkpoint_every_minutes: nan is not a finite number"),
    ("checkpoint_every_minutes", float("inf"), "is not a finite number"),
    ("stop_lead_seconds", float("inf"), "stop_lead_seconds: inf is not a finite number"),
    ("stop_lead_seconds", 1e300, "is above the maximum"),
    ("lr", [0.1], "is not a number"),
    ("seed", 2**32, "seed: 4294967296 is above the maximum of 2147483647"),
    ("seed", -1, "seed: -1 is below the minimum of 0"),
    ("epochs", 10**20, "epochs: 100000000000000000000 is above the maximum"),
    ("batch_size", 10**7, "above the maximum"),
    ("image_size", 100000, "image_size: 100000 is above the maximum of 4096"),
    ("num_classes", 10**9, "above the maximum"),
    ("num_workers", 100000, "above the maximum of 1024"),
    ("grad_accum", 10**9, "above the maximum"),
    ("keep_checkpoints", 10**9, "above the maximum"),
    ("fake_size", 10**12, "above the maximum"),
    ("max_steps", 10**13, "above the maximum"),
])
def test_train_values_are_finite_and_bounded(key, value, message):
    with pytest.raises(SpecError) as info:
        build(Layer("job file 'j.toml'", {"train": {key: value}}), target=TRAINER)
    assert str(info.value).startswith("job file 'j.toml': train: ") and message in str(info.value)


# ---- --after and --chain (issue 14) ----

def _run_dir_with_jobs(path, *records):
    import json

    path.mkdir()
    (path / "submissions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("value,after", [
    ("81734", "afterok:81734"), ("81734:ok", "afterok:81734"), ("81734:any", "afterany:81734"),
    (" 12_3:any ", "afterany:12_3"), (81734, "afterok:81734"),
])
def test_after_takes_a_job_id_and_a_kind(value, after):
    assert build(Layer("flags", {"after": value})).after == after


def test_after_a_run_dir_is_its_last_slurm_job(tmp_path):
    run = _run_dir_with_jobs(tmp_path / "run:x", {"executor": "sbatch", "job_id": "7"},
                             {"executor": "local", "job_id": "local-1-2"},
                             {"executor": "sbatch", "job_id": "9", "chain": "7", "previous": "7"})
    assert build(Layer("flags", {"after": str(run)})).after == "afterok:9"
    assert build(Layer("flags", {"after": f"{run}:any"})).after == "afterany:9"  # a colon in the path is fine


@pytest.mark.parametrize("records,message", [
    ([], "records no Slurm job"),
    ([{"executor": "local", "job_id": "local-1-2"}], "records no Slurm job"),
    # A record that would carry a directive or a command into the #SBATCH line is no job id.
    ([{"executor": "sbatch", "job_id": "1\n#SBATCH --uid=0"}], "records no Slurm job"),
    ([{"executor": "sbatch", "job_id": "1 --uid=0"}], "records no Slurm job"),
])
def test_after_a_run_dir_without_a_usable_job_is_refused(tmp_path, records, message):
    run = _run_dir_with_jobs(tmp_path / "run", *records)
    with pytest.raises(SpecError, match=message):
        build(Layer("command line", {"after": str(run)}, is_cli=True))


@pytest.mark.parametrize("value,message", [
    ("nosuchdir", "'nosuchdir' is neither a Slurm job id nor a run dir"),
    ("afterok:12", "neither a Slurm job id nor a run dir"),
    ("12:okay", "'12:okay' is neither"),
    ("12;id", "neither"), ("$(id)", "neither"), ("12\n#SBATCH --uid=0", "neither"),
    ("", "is not a usable string"),
])
def test_after_refuses_what_is_no_job(value, message):
    with pytest.raises(SpecError, match="--after: ") as info:
        build(Layer("command line", {"after": value}, is_cli=True))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value,message", [
    ("0", "--chain: 0 is below the minimum of 1"), ("-2", "below the minimum"), ("101", "above the maximum of 100"),
    ("two", "is not a whole number"),
])
def test_chain_is_a_count(value, message):
    with pytest.raises(SpecError, match=message):
        build(Layer("command line", {"chain": value}, is_cli=True))
    assert build(Layer("flags", {"chain": "4"})).chain == 4 and build().chain == 1 and build().after is None


def test_chain_and_after_need_the_sbatch_executor():
    for values in ({"chain": 2}, {"after": "5"}):
        for executor in ("local", "submitit"):
            with pytest.raises(SpecError, match=f"only the sbatch executor .* not {executor}"):
                build(Layer("flags", {**values, "executor": executor}))
        build(Layer("flags", {**values, "executor": "sbatch"}))


def test_after_and_an_sbatch_dependency_are_one_too_many():
    with pytest.raises(SpecError, match="both set the job's dependency"):
        build(Layer("flags", {"after": "5", "sbatch_args": ["--dependency=afterok:6"]}))
    assert build(Layer("flags", {"chain": 2, "sbatch_args": ["--dependency=afterok:6"]})).chain == 2


def test_profiles_cannot_chain_or_wait():
    for key in ("after", "chain"):
        with pytest.raises(SpecError, match="unknown key"):
            build(Layer("profile 'site'", {key: "2"}, allowed=frozenset(PROFILE_KEYS)))


def test_after_and_chain_round_trip():
    spec = build(Layer("flags", {"after": "5:any", "chain": 3}))
    assert JobSpec.from_dict(spec.to_dict()) == spec
    old = spec.to_dict()
    del old["after"], old["chain"]  # a spec.json written before these keys existed
    assert JobSpec.from_dict(old).chain == 1
