"""The built-in trainer's settings: the `[train]` table of a job file -> frozen, validated TrainConfig.

Pure and torch-free, so `submit --dry-run` of a trainer job stays fast; checked when the spec is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any

from hpc_ddp.spec.values import choice as _choice
from hpc_ddp.spec.values import count as _int
from hpc_ddp.spec.values import number

__all__ = ["TrainConfig", "parse_train", "FINGERPRINT_FIELDS", "TOKEN_FINGERPRINT_FIELDS", "SETTINGS"]

DATASETS = ("mnist", "cifar10", "imagefolder", "fake", "tokens")
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")   # auto: bf16 where the GPU supports it, else fp32
DATA_PATHS = ("auto", "cpu", "device")
BUILTIN_MODELS = ("cnn", "mlp", "gpt")
STRATEGIES = ("ddp", "fsdp")     # fsdp: FSDP2 (fully_shard) on each block and the model; sharded checkpoints


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    dataset: str = "fake"
    data_dir: str | None = None
    model: str = "cnn"
    num_classes: int | None = None     # None: from the dataset
    image_size: int | None = None      # None: the dataset's own (ImageFolder/fake: 32)
    epochs: int = 1
    max_steps: int = 0                 # 0: no cap beyond epochs
    batch_size: int = 32               # per rank, per micro-batch
    grad_accum: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_steps: int = 0
    schedule: str = "cosine"           # cosine | constant
    precision: str = "auto"
    sync_bn: bool = False
    clip_grad: float = 0.0             # 0: off
    num_workers: int = 2
    seed: int = 0
    augment: bool = True
    eval_every_epoch: bool = True
    checkpoint_every_steps: int = 0    # 0: only at stops and at the end
    checkpoint_every_minutes: float | str = 30.0  # a node failure loses at most this much; "auto": Young's
                                                   # interval from the save cost and interruption rate
    keep_checkpoints: int = 3
    async_checkpoint: bool = True      # periodic saves: snapshot to host memory, write in the background
    log_every: int = 10
    stop_lead_seconds: float = 0.0     # stop this long before the job's end time; 0: from measured times
    fake_size: int = 1024              # samples in the `fake` dataset's training split
    loggers: tuple[str, ...] = ()      # also log to "tensorboard" (RUN_DIR/tensorboard) and/or "wandb"
    # The GPU defaults (each "auto": on where it pays on a GPU, off on CPUs; true or false to choose):
    data_path: str = "auto"            # "device": decode and augment on the GPU (data.devicebatches); "cpu"
    channels_last: bool | str = "auto" # NHWC memory format for conv nets (tensor cores' own layout)
    compile: bool | str = "auto"       # torch.compile, its cache kept in RUN_DIR/compile-cache across requeues
    strategy: str = "ddp"              # "fsdp": the model sharded over the ranks (a model one GPU cannot hold)
    # dataset = "tokens" and model = "gpt": a GPT-style decoder on windows of block_size tokens
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64


# Changing any of these between attempts would make a resumed run differ from an uninterrupted one.
FINGERPRINT_FIELDS = ("dataset", "model", "num_classes", "image_size", "epochs", "max_steps", "batch_size",
                      "grad_accum", "optimizer", "lr", "momentum", "weight_decay", "warmup_steps", "schedule",
                      "precision", "sync_bn", "clip_grad", "seed", "augment", "fake_size")

# The gpt model's and tokens' own; in a fingerprint only where dataset = "tokens" (older runs' stay as they were).
TOKEN_FINGERPRINT_FIELDS = ("block_size", "n_layer", "n_head", "n_embd")

_MODEL_RE = re.compile(r"^([a-z][a-z0-9_]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):  # TOML has real booleans; "yes" is more likely a mistake
        raise ValueError(f"{value!r} is not true or false")
    return value


def _model(value: Any) -> str:
    if not isinstance(value, str) or not _MODEL_RE.match(value):
        raise ValueError(f"{value!r} is not a model name (resnet18, cnn, mlp, ...) or package.module:factory")
    return value


def _loggers(value: Any) -> tuple[str, ...]:
    known = ("tensorboard", "wandb")
    if not isinstance(value, list) or not all(isinstance(v, str) and v in known for v in value):
        raise ValueError(f"{value!r} is not a list of loggers, e.g. [\"tensorboard\"] (known: {', '.join(known)})")
    return tuple(dict.fromkeys(value))


def _auto_bool(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise ValueError(f"{value!r} is not true, false or \"auto\"")


def _minutes_or_auto(value: Any) -> float | str:
    if value == "auto":
        return value
    try:
        return number(0.0, maximum=DAY_MINUTES * 365)(value)
    except ValueError as exc:
        raise ValueError(f"{exc} (minutes, or \"auto\": from the save cost and the interruption rate)") from None


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not a path")
    return value


# Ceilings, so a slip of the keyboard is refused here and not by an overflow (numpy seeds stop at 2**32,
# and each rank seeds with seed + rank) or an allocation that can never succeed on a node.
MAX_EPOCHS = 1_000_000
MAX_STEPS = 10**12
MAX_BATCH = 1_000_000
MAX_SEED = 2**31 - 1
DAY_MINUTES = 24 * 60.0

_PARSERS = {
    "dataset": _choice(DATASETS), "data_dir": _path, "model": _model, "num_classes": _int(2, 1_000_000),
    "image_size": _int(8, 4096), "epochs": _int(1, MAX_EPOCHS), "max_steps": _int(0, MAX_STEPS),
    "batch_size": _int(1, MAX_BATCH), "grad_accum": _int(1, 65536), "optimizer": _choice(OPTIMIZERS),
    "lr": number(0.0, strict=True), "momentum": number(0.0, maximum=1.0), "weight_decay": number(0.0),
    "warmup_steps": _int(0, MAX_STEPS), "schedule": _choice(("cosine", "constant")),
    "precision": _choice(PRECISIONS), "sync_bn": _bool, "clip_grad": number(0.0),
    "num_workers": _int(0, 1024), "seed": _int(0, MAX_SEED), "augment": _bool, "eval_every_epoch": _bool,
    "checkpoint_every_steps": _int(0, MAX_STEPS), "checkpoint_every_minutes": _minutes_or_auto,
    "keep_checkpoints": _int(2, 10_000), "log_every": _int(1, MAX_STEPS), "fake_size": _int(1, 10**9),
    "stop_lead_seconds": number(0.0, maximum=86400.0 * 365), "async_checkpoint": _bool,
    "loggers": _loggers, "data_path": _choice(DATA_PATHS), "channels_last": _auto_bool, "compile": _auto_bool,
    "strategy": _choice(STRATEGIES), "block_size": _int(2, 1 << 20), "n_layer": _int(1, 1024),
    "n_head": _int(1, 1024), "n_embd": _int(1, 1 << 16),
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(TrainConfig)}
SETTINGS: Mapping[str, Any] = _PARSERS   # key -> its parser (raises ValueError): what a sweep axis of it must pass


def parse_train(table: Any) -> TrainConfig:
    """Validate a `[train]` table. Raises ValueError naming the key (the spec adds where it came from)."""
    if isinstance(table, TrainConfig):
        return table
    if not isinstance(table, Mapping):
        raise ValueError("must be a table ([train] in the job file)")
    values = {}
    for key, raw in table.items():
        if key not in _PARSERS:
            close = difflib.get_close_matches(key, sorted(_PARSERS), n=1)
            raise ValueError(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        try:
            values[key] = _PARSERS[key](raw)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    config = TrainConfig(**values)
    if config.dataset in ("mnist", "cifar10", "imagefolder", "tokens") and not config.data_dir:
        kind = f" {config.dataset}" if config.dataset == "tokens" else ""
        raise ValueError(f"dataset {config.dataset!r} needs data_dir (make one with `hpc-ddp make-dataset{kind}`)")
    if (config.dataset == "tokens") != (config.model == "gpt"):
        raise ValueError(f"model {config.model!r} with dataset {config.dataset!r}: the gpt model reads "
                         "dataset = \"tokens\", and tokens are for the gpt model")
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
    return config
