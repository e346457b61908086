"""A sweep: settings to vary (`--sweep lr=0.1,0.01` or a job file's `[sweep]` table), expanded into the grid
of tasks, each one a whole job with its own spec. Pure: values in, tasks and spec layers out.

What a sweep may vary is what an array task may differ in: training settings, never the allocation (every
task of one Slurm array gets the same nodes, GPUs and time). Keys:

- `lr`, `epochs`, `batch_size`: the settings of that name (the built-in trainer's own; a plain script reads
  them as LR, EPOCHS, BATCH_SIZE);
- any other key of the built-in trainer's `[train]` table (`weight_decay`, `optimizer`, `seed`, ...), bare or
  as `train.KEY`;
- `args.NAME`: your own script's option; the task's program gets `--NAME=VALUE` after its arguments.

Values are typed by what they set (`_typed`): a setting's by its own parser (`--sweep lr=1e-3` is the float
0.001, `--sweep epochs=x` is refused naming the axis), an `args.NAME` value is the script's text exactly as
written on the command line (`1.10` stays `1.10`; a job file's `[sweep]` table keeps TOML's types). On the
command line values are split at commas; a value wholly in double quotes keeps its commas and spaces, `""`
in it is one quote (`split_values`).

Every task's values are also exported to its ranks as HPC_DDP_SWEEP_<KEY> (and HPC_DDP_SWEEP_TASK).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpc_ddp.common.errors import SpecError
from hpc_ddp.spec.jobspec import PARSERS, SPEC_KEYS, JobSpec, Layer
from hpc_ddp.spec.trainconfig import SETTINGS as TRAIN_PARSERS
from hpc_ddp.spec.trainconfig import TrainConfig
from hpc_ddp.spec.values import count, flag

__all__ = ["Axis", "Sweep", "parse_axis", "split_values", "sweep_from", "task_layer", "task_args", "task_env", "task_spec", "describe",
           "check_spec", "check_no_flag_conflict", "METRIC_MODES"]

SPEC_SWEEPABLE = ("lr", "epochs", "batch_size")
TRAIN_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))
MAX_TASKS = 10_000        # above any site's MaxArraySize; the cluster's own limit is checked before sbatch
TABLE_OPTIONS = ("max_running", "metric")  # [sweep] keys that are not settings to vary
METRIC_MODES = ("max", "min")
_ARG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_NOT_SWEEPABLE = "sweeps vary training settings; every task of one Slurm array gets the same allocation"
# One value: "quoted" (commas and spaces kept, "" is a quote) or plain (no quote, spaces around it dropped),
# then a comma or the end.
_VALUE = re.compile(r'\s*(?:"((?:[^"]|"")*)"|([^,"]*?))\s*(,|\Z)')
_QUOTING = 'values are split at commas; wrap a value holding a comma in double quotes: args.name="a,b",c'


@dataclasses.dataclass(frozen=True)
class Axis:
    key: str                     # as the user wrote it, normalized: lr, train.weight_decay, args.dropout
    values: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Sweep:
    axes: tuple[Axis, ...]
    max_running: int | None = None     # Slurm's %N: at most N tasks run at once
    metric: str | None = None          # "eval_acc:max": what `status` calls each task's best

    @property
    def size(self) -> int:
        return math.prod(len(a.values) for a in self.axes)

    def tasks(self) -> list[dict[str, Any]]:
        """Every combination, the first axis varying slowest (as nested loops in the order given)."""
        keys = [a.key for a in self.axes]
        return [dict(zip(keys, combo)) for combo in itertools.product(*(a.values for a in self.axes))]

    def to_dict(self) -> dict[str, Any]:
        return {"axes": [{"key": a.key, "values": list(a.values)} for a in self.axes],
                "max_running": self.max_running, "metric": self.metric}


def parse_axis(item: str) -> Axis:
    """`KEY=V1,V2,...` (a --sweep flag) -> Axis of the values as written (strings, split by `split_values`);
    `sweep_from` types them once the key says what they set."""
    key, sep, rest = item.partition("=")
    if not sep:
        raise SpecError(f"--sweep {item!r} is not KEY=VALUE,VALUE,...", hint="e.g. --sweep lr=0.1,0.01")
    return Axis(key.strip(), tuple(split_values(rest, key.strip())))


def split_values(text: str, key: str) -> list[str]:
    """The values of one --sweep flag: split at commas; a value wholly in double quotes is what is between
    them (commas and spaces kept, `""` is one quote), a plain one loses the spaces around it. A quote
    anywhere else, an unclosed one or an empty plain value is refused."""
    if not text.strip():
        return []
    values, at = [], 0
    while True:
        m = _VALUE.match(text, at)
        if m is None:
            raise SpecError(f"--sweep {key}: {text[at:][:40]!r}: a double quote must wrap a whole value",
                            hint=_QUOTING)
        quoted, plain, comma = m.groups()
        if quoted is None and not plain:
            raise SpecError(f"--sweep {key}={text[:40]!r} has an empty value",
                            hint='separate values by single commas: lr=0.1,0.01 (an empty text: "")')
        values.append(quoted.replace('""', '"') if quoted is not None else plain)
        if not comma:
            return values
        at = m.end()


def sweep_from(flags: Sequence[str], table: Mapping[str, Any] | None, max_running: Any, target_kind: str) -> Sweep | None:
    """The sweep a command asks for: --sweep flags, else the job file's [sweep] table (flags replace the
    table's axes of the same key); None when neither gives one. Checked whole: keys, values, size."""
    given = table is not None
    table = dict(table or {})
    options = {k: table.pop(k) for k in TABLE_OPTIONS if k in table}
    axes: dict[str, Axis] = {}
    for key, values in table.items():
        if isinstance(values, dict):  # `args.x = [...]` unquoted is TOML's nested table args = {x = [...]}
            raise SpecError(f"[sweep] {key}.{next(iter(values), '')}: a dotted key must be quoted in TOML",
                            hint=f'write "{key}.{next(iter(values), "NAME")}" = [value, value, ...]')
        if not isinstance(values, list):
            raise SpecError(f"[sweep] {key} = {str(values)[:40]!r} is not a list of values",
                            hint=f"write {key} = [value, value, ...]")
        canonical = _key(key, target_kind, "[sweep]")
        if canonical in axes:
            raise SpecError(f"[sweep] sets {canonical} twice ({key!r} and another spelling)", hint="keep one of them")
        axes[canonical] = _typed(Axis(canonical, tuple(values)), f"[sweep] {key}")
    flagged: dict[str, str] = {}
    for item in flags:
        axis = parse_axis(item)
        canonical = _key(axis.key, target_kind, "--sweep")
        if canonical in flagged:
            both = (f"--sweep {axis.key} is given twice" if flagged[canonical] == axis.key
                    else f"--sweep {flagged[canonical]} and --sweep {axis.key} both vary {canonical}")
            raise SpecError(f"{both}: one axis would be lost",
                            hint=f"give all its values in one flag: --sweep {canonical}=V1,V2,...")
        flagged[canonical] = axis.key
        axes[canonical] = _typed(Axis(canonical, axis.values), f"--sweep {axis.key}")
    if max_running is None:
        max_running = options.get("max_running")
    if not axes:
        if given and not flags:
            raise SpecError("the job file's [sweep] table names no setting to vary", hint="add KEY = [V1, V2], or "
                            "remove the table")
        if max_running is not None:
            raise SpecError("--max-running limits a sweep, but no sweep is given", hint="add --sweep KEY=V1,V2")
        return None
    checked = tuple(_checked(axis) for axis in axes.values())
    _check_env_names([a.key for a in checked])
    sweep = Sweep(checked, _max_running(max_running), _metric(options.get("metric")))
    if sweep.size > MAX_TASKS:
        raise SpecError(f"the sweep has {sweep.size} tasks; at most {MAX_TASKS}",
                        hint="sweep fewer values, or split it into several sweeps")
    return sweep


def _key(key: str, target_kind: str, where: str) -> str:
    """The canonical key, or a SpecError saying why it cannot be swept."""
    key = key.strip()
    if key.startswith("args."):
        if target_kind == "trainer":
            raise SpecError(f"{where} {key}: the built-in trainer takes no arguments",
                            hint=f"sweep a [train] setting ({', '.join(TRAIN_KEYS[:4])}, ...)")
        if not _ARG_NAME.fullmatch(key[5:]):
            raise SpecError(f"{where} {key}: {key[5:]!r} is not an option name (letters, digits, - and _)")
        return key
    if key in SPEC_SWEEPABLE:
        return key
    name = key.removeprefix("train.")
    if name in TRAIN_KEYS:
        if target_kind != "trainer":
            raise SpecError(f"{where} {key}: a [train] setting, but this job runs your own program",
                            hint=f"for your script's own option use args.{name} (it gets --{name}=VALUE)")
        # train.epochs is the spec's epochs: --epochs (or a job file's epochs) would otherwise override the
        # task's [train] value, and the task would train what its label does not say.
        return name if name in SPEC_SWEEPABLE else f"train.{name}"
    if key in SPEC_KEYS:
        raise SpecError(f"{where} {key}: {_NOT_SWEEPABLE}", hint="submit one sweep per allocation")
    known = [*SPEC_SWEEPABLE, *(TRAIN_KEYS if target_kind == "trainer" else ())]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}?" if close else (
        "sweepable: lr, epochs, batch_size, a [train] key" if target_kind == "trainer"
        else "sweepable: lr, epochs, batch_size (read as LR, EPOCHS, BATCH_SIZE), or args.NAME for your option")
    raise SpecError(f"{where} {key}: not a setting", hint=hint)


def _typed(axis: Axis, where: str) -> Axis:
    """The axis's values as what they set takes them: an `args.NAME` value is the script's text, kept as
    given (a flag's as spelled, a table's as TOML typed it); a setting's is parsed by that setting's own
    parser, so a bad one is refused here, naming the axis."""
    for value in axis.values:
        _plain(value, where)
    if axis.key.startswith("args."):
        return axis
    parse = _setting_parser(axis.key)
    typed = []
    for value in axis.values:
        try:
            typed.append(parse(value))
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from None
    return Axis(axis.key, tuple(typed))


def _setting_parser(key: str) -> Callable[[Any], Any]:
    """The parser of the setting a canonical key names. A [train] setting that takes true/false (a TOML
    boolean) gets a command line's text read as --flags are (true/false, yes/no, 1/0) where the text itself
    is refused; the setting's own error is the one shown."""
    if key in SPEC_SWEEPABLE:
        return PARSERS[key]
    parse = TRAIN_PARSERS[key.removeprefix("train.")]

    def parse_text(raw: Any) -> Any:
        try:
            return parse(raw)
        except ValueError as refused:
            as_flag = _as_flag(raw)
            if as_flag is not None:
                try:
                    return parse(as_flag)
                except ValueError:
                    pass
            raise refused from None
    return parse_text


def _as_flag(raw: Any) -> bool | None:
    """A text that reads as true or false, else None."""
    if not isinstance(raw, str):
        return None
    try:
        return flag(raw)
    except ValueError:
        return None


def _plain(value: Any, where: str) -> None:
    """A number, true/false or a string of printable characters, as written."""
    if not isinstance(value, (str, int, float, bool)):
        raise SpecError(f"{where}: {str(value)[:40]!r} is not a plain value (a number, true/false or a string)")
    if isinstance(value, str) and any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise SpecError(f"{where}: {value[:40]!r} contains a control character (a newline, NUL, ...)")
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(f"{where}: {value} is not a finite number")


def _checked(axis: Axis) -> Axis:
    """Typed values, each once: two values that give the same text (1 and 1.0 as a learning rate, "1" and 1
    as --x=1) would train the same."""
    if not axis.values:
        raise SpecError(f"--sweep {axis.key}: no values", hint=f"give at least one: --sweep {axis.key}=V1,V2")
    seen = [_text(v) for v in axis.values]
    twice = next((v for v in axis.values if seen.count(_text(v)) > 1), None)
    if twice is not None:
        raise SpecError(f"--sweep {axis.key}: {twice!r} is listed twice (two tasks would train the same)")
    return axis


def _env_name(key: str) -> str:
    return "HPC_DDP_SWEEP_" + key.rpartition(".")[2].upper().replace("-", "_")


def _check_env_names(keys: Sequence[str]) -> None:
    """Each key names its own HPC_DDP_SWEEP_* variable; TASK is the task's index."""
    names: dict[str, str] = {"HPC_DDP_SWEEP_TASK": "the task's index"}
    for key in keys:
        name = _env_name(key)
        if name in names:
            raise SpecError(f"--sweep {key}: its value would be {name}, which is already {names[name]}",
                            hint="rename the option (args.NAME) so that each key names its own variable")
        names[name] = f"--sweep {key}'s"


def _max_running(raw: Any) -> int | None:
    if raw is None:
        return None
    try:
        return count(1, MAX_TASKS)(raw)
    except ValueError as exc:
        raise SpecError(f"--max-running: {exc}") from None


def _metric(raw: Any) -> str | None:
    if raw is None:
        return None
    name, _, mode = str(raw).partition(":")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name) or (mode and mode not in METRIC_MODES):
        raise SpecError(f"[sweep] metric {str(raw)[:40]!r} is not NAME[:max|:min]", hint='e.g. metric = "eval_acc:max"')
    return f"{name}:{mode or 'max'}"


def task_layer(values: Mapping[str, Any], index: int, base_train: TrainConfig | None) -> Layer:
    """The spec layer of task `index` (above every other: its values are what the sweep varies). [train]
    values are applied to the job's own [train] table, which the layer then replaces whole."""
    layer: dict[str, Any] = {k: v for k, v in values.items() if k in SPEC_SWEEPABLE}
    train = {k.removeprefix("train."): v for k, v in values.items() if k.startswith("train.")}
    if train:
        base = dataclasses.asdict(base_train or TrainConfig())
        layer["train"] = {k: list(v) if isinstance(v, tuple) else v for k, v in {**base, **train}.items()
                          if v is not None}
    return Layer(f"--sweep task {index} ({describe(values)})", layer)


def task_args(values: Mapping[str, Any]) -> tuple[str, ...]:
    """What task's program gets after its own arguments: --NAME=VALUE for each args.NAME."""
    return tuple(f"--{k[5:]}={_text(v)}" for k, v in values.items() if k.startswith("args."))


def task_env(values: Mapping[str, Any], index: int) -> dict[str, str]:
    """HPC_DDP_SWEEP_TASK and HPC_DDP_SWEEP_<KEY> (the key's last part, upper case, - as _)."""
    env = {"HPC_DDP_SWEEP_TASK": str(index)}
    for key, value in values.items():
        env[_env_name(key)] = _text(value)
    return env


def describe(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k.rpartition('.')[2] if k.startswith('train.') else k}={_text(v)}" for k, v in values.items())


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_no_flag_conflict(sweep: Sweep, flags: Mapping[str, Any]) -> None:
    """`--lr 0.1 --sweep lr=...`: one of them would be silently lost."""
    for axis in sweep.axes:
        if axis.key in SPEC_SWEEPABLE and flags.get(axis.key) not in (None, ()):
            raise SpecError(f"--{axis.key.replace('_', '-')} and --sweep {axis.key} both set {axis.key}",
                            hint="give one of them")


def check_spec(base: JobSpec) -> None:
    """What a sweep cannot be combined with."""
    if base.chain > 1:
        raise SpecError("--chain with --sweep: each task of the array would need its own chain",
                        hint="drop --chain and raise --time, or give each task more requeues (--max-requeues)")


def task_spec(base: JobSpec, values: Mapping[str, Any], index: int,
              build: Callable[[Sequence[Layer]], JobSpec]) -> JobSpec:
    """Task `index`'s spec: `build` (the command's own spec builder) with the task's layer on top, so every
    value is checked as a flag's would be; then its program's extra arguments and env."""
    spec = build([task_layer(values, index, base.train)])
    extra_args = task_args(values)
    if extra_args:
        spec = dataclasses.replace(spec, target=dataclasses.replace(spec.target, args=spec.target.args + extra_args))
    # Added here, not through the env setting: HPC_DDP_* names are hpc-ddp's own (refused from users), and a
    # value is data, so its `$` is written `$$` (siteenv's grammar would expand $NAME in it).
    env = {**dict(spec.env), **{k: v.replace("$", "$$") for k, v in task_env(values, index).items()}}
    return dataclasses.replace(spec, env=tuple(env.items()))
