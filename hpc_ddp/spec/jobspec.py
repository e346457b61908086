"""The job spec: flags, job file, profile and defaults merged into one frozen, validated `JobSpec`.

Precedence: flag > job file > profile > defaults. Every value is checked here, once, with an error that
names where the value came from and the fix; later stages trust the spec. Pure: the caller reads the
files (see `config`) and passes their contents in as layers.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from hpc_ddp.common.errors import HpcDdpError, SpecError
from hpc_ddp.slurm.slurmtime import parse_time
from hpc_ddp.spec.code import DEFAULT_MAX_MB, Code, parse_excludes
from hpc_ddp.spec.container import Container, image_is_path, parse_container
from hpc_ddp.spec.siteenv import parse_env
from hpc_ddp.spec.slurmargs import SBATCH, SRUN, SRUN_MANAGED, check_option, directive_safe
from hpc_ddp.spec.trainconfig import MAX_BATCH, MAX_EPOCHS, TrainConfig, parse_train
from hpc_ddp.spec.values import choice, count, flag, number

__all__ = ["JobSpec", "Target", "Layer", "build_spec", "SPEC_KEYS", "PROFILE_KEYS", "directive_safe", "OptionSource",
           "no_installed_options"]

EXECUTORS = ("sbatch", "submitit", "local", "srun")
GPU_REQUESTS = ("gpus-per-node", "gres")
GPU_BINDS = ("auto", "node", "rank")
SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG", "XCPU")
TARGET_KEYS = ("script", "module", "args")


@dataclasses.dataclass(frozen=True)
class Target:
    """What every rank runs: a script (absolute path), a module, or the built-in trainer (a job file)."""

    kind: str  # "script" | "module" | "trainer"
    value: str
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        head = {"script": [self.value], "module": ["-m", self.value], "trainer": ["hpc-ddp train", self.value]}
        return " ".join(head[self.kind] + list(self.args))


@dataclasses.dataclass(frozen=True)
class JobSpec:
    target: Target
    job_name: str
    workdir: str
    python: str
    nodes: int = 1                     # with nodes_max: the fewest nodes the job starts on (--nodes MIN-MAX)
    nodes_max: int | None = None       # a node range's most; None: exactly `nodes`
    elastic: str = "keep_global_batch" # a range's resume on another size: keep the global batch, or the per-rank one
    gpus: int = 0
    tasks_per_node: int = 1
    cpus_per_task: int | None = None
    mem: str | None = None
    time: int | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    executor: str | None = None
    run_dir: str | None = None
    sbatch_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()    # extra options of the ranks' srun (--srun-arg)
    gpu_request: str = "gpus-per-node"
    gpu_bind: str = "auto"
    setup: tuple[str, ...] = ()
    node_setup: tuple[str, ...] = ()   # run once on every node before the ranks, each attempt (a step of its own)
    env: tuple[tuple[str, str], ...] = ()  # the site's variables, set on every rank (spec.siteenv)
    container: Container | None = None     # the runtime and image every rank runs in (spec.container)
    scratch: str | None = None
    template: str | None = None
    signal: str = "USR2"
    signal_lead: int = 120
    max_requeues: int = 10        # requeues after time limits
    max_preemptions: int = 20     # requeues after preemptions
    max_restarts: int = 2         # restarts inside the allocation per attempt (a rank crash, a node lost); 0: none
    pass_local_rank: bool = False
    epochs: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    profile: str | None = None
    train: TrainConfig | None = None   # the built-in trainer's settings (job files with [train])
    datasets: tuple[tuple[str, str], ...] = ()  # (name, source path) to stage to node-local disk
    stage_fallback: str = "shared"     # node-local disk unusable: read the shared copy ("shared") or "fail"
    stage_checksums: bool = False
    stage_timeout: int = 3600          # seconds a rank waits for staging, on its node and across nodes
    master_port: int | None = None     # None: derived from the job id
    rendezvous_timeout: int = 300      # seconds the ranks wait for each other at start-up (skew of big jobs)
    collective_timeout: int = 600      # seconds one collective may block before a rank gives up
    after: str | None = None           # "afterok:ID" / "afterany:ID": start after that job (--after)
    chain: int = 1                     # jobs queued up front, each after the one before (--chain)
    debug_rank: int | None = None      # this rank starts under a debugger and waits for it (job.debugger)
    debug_port: int | None = None      # where debugpy listens; None: the first free port from 5678
    debugger: str = "debugpy"          # "debugpy" (an IDE attaches) or "pdb" (the terminal; local executor)
    snapshot: bool = True              # the ranks run a copy of the project taken at submit (spec.code)
    snapshot_exclude: tuple[str, ...] = ()  # patterns left out of the copy (seen live through a link)
    snapshot_max_mb: int = DEFAULT_MAX_MB   # a bigger project is refused, not copied
    code: Code | None = None           # the snapshot the ranks run (set by submit, never by the user)

    @property
    def world_size(self) -> int:
        """The ranks of the fewest nodes the job starts on (a range's runs may have more: see `nodes_text`)."""
        return self.nodes * self.tasks_per_node

    @property
    def most_nodes(self) -> int:
        """The nodes a job runs on where nothing else limits it (the local executor): a range's most."""
        return self.nodes_max or self.nodes

    @property
    def nodes_text(self) -> str:
        """"4", or "2-4" for a range: Slurm's own --nodes syntax."""
        return f"{self.nodes}-{self.nodes_max}" if self.nodes_max else str(self.nodes)

    def program(self) -> str:
        """What every rank runs, as one line: a script's copy in the snapshot where submit took one."""
        if self.target.kind == "script" and self.code is not None and self.code.script:
            return dataclasses.replace(self.target, value=self.code.script).describe()
        return self.target.describe()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "JobSpec":
        fields = dict(data)
        t = fields.pop("target")
        fields["target"] = Target(t["kind"], t["value"], tuple(t["args"]))
        for key in ("sbatch_args", "srun_args", "setup", "node_setup", "snapshot_exclude"):
            fields[key] = tuple(fields.get(key, ()))
        if fields.get("train") is not None:
            fields["train"] = TrainConfig(**fields["train"])
        fields["datasets"] = tuple(tuple(d) for d in fields.get("datasets", ()))
        fields["env"] = tuple(tuple(pair) for pair in fields.get("env", ()))
        fields["container"] = Container.from_dict(fields.get("container"))
        fields["code"] = Code.from_dict(fields.get("code"))
        for f in dataclasses.fields(cls):  # a spec.json edited by hand: "nodes": "2" made 2 x 2 = 22 ranks
            kinds = _PLAIN.get(str(f.type))
            value = fields.get(f.name)
            if kinds is not None and f.name in fields and not (
                    type(value) in kinds or (float in kinds and type(value) is int)):
                raise TypeError(f"{f.name} is {value!r}, not of the type hpc-ddp writes ({f.type})")
        return cls(**fields)


# A plain field's annotation -> the types its value may have in spec.json (bool is no int here).
_PLAIN = {"int": (int,), "int | None": (int, type(None)), "str": (str,), "str | None": (str, type(None)),
          "bool": (bool,), "float | None": (float, type(None))}


# Keys whose flag is not simply --key-with-dashes (repeatable flags are named in the singular).
_FLAG_NAMES = {"sbatch_args": "--sbatch-arg", "srun_args": "--srun-arg", "datasets": "--stage"}


@dataclasses.dataclass(frozen=True)
class Layer:
    """One source of values, e.g. `Layer("job file jobs/a.toml", {...})`. `origin` prefixes messages."""

    origin: str
    values: Mapping[str, Any]
    allowed: frozenset[str] | None = None  # None: every spec key
    is_cli: bool = False  # name values as flags (--tasks-per-node) rather than keys (tasks_per_node)

    def where(self, key: str) -> str:
        if self.is_cli:
            return _FLAG_NAMES.get(key, f"--{key.replace('_', '-')}")
        return f"{self.origin}: {key}"


# ---- value parsers: raw (str from a flag, or a TOML value) -> typed; raise SpecError(reason) ----

def _name(raw: Any) -> str:
    value = directive_safe(str(raw))
    if value != value.strip():
        raise ValueError("has leading or trailing spaces")
    return value


# The job name also names the run dir (runs/NAME-YYYYmmdd-HHMMSS[-N]): one path component, short enough
# that the timestamp still fits in the 255 bytes a file name may have.
MAX_JOB_NAME = 200


def _job_name(raw: Any) -> str:
    value = _name(raw)
    if "/" in value:
        raise ValueError(f"{value!r} contains '/': the job name names the run dir under runs/, one directory")
    if len(value.encode()) > MAX_JOB_NAME:
        raise ValueError(f"is {len(value.encode())} bytes long; at most {MAX_JOB_NAME} (it names the run dir)")
    return value


def _token(raw: Any) -> str:
    value = _name(raw)
    if any(c.isspace() for c in value):
        raise ValueError("contains whitespace")
    return value


def _mem(raw: Any) -> str:
    value = str(raw).strip()
    if not re.fullmatch(r"\d+[KMGT]?", value, re.IGNORECASE):
        raise ValueError(f"{value!r} is not a Slurm memory size (e.g. 32G, 4000M, 0 for all of a node's memory)")
    return value.upper()


MAX_TIME = 365 * 86400  # longer than any site allows; beyond it, UNLIMITED says what is meant


def _time(raw: Any) -> int | None:
    seconds = parse_time(raw)
    if seconds is not None and seconds > MAX_TIME:
        raise SpecError(f"time {str(raw).strip()[:40]!r} is more than 365 days",
                        hint="give a shorter limit, or UNLIMITED for none")
    return seconds


def _signal(raw: Any) -> str:
    value = str(raw).strip().upper().removeprefix("SIG")
    if value not in SIGNALS:
        raise ValueError(f"{raw!r} is not one of {', '.join(SIGNALS)}")
    return value


def _lines(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, (str, list, tuple)):
        raise ValueError("expected a string or a list of strings")
    items = [raw] if isinstance(raw, str) else list(raw)
    if any(not isinstance(x, str) for x in items):
        raise ValueError("expected a list of strings")
    if any("\0" in x for x in items):
        raise ValueError("contains a NUL character")
    return tuple(items)


def _setup(raw: Any) -> tuple[str, ...]:
    """Setup lines sit before the job's first command, where sbatch still reads `#SBATCH` lines: one of
    them would add a directive that no check saw (`--array`, `--uid`). Refused, on every line of every
    item (an item may hold several lines), whatever the spaces before it."""
    items = _lines(raw)
    for item in items:
        for line in re.split(r"[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]", item):
            if re.match(r"\s*#SBATCH", line, re.IGNORECASE):
                raise ValueError(f"{line.strip()[:60]!r} would add an #SBATCH directive; setup lines only run "
                                 "commands (give sbatch options as sbatch_args)")
    return items


def _template(raw: Any) -> str:
    """A jinja2 template of the job script (rendered in a sandbox; its content is checked by `render`)."""
    value = _string(raw)
    if not value.endswith(".j2"):
        raise ValueError(f"{value!r} is not a jinja2 template: a template's name ends in .j2")
    return value


def _string(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip() or "\0" in raw:
        raise ValueError(f"{raw!r} is not a usable string")
    return raw


def _args(raw: Any) -> tuple[str, ...]:
    return _lines(raw)


# sbatch options we set ourselves: giving them again through --sbatch-arg would fight the template.
_MANAGED = {
    "nodes": "--nodes", "ntasks-per-node": "--tasks-per-node", "ntasks": "--nodes and --tasks-per-node",
    "gpus-per-node": "--gpus", "gres": "--gpus (and gpu_request = \"gres\" in the profile)",
    "cpus-per-task": "--cpus-per-task", "mem": "--mem", "time": "--time", "partition": "--partition",
    "account": "--account", "qos": "--qos", "constraint": "--constraint", "job-name": "--job-name",
    "output": "--run-dir (logs go under it)", "error": "--run-dir (logs go under it)",
    "open-mode": "nothing (the template appends)", "requeue": "nothing (the template requeues)",
    "no-requeue": "max_requeues = 0 and max_preemptions = 0", "signal": "signal / signal_lead in the job file",
    "chdir": "nothing (the script changes to the submit directory itself)", "wrap": "a TARGET script",
    "array": "--sweep KEY=V1,V2 (a Slurm array whose tasks each get their own run dir)",
}


def _sbatch_arg(raw: Any, known: frozenset[str] | None = None) -> str:
    return check_option(raw, SBATCH, _MANAGED, known)


def split_stage(item: str) -> tuple[str, str]:
    """--stage SRC[:NAME] -> (SRC, NAME or ""): the last colon names the copy. A colon that cannot be that
    (what follows is no name, or the whole is a path here) is refused, saying how it was read."""
    src, sep, name = item.rpartition(":")
    if not sep:
        return item, ""
    if not name:  # SRC: names nothing: the copy is named after SRC
        return src, ""
    if os.path.lexists(item):
        raise SpecError(f"--stage {item!r}: a path with a colon, and --stage reads SRC:NAME at its last colon",
                        hint=f"name the copy after it: --stage '{item}:NAME' (NAME: letters, digits and _)")
    if "/" in name or name.startswith("."):  # a path's tail, not a name: say how the colon was read
        raise SpecError(f"--stage {item!r} reads as SRC {src!r} and NAME {name!r} (the last colon names the copy), "
                        f"and {name!r} is no dataset name",
                        hint=f"give SRC:NAME with NAME letters, digits and _ (e.g. --stage '{item}:data')")
    return src, name


def _datasets(raw: Any) -> tuple[tuple[str, str], ...]:
    """A table {name = "path"} (job file) or a list of "SRC[:NAME]" (--stage) -> ((name, path), ...)."""
    if isinstance(raw, dict):
        pairs = [(str(k), v) for k, v in raw.items()]
    else:
        pairs = []
        for item in _lines(raw):
            src, name = split_stage(item)
            pairs.append((name or PurePosixPath(src).name.split(".")[0], src))
    out = []
    for name, path in pairs:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
            raise ValueError(f"dataset name {name!r} must be a letter then letters, digits or _ (it names "
                             "HPC_DDP_DATA_NAME)")
        out.append((name, _stageable(_string(path))))
    if len({n for n, _ in out}) != len(out):
        raise ValueError("two datasets share a name")
    return tuple(out)


def _stageable(path: str) -> str:
    """Refuse, --no-preflight or not, what this machine can tell for sure (a missing path whose filesystem
    is visible here, a single file); a path only compute nodes may mount is left to the preflight."""
    from hpc_ddp.spec.datasource import source_problem

    problem = source_problem(path)
    if problem:
        raise SpecError(*problem)
    return path


def _train(raw: Any) -> TrainConfig:
    from hpc_ddp.spec.datasource import missing_here

    config = parse_train(raw)
    missing = missing_here(config.data_dir) if config.data_dir else None
    if missing:
        raise SpecError(f"data_dir {missing}", hint="make one with `hpc-ddp make-dataset` or fix data_dir")
    return config


AFTER_KINDS = ("ok", "any")
_JOB_ID = re.compile(r"\d+(?:_\d+)?")   # a Slurm job id, or an array task's (123_4)
MAX_CHAIN = 100                         # jobs one --chain queues: far above any real need


def _after(raw: Any) -> str:
    """--after JOB_ID|RUN_DIR[:ok|:any] -> Slurm's "afterok:ID" / "afterany:ID". A run dir stands for the
    last job recorded in it (its submissions). Only digits reach the #SBATCH line: whatever a run dir's
    records hold, nothing else can be injected there."""
    value = str(raw) if isinstance(raw, int) and not isinstance(raw, bool) else _string(raw).strip()
    ref, sep, kind = value.rpartition(":")
    if not sep or kind not in AFTER_KINDS:
        ref, kind = value, "ok"
    job = ref if _JOB_ID.fullmatch(ref) else _last_job_of(ref)
    return f"after{kind}:{job}"


def _last_job_of(ref: str) -> str:
    from hpc_ddp.common.rundir import RunDir

    path = Path(ref).expanduser()
    if not ref or not path.is_dir():
        raise SpecError(f"{ref!r} is neither a Slurm job id nor a run dir",
                        hint="give a job id (12345) or a run dir hpc-ddp submitted, optionally ending in :ok or :any")
    jobs = RunDir(path).job_ids()
    if not jobs:
        raise SpecError(f"run dir {ref!r} records no Slurm job (it was never submitted to Slurm)",
                        hint="give the job id to wait for, or submit that run dir first")
    return jobs[-1]


def _container(raw: Any) -> Container | None:
    """A container whose image is a path that surely does not exist here is refused now (one whose filesystem
    only the compute nodes mount is not: see `datasource.missing_here`)."""
    from hpc_ddp.spec.datasource import missing_here

    container = parse_container(raw)
    if container is not None and image_is_path(container.runtime, container.image):
        missing = missing_here(container.image)
        if missing:
            raise SpecError(f"container image {missing}",
                            hint=f"give the {container.runtime} image's path, or build it there first")
    return container


def _port(raw: Any) -> int:
    port = count(1)(raw)
    if not 1024 <= port <= 65535:
        raise ValueError(f"{port} is not a port we can listen on (1024-65535)")
    return port


def _sbatch_args(raw: Any, known: frozenset[str] | None = None) -> tuple[str, ...]:
    return tuple(_sbatch_arg(x, known) for x in _lines(raw))


def _srun_args(raw: Any, known: frozenset[str] | None = None) -> tuple[str, ...]:
    return tuple(check_option(x, SRUN, SRUN_MANAGED, known) for x in _lines(raw))


# Ceilings: far above any real job, low enough that a slip of the keyboard (an extra few digits) is an
# error here and not a job that can never start, or an overflow inside a rank.
MAX_NODES = 100_000
MAX_PER_NODE = 4096           # GPUs, tasks or CPUs of one node
MAX_REQUEUES = 10_000
MAX_RESTARTS = 100            # restarts inside one allocation: each costs a resume, and a crash loop burns the job's time
WEEK = 7 * 86400              # the longest wait for staging, the rendezvous, or one collective

def _nodes(raw: Any) -> int | tuple[int, int]:
    """N, or a range "MIN-MAX" (Slurm's --nodes=MIN-MAX: the job starts on as many as are free, at least
    MIN); a range whose ends are equal is that one number."""
    one = count(1, MAX_NODES)
    if isinstance(raw, str) and "-" in raw.strip().lstrip("-"):
        low, _, high = raw.strip().partition("-")
        lo, hi = one(low), one(high)
        if lo > hi:
            raise ValueError(f"{raw.strip()!r} is not a range MIN-MAX with MIN <= MAX")
        return lo if lo == hi else (lo, hi)
    return one(raw)


PARSERS: dict[str, Callable[[Any], Any]] = {
    "nodes": _nodes, "elastic": choice(("keep_global_batch", "keep_per_rank_batch")), "gpus": count(0, MAX_PER_NODE), "tasks_per_node": count(1, MAX_PER_NODE),
    "cpus_per_task": count(1, MAX_PER_NODE),
    "mem": _mem, "time": _time, "partition": _token, "account": _token, "qos": _token,
    "constraint": _token, "job_name": _job_name, "executor": choice(EXECUTORS), "run_dir": _string,
    "sbatch_args": _sbatch_args, "srun_args": _srun_args, "gpu_request": choice(GPU_REQUESTS),
    "gpu_bind": choice(GPU_BINDS),
    "setup": _setup, "node_setup": _lines, "scratch": _string, "template": _template, "signal": _signal,
    "signal_lead": count(10, 65535),  # Slurm's --signal=SIG@TIME takes at most 65535 s
    "max_requeues": count(0, MAX_REQUEUES), "max_preemptions": count(0, MAX_REQUEUES), "pass_local_rank": flag,
    "max_restarts": count(0, MAX_RESTARTS),
    "epochs": count(1, MAX_EPOCHS), "lr": number(0.0, strict=True), "batch_size": count(1, MAX_BATCH),
    "python": _string, "profile": _token, "script": _string, "module": _string, "args": _args,
    "train": _train, "datasets": _datasets, "stage_fallback": choice(("shared", "fail")),
    "stage_checksums": flag, "stage_timeout": count(10, WEEK), "master_port": _port,
    "rendezvous_timeout": count(5, WEEK), "collective_timeout": count(10, WEEK),
    "after": _after, "chain": count(1, MAX_CHAIN), "env": parse_env, "container": _container,
    "debug_rank": count(0, MAX_NODES * MAX_PER_NODE), "debug_port": _port, "debugger": choice(("debugpy", "pdb")),
    "snapshot": flag, "snapshot_exclude": parse_excludes, "snapshot_max_mb": count(1, 1 << 20),
}
SPEC_KEYS = frozenset(PARSERS)
PROFILE_KEYS = SPEC_KEYS - {"script", "module", "args", "profile", "job_name", "run_dir", "pass_local_rank", "train",
                            "datasets", "after", "chain", "debug_rank", "debugger"}


def _check_keys(layer: Layer) -> None:
    allowed = layer.allowed if layer.allowed is not None else SPEC_KEYS
    for key in layer.values:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(allowed))}"
            raise SpecError(f"{layer.origin}: unknown key {key!r}", hint=hint)


# The long options an installed Slurm command accepts (`slurm.helptext.installed_options`), or None where it
# is not installed: read at the edge and handed in, so building a spec stays pure.
OptionSource = Callable[[str], frozenset[str] | None]
# Keys whose parser also takes what the installed tool accepts.
_CLUSTER_CHECKED = {"sbatch_args": (_sbatch_args, SBATCH), "srun_args": (_srun_args, SRUN)}


def no_installed_options(tool: str) -> None:
    """The option source where nothing is asked: the fixed lists alone decide."""
    return None


# Tables merged entry by entry across layers: a job file's env adds to its profile's.
_PER_ENTRY = {"env"}


def _parser(key: str, options: OptionSource) -> Callable[[Any], Any]:
    if key in _CLUSTER_CHECKED:
        parse, tool = _CLUSTER_CHECKED[key]
        return lambda raw: parse(raw, options(tool))
    return PARSERS[key]


def merge(layers: Sequence[Layer], options: OptionSource = no_installed_options) -> dict[str, tuple[Any, str]]:
    """Lowest precedence first. Returns key -> (parsed value, origin of the value)."""
    merged: dict[str, tuple[Any, str]] = {}
    for layer in layers:
        _check_keys(layer)
        for key, raw in layer.values.items():
            if raw is None:
                continue
            try:
                value = _parser(key, options)(raw)
                if key in _PER_ENTRY and key in merged:  # a table adds to (and overrides) the layers below
                    value = tuple({**dict(merged[key][0]), **dict(value)}.items())
                merged[key] = (value, layer.origin)
            except SpecError as exc:
                raise SpecError(f"{layer.where(key)}: {exc.message}", hint=exc.hint) from None
            except ValueError as exc:
                raise SpecError(f"{layer.where(key)}: {exc}") from None
            merged[key] = (merged[key][0], layer.where(key))
    return merged


def build_spec(layers: Sequence[Layer], *, target: Target, workdir: str, python: str,
               options: OptionSource = no_installed_options) -> JobSpec:
    """Merge `layers` (lowest precedence first) and check the whole: the only way to make a JobSpec.
    `options`: what the installed sbatch and srun accept, for extra options given to them."""
    merged = merge(layers, options)
    values = {key: value for key, (value, _) in merged.items() if key not in TARGET_KEYS}
    gpus = values.get("gpus", 0)
    values.setdefault("tasks_per_node", gpus or 1)
    if isinstance(values.get("nodes"), tuple):
        values["nodes"], values["nodes_max"] = values["nodes"]
    values.setdefault("job_name", _default_job_name(target))
    _check_whole(values, merged, target)
    _check_debug(values)
    if target.kind == "trainer":
        values["train"] = _trainer_overrides(values.get("train") or TrainConfig(), values)
    return JobSpec(target=target, workdir=workdir, python=values.pop("python", python), **values)


def _trainer_overrides(train: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """--epochs/--lr/--batch-size are the trainer's own settings when the trainer runs."""
    changes = {key: values[key] for key in ("epochs", "lr", "batch_size") if values.get(key) is not None}
    return dataclasses.replace(train, **changes)


def _default_job_name(target: Target) -> str:
    stem = PurePosixPath(target.value).stem if target.kind != "module" else target.value.rsplit(".", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("_") or "job"
    return name[:64]


def _check_whole(values: dict[str, Any], merged: dict[str, tuple[Any, str]], target: Target) -> None:
    gpus, tasks = values.get("gpus", 0), values["tasks_per_node"]
    if gpus and (tasks > gpus or gpus % tasks):
        raise SpecError(
            f"{tasks} tasks per node do not fit {gpus} GPUs per node",
            hint=f"use --tasks-per-node {gpus} (one task per GPU) or a divisor of {gpus}",
        )
    if values.get("pass_local_rank") and target.kind == "trainer":
        raise SpecError("--pass-local-rank applies to your own scripts, not to the built-in trainer")
    if values.get("train") and target.kind != "trainer":
        raise SpecError("a [train] table configures the built-in trainer, but this job runs "
                        f"{target.describe()}", hint="remove script/module from the job file, or the [train] table")
    lead, limit = values.get("signal_lead", 120), values.get("time")
    if limit and lead * 2 > limit:
        raise SpecError(f"the warning signal would come {lead} s before a {limit} s time limit, in its first half",
                        hint=f"give --signal-lead at most {limit // 2} s, or a longer --time")
    if values.get("executor") == "submitit" and values.get("signal", "USR2") != "USR2":
        raise SpecError("the submitit executor always uses SIGUSR2 as its warning signal",
                        hint="drop --signal, or use --executor sbatch")
    if "elastic" in merged and not values.get("nodes_max") and not merged["elastic"][1].startswith("profile"):
        # what a resume on another number of nodes keeps: a fixed --nodes never resumes on another
        raise SpecError(f"{merged['elastic'][1]} applies to a node range, and this job runs on a fixed "
                        f"{values.get('nodes', 1)} node(s): it would be ignored",
                        hint="give --nodes MIN-MAX (a resume may then run on another number of nodes), or drop it")
    _check_container(values)
    if values.get("template") and values.get("executor") == "submitit":
        raise SpecError("a custom sbatch template cannot be used with the submitit executor",
                        hint="use --executor sbatch, or drop the template")
    _check_chain(values)


def _check_debug(values: dict[str, Any]) -> None:
    """--debug-rank R: a rank of this job, under a debugger the ranks can run; while it may stop, the others
    wait a long time instead of timing out (the stretched timeouts are in the spec, so the dry run shows them).
    Whether the ranks' Python has debugpy is asked at the submit edge (job.debugger.refuse_missing_debugpy),
    not here: building a spec (a dry run, render) executes nothing."""
    from hpc_ddp.job.debugger import stretched

    rank, debugger = values.get("debug_rank"), values.get("debugger", "debugpy")
    if rank is None:
        given = [flag for flag, on in (("--pdb", debugger == "pdb"), ("--debug-port", values.get("debug_port")))
                 if on]
        if given:
            raise SpecError(f"{' and '.join(given)} without --debug-rank", hint="add --debug-rank R (the rank to debug)")
        return
    # a node range's ranks: as many as its most nodes hold (the local executor runs them all; Slurm may)
    world = (values.get("nodes_max") or values.get("nodes", 1)) * values["tasks_per_node"]
    if rank >= world:
        raise SpecError(f"--debug-rank {rank} is outside the job's {world} rank(s)",
                        hint=f"give a rank from 0 to {world - 1}")
    if debugger == "pdb" and values.get("executor") != "local":
        raise SpecError("--pdb opens pdb in this terminal, so the rank must run on this machine",
                        hint="add --executor local, or drop --pdb to attach an IDE through debugpy")
    for key in ("rendezvous_timeout", "collective_timeout"):
        values[key] = stretched(values.get(key, JobSpec.__dataclass_fields__[key].default))


def _check_container(values: dict[str, Any]) -> None:
    """Executors that cannot start ranks in a container are refused here, when they are asked for."""
    container, executor = values.get("container"), values.get("executor")
    if container is None:
        return
    if executor == "submitit":
        raise SpecError("the submitit executor runs each rank in its own Python process, outside any container",
                        hint="use --executor sbatch (or srun inside an allocation) with --container")
    if executor == "local" and container.runtime in ("pyxis", "shifter"):
        raise SpecError(f"--container {container.runtime}: that runtime starts containers through Slurm, and the "
                        "local executor runs the ranks on this machine", hint="use --executor sbatch, or a "
                        "runtime installed here (charliecloud, apptainer, podman)")


def _check_chain(values: dict[str, Any]) -> None:
    """--after and --chain queue Slurm jobs that wait for each other: only sbatch queues them so."""
    executor, chain, after = values.get("executor"), values.get("chain", 1), values.get("after")
    asked = " and ".join(flag for flag, given in (("--after", after), (f"--chain {chain}", chain > 1)) if given)
    if asked and executor not in (None, "sbatch"):
        raise SpecError(f"{asked}: only the sbatch executor queues Slurm jobs that wait for each other, "
                        f"not {executor}", hint="use --executor sbatch")
    if after and any(arg.startswith("--dependency") for arg in values.get("sbatch_args", ())):
        raise SpecError("--after and --sbatch-arg=--dependency both set the job's dependency",
                        hint="give one of them: --after JOB_ID|RUN_DIR[:ok|:any] is checked against Slurm")


def load_spec(path: str | os.PathLike) -> JobSpec:
    """The spec a run dir's spec.json holds (what every rank, the policy and the CLI read back)."""
    try:
        return JobSpec.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HpcDdpError(f"cannot load the job spec {str(path)!r}: {exc}") from None
