"""What every benchmark section shares: settings, a workspace that launches jobs, A/B interleaving, and
the result row each comparison becomes."""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
PLAIN = REPO / "bench" / "plain_ddp.py"
_T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[bench {time.monotonic() - _T0:6.0f}s] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    quick: bool
    repeats: int           # A/B repeats of the timed comparisons (medians are reported)
    train_repeats: int     # the training rows': a single run moves +-20% on a shared 2-core VM
    train_steps: int       # per throughput run; the first `warm` steps are excluded
    warm: int
    batch: int             # per rank
    workers: int           # loader workers per rank
    startup_steps: int
    resume_signal_after: int  # the warning signal is sent once this step is done (plus a random fraction)
    resume_steps: int
    ckpt_model: str        # torchvision model whose weights + SGD momentum make the checkpoint
    stage_files: int
    stage_file_kb: int
    stage_ranks: int       # local ranks of the simulated node in the bytes-read measurement
    gpu_steps: int
    gpu_warm: int
    gpu_batch: int
    gpu_workers: int
    gpu_repeats: int


def settings(quick: bool) -> Settings:
    if quick:  # every code path, a few steps, one repeat: for developing the harness, not for numbers
        return Settings(True, repeats=1, train_repeats=1, train_steps=40, warm=10, batch=32, workers=2,
                        startup_steps=3, resume_signal_after=8, resume_steps=20, ckpt_model="resnet18", stage_files=100,
                        stage_file_kb=400, stage_ranks=4, gpu_steps=30, gpu_warm=10, gpu_batch=64,
                        gpu_workers=8, gpu_repeats=1)
    return Settings(False, repeats=5, train_repeats=9, train_steps=200, warm=10, batch=32, workers=2,
                    startup_steps=3, resume_signal_after=20, resume_steps=40, ckpt_model="resnet50", stage_files=1000,
                    stage_file_kb=400, stage_ranks=4, gpu_steps=120, gpu_warm=40, gpu_batch=128,
                    gpu_workers=10, gpu_repeats=3)


# ---- result rows ----

@dataclasses.dataclass(frozen=True)
class Target:
    op: str                # ">=" or "<="
    value: float
    on: str = "ratio"      # "ratio" (ours / baseline) or "value" (ours itself)

    def met(self, x: float) -> bool:
        return x >= self.value if self.op == ">=" else x <= self.value

    def __str__(self) -> str:
        sign = "≥" if self.op == ">=" else "≤"
        return f"{sign} {self.value:.2f}" if self.on == "ratio" else f"{sign} {self.value:g}"


@dataclasses.dataclass
class Row:
    section: str
    name: str
    unit: str
    ours: str                          # what the "ours" side is
    ours_value: float | None
    baseline: str | None = None        # what it is compared with (None: an absolute measurement)
    baseline_value: float | None = None
    ratio: float | None = None         # ours / baseline, of the medians
    paired_ratio: float | None = None  # median of the per-repeat ratios (each pair ran back to back)
    target: Target | None = None
    met: bool | None = None
    repeats: int = 0
    aggregate: str = "median"
    samples: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    note: str = ""
    skipped: str | None = None         # why the row was not measured

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["target"] = str(self.target) if self.target else None
        out["target_on"] = self.target.on if self.target else None
        out["target_op"] = self.target.op if self.target else None
        out["target_value"] = self.target.value if self.target else None
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        fields = {f.name for f in dataclasses.fields(cls)}
        row = cls(**{k: v for k, v in d.items() if k in fields and k != "target"})
        if d.get("target_op") is not None:
            row.target = Target(d["target_op"], d["target_value"], d["target_on"])
        elif d.get("target"):  # files written before target_op/target_value: "≥ 1.00"
            sign, value = d["target"].split()
            row.target = Target(">=" if sign == "≥" else "<=", float(value), d.get("target_on") or "ratio")
        return row


def compare(section: str, name: str, unit: str, *, ours: str, ours_samples: list[float], baseline: str,
            baseline_samples: list[float], target: Target | None = None, **kw) -> Row:
    """ours vs baseline from interleaved samples: medians, their ratio, and the target judged on it."""
    a, b = statistics.median(ours_samples), statistics.median(baseline_samples)
    ratio = a / b if b else None
    met = target.met(ratio) if target and ratio is not None else None
    pairs = [x / y for x, y in zip(ours_samples, baseline_samples) if y]
    paired = statistics.median(pairs) if len(pairs) > 1 else None
    return Row(section, name, unit, ours, a, baseline, b, ratio, paired, target, met, len(ours_samples),
               samples={"ours": ours_samples, "baseline": baseline_samples}, **kw)


def absolute(section: str, name: str, unit: str, *, ours: str, samples: list[float], target: Target | None,
             aggregate: str = "max", **kw) -> Row:
    """A measured value with no baseline (e.g. steps lost); `max` reports the worst repeat."""
    value = max(samples) if aggregate == "max" else statistics.median(samples)
    met = target.met(value) if target else None
    return Row(section, name, unit, ours, value, target=target, met=met, repeats=len(samples),
               aggregate=aggregate, samples={"ours": samples}, **kw)


def skipped(section: str, name: str, why: str, unit: str = "") -> Row:
    return Row(section, name, unit, "", None, skipped=why)


def interleaved(runs: dict[str, Callable[[int], float]], repeats: int, unit: str = "") -> dict[str, list[float]]:
    """Run each side `repeats` times, A B C / B C A / C A B ..., so drifts in machine load and cache
    warmth hit every side alike."""
    names = list(runs)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            value = runs[name](r)
            out[name].append(value)
            say(f"  {name} #{r + 1}: {value:,.3f} {unit}")
    return out


# ---- launching ----

class BenchError(RuntimeError):
    """A benchmark run failed; its section becomes an error row."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workspace:
    """A scratch directory for one `make bench` run, and how jobs are started in it."""

    def __init__(self, root: Path, s: Settings):
        self.root, self.s = root, s
        self._mnist: Path | None = None
        self._count = 0
        (root / "logs").mkdir(parents=True, exist_ok=True)

    def fresh(self, name: str) -> Path:
        """A new, unused path under the workspace."""
        self._count += 1
        return self.root / f"{name}-{self._count}"

    def mnist(self) -> Path:
        """A generated MNIST-format set, big enough for one epoch of the longest CPU run at world size 2."""
        if self._mnist is None:
            from hpc_ddp.data.datagen import write_mnist

            steps = max(self.s.train_steps, self.s.resume_steps, self.s.startup_steps)
            self._mnist = write_mnist(self.root / "mnist", train=steps * self.s.batch * 2 + 512, test=64)
        return self._mnist

    def env(self, *, cpu_only: bool = True, **extra: str) -> dict[str, str]:
        env = {**os.environ, "HPC_DDP_REGISTRY": str(self.root / "registry.jsonl"),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        if cpu_only:  # the CPU rows stay on the CPU on a GPU machine too (both sides)
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(extra)
        return env

    def submit_argv(self, *args: str) -> list[str]:
        return [PY, "-m", "hpc_ddp", "submit", "--executor", "local", *args]

    def spawn(self, argv: list[str], log: str, *, cpu_only: bool = True, env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen, Path]:
        path = self.fresh(f"logs/{log}").with_suffix(".log")
        with open(path, "wb") as fh:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(argv, cwd=self.root, stdout=fh, stderr=subprocess.STDOUT,
                                    env=self.env(cpu_only=cpu_only, **(env or {})))
        return proc, path

    def run(self, argv: list[str], log: str, *, cpu_only: bool = True, env: dict[str, str] | None = None,
            timeout: float = 900) -> None:
        proc, path = self.spawn(argv, log, cpu_only=cpu_only, env=env)
        wait(proc, path, timeout)


def wait(proc: subprocess.Popen, log: Path, timeout: float = 900, ok: tuple[int, ...] = (0,)) -> int:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise BenchError(f"{log.name}: still running after {timeout:.0f} s; see {log}") from None
    if rc not in ok:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BenchError(f"exit code {rc}; last lines of {log}:\n  " + "\n  ".join(tail))
    return rc


def trainer_job(path: Path, *, data: str, steps: int, batch: int, workers: int, tasks: int = 1, gpus: int = 0,
                log_every: int = 10, model: str = "cnn", extra: str = "") -> Path:
    """A job file for the built-in trainer with the plain loop's settings (SGD, lr 0.05, one epoch)."""
    dataset = f'dataset = "mnist"\ndata_dir = "{data}"' if data != "fake" else 'dataset = "fake"'
    path.write_text(f"""nodes = 1
tasks_per_node = {tasks}
gpus = {gpus}
[train]
{dataset}
model = "{model}"
epochs = 1
max_steps = {steps}
batch_size = {batch}
lr = 0.05
num_workers = {workers}
log_every = {log_every}
eval_every_epoch = false
{extra}""")
    return path


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    from hpc_ddp.common.events import read_jsonl

    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def trainer_rate(run_dir: Path, *, warm: int, samples_per_step: int) -> float:
    """samples/s from the trainer's own records, between step `warm` and the last step (like the plain loop)."""
    records = metrics(run_dir)
    first = next((r for r in records if r["step"] >= warm), None)
    if first is None or records[-1]["step"] <= first["step"]:
        raise BenchError(f"{run_dir}/metrics.jsonl has no records after step {warm}")
    last = records[-1]
    return (last["step"] - first["step"]) * samples_per_step / (last["time"] - first["time"])
