"""Sweeps, pure: --sweep flags and [sweep] tables -> the grid of tasks, each task's spec layer, args and env."""

import pytest

from hpc_ddp.common.errors import SpecError
from hpc_ddp.spec.jobspec import Target, build_spec
from hpc_ddp.spec.sweep import (
    MAX_TASKS,
    Sweep,
    check_no_flag_conflict,
    check_spec,
    parse_axis,
    split_values,
    sweep_from,
    task_args,
    task_env,
    task_layer,
    task_spec,
)
from hpc_ddp.spec.trainconfig import TrainConfig

SCRIPT = Target("script", "/home/ada/train.py", ("--steps", "10"))
TRAINER = Target("trainer", "/home/ada/job.toml")


def test_flags_make_a_grid_first_axis_slowest():
    sweep = sweep_from(["lr=0.1,0.01", "batch_size=32,64"], None, None, "script")
    assert sweep.size == 4
    assert sweep.tasks() == [{"lr": 0.1, "batch_size": 32}, {"lr": 0.1, "batch_size": 64},
                             {"lr": 0.01, "batch_size": 32}, {"lr": 0.01, "batch_size": 64}]


def test_a_flags_values_are_kept_as_written_until_their_key_types_them():
    axis = parse_axis("args.x=1, 2.50,true,adamw,\"a b\"")
    assert axis.values == ("1", "2.50", "true", "adamw", "a b")


@pytest.mark.parametrize("text, values", [
    ("0.1, 0.01", ["0.1", "0.01"]),
    ('"a,b",c', ["a,b", "c"]),
    ('  " a , b " , c ', [" a , b ", "c"]),
    ('"say ""hi""",""', ['say "hi"', ""]),
    ("1.10,0x10,1e3", ["1.10", "0x10", "1e3"]),
])
def test_values_split_at_commas_outside_double_quotes(text, values):
    assert split_values(text, "args.x") == values


@pytest.mark.parametrize("text", ['"a,b', 'a"b', '"a"b', "a,,b", "a,"])
def test_a_stray_quote_or_an_empty_plain_value_is_refused(text):
    with pytest.raises(SpecError, match="double quote must wrap a whole value|empty value"):
        split_values(text, "args.x")


def test_settings_are_typed_by_their_own_parser_and_script_args_are_text():
    sweep = sweep_from(["lr=1e-3,0.5", "train.sync_bn=true,no", "train.optimizer=adamw"], {"seed": ["7", 8]},
                       None, "trainer")
    assert [(a.key, a.values) for a in sweep.axes] == [
        ("train.seed", (7, 8)), ("lr", (0.001, 0.5)), ("train.sync_bn", (True, False)),
        ("train.optimizer", ("adamw",))]
    script = sweep_from(["args.v=1.10,true", "epochs=3"], {"args.w": [1.10, True]}, None, "script")
    assert [(a.key, a.values) for a in script.axes] == [("args.w", (1.1, True)), ("args.v", ("1.10", "true")),
                                                       ("epochs", (3,))]
    assert task_args({"args.w": 1.1, "args.v": "1.10"}) == ("--w=1.1", "--v=1.10")


def test_a_table_gives_axes_and_options_and_flags_replace_its_axes():
    table = {"lr": [0.1, 0.2], "weight_decay": [0.0, 1e-4], "max_running": 2, "metric": "eval_loss:min"}
    sweep = sweep_from(["lr=0.5"], table, None, "trainer")
    assert [(a.key, a.values) for a in sweep.axes] == [("lr", (0.5,)), ("train.weight_decay", (0.0, 1e-4))]
    assert sweep.max_running == 2 and sweep.metric == "eval_loss:min"
    assert sweep_from([], {"lr": [1.0]}, 5, "trainer").max_running == 5  # the flag wins over the table's


def test_no_sweep_is_none():
    assert sweep_from([], None, None, "script") is None
    with pytest.raises(SpecError, match="names no setting to vary"):
        sweep_from([], {}, None, "trainer")  # an empty [sweep] table is a mistake, not a single job


def test_keys_that_would_name_one_variable_are_refused():
    for flags in (["args.task=1,2"], ["lr=1,2", "args.lr=3,4"], ["args.a-b=1", "args.a_b=2"]):
        with pytest.raises(SpecError, match="would be HPC_DDP_SWEEP_"):
            sweep_from(flags, None, None, "script")


def test_a_table_with_an_unquoted_dotted_key_or_one_key_twice():
    with pytest.raises(SpecError, match="dotted key must be quoted"):
        sweep_from([], {"args": {"x": [1, 2]}}, None, "script")
    with pytest.raises(SpecError, match="sets train.weight_decay twice"):
        sweep_from([], {"weight_decay": [0.1], "train.weight_decay": [0.2]}, None, "trainer")


@pytest.mark.parametrize("flag", ["lr=1,1.0", "epochs=2,02", "args.x=a,\"a\""])
def test_values_that_train_the_same_are_one(flag):
    with pytest.raises(SpecError, match="listed twice"):
        sweep_from([flag], None, None, "script")


def test_non_finite_values_are_refused():
    with pytest.raises(SpecError, match="not a finite number"):
        sweep_from(["lr=nan"], None, None, "script")
    with pytest.raises(SpecError, match="not a finite number"):
        sweep_from([], {"args.x": [float("nan")]}, None, "script")


@pytest.mark.parametrize("flags, table, kind, message", [
    (["lr="], None, "script", "lr: no values"),
    (["lr"], None, "script", "is not KEY=VALUE"),
    (["lr=0.1,,0.2"], None, "script", "empty value"),
    (["foo=1,2"], None, "script", "foo: not a setting"),
    (["lrr=1,2"], None, "trainer", "did you mean lr"),
    (["nodes=1,2"], None, "script", "same allocation"),
    (["partition=a,b"], None, "trainer", "same allocation"),
    (["weight_decay=0,1"], None, "script", "use args.weight_decay"),
    (["args.dropout=0.1"], None, "trainer", "takes no arguments"),
    (["args.x;rm=1"], None, "script", "not an option name"),
    (["lr=0.1,0.1"], None, "script", "listed twice"),
    ([], {"lr": 0.1}, "trainer", "not a list of values"),
    ([], {"lr": [[1, 2]]}, "trainer", "not a plain value"),
    ([], {"args.tag": ["a\nb"]}, "script", "control character"),
    ([], {"lr": [0.1], "metric": "acc:best"}, "trainer", "NAME[:max|:min]"),
])
def test_bad_sweeps_are_one_line(flags, table, kind, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("|", r"\|")):
        sweep_from(flags, table, None, kind)


def test_size_is_capped_before_anything_is_expanded():
    with pytest.raises(SpecError, match=f"at most {MAX_TASKS}"):
        sweep_from(["lr=" + ",".join(f"{i}e-3" for i in range(1, 200)),
                   "batch_size=" + ",".join(str(i) for i in range(1, 200))], None, None, "script")


@pytest.mark.parametrize("raw", ["0", "-1", "x"])
def test_max_running_is_a_positive_count(raw):
    with pytest.raises(SpecError, match="--max-running"):
        sweep_from(["lr=1,2"], None, raw, "script")


def test_max_running_without_a_sweep_is_refused():
    with pytest.raises(SpecError, match="no sweep"):
        sweep_from([], None, "2", "script")


def _build(target: Target, base: dict | None = None):
    def build(extra):
        from hpc_ddp.spec.jobspec import Layer
        return build_spec([Layer("job file", base or {}), *extra], target=target, workdir="/home/ada",
                          python="/usr/bin/python3")
    return build


def test_a_script_task_gets_its_settings_arguments_and_env():
    base = _build(SCRIPT)([])
    values = {"lr": 0.01, "args.dropout": 0.2}
    spec = task_spec(base, values, 3, _build(SCRIPT))
    assert spec.lr == 0.01 and spec.target.args == ("--steps", "10", "--dropout=0.2")
    assert dict(spec.env) == {"HPC_DDP_SWEEP_TASK": "3", "HPC_DDP_SWEEP_LR": "0.01", "HPC_DDP_SWEEP_DROPOUT": "0.2"}
    odd = task_spec(base, {"args.tag": "a$HOME"}, 0, _build(SCRIPT))
    assert dict(odd.env)["HPC_DDP_SWEEP_TAG"] == "a$$HOME"  # data, not a reference: the runner gives a$HOME
    assert task_env(values, 3) == {"HPC_DDP_SWEEP_TASK": "3", "HPC_DDP_SWEEP_LR": "0.01",
                                   "HPC_DDP_SWEEP_DROPOUT": "0.2"}


def test_a_trainer_task_changes_only_its_train_keys():
    train = {"dataset": "fake", "lr": 0.5, "weight_decay": 0.1, "seed": 7, "loggers": ["tensorboard"]}
    build = _build(TRAINER, {"train": train})
    base = build([])
    spec = task_spec(base, {"lr": 0.05, "train.weight_decay": 0.0, "train.optimizer": "adamw"}, 1, build)
    assert (spec.train.lr, spec.train.weight_decay, spec.train.optimizer) == (0.05, 0.0, "adamw")
    assert spec.train.seed == 7 and spec.train.loggers == ("tensorboard",)  # the rest: the job's own


def test_a_bad_value_names_its_task():
    build = _build(TRAINER, {"train": {"dataset": "fake"}})
    with pytest.raises(SpecError, match=r"--sweep task 1 \(optimizer=bogus\).*optimizer"):
        task_spec(build([]), {"train.optimizer": "bogus"}, 1, build)


def test_task_layer_and_args_are_what_the_task_varies():
    layer = task_layer({"epochs": 3, "train.seed": 2}, 0, TrainConfig())
    assert layer.values["epochs"] == 3 and layer.values["train"]["seed"] == 2
    assert task_args({"args.use-amp": True, "lr": 1}) == ("--use-amp=true",)


def test_flags_and_sweep_may_not_both_set_a_value():
    sweep = Sweep((parse_axis("lr=1,2"),))
    with pytest.raises(SpecError, match="--lr and --sweep lr"):
        check_no_flag_conflict(sweep, {"lr": "0.1"})
    check_no_flag_conflict(sweep, {"lr": None})


def test_a_chain_per_task_is_refused():
    from hpc_ddp.spec.jobspec import Layer

    with pytest.raises(SpecError, match="--chain with --sweep"):
        check_spec(build_spec([Layer("flags", {"chain": 2})], target=SCRIPT, workdir="/", python="p"))
