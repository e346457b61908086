"""The built-in trainer's speed settings, decided once per attempt from the job's `[train]` table and the
device: each "auto" setting is on where it pays on a GPU and off on CPUs, where it would cost time or
change nothing; true or false in the job file is taken as given.

"auto" turns on only what has trained on a real GPU (`PROVEN`: which GPU, when, how; docs/trainer.md shows
it, and a test keeps the two equal). A setting with no proof stays opt-in, and the rank's log says so
(issue 40: the device data path, the default of every GPU ImageFolder job, had never trained on a GPU and
gave a NaN at step 4 on the first one it met). `make gpu-check` is the proof to run on a GPU visit.

- precision "auto": bf16 autocast where the GPU supports bf16 (Ampere and later), else fp32. bf16 needs
  no loss scaling (its range is fp32's).
- data_path "auto": once proven, the device path (data.devicebatches: JPEG decoding and augmentation on the
  GPU) on a GPU for ImageFolders of JPEGs and for MNIST/CIFAR at their native size; the CPU path otherwise.
  Not proven yet: "device" must be set.
- channels_last "auto": on a GPU, for models with 2-d convolutions (NHWC is what tensor cores read).
- compile "auto": on a GPU when the run is long enough to earn back compilation, COMPILE_MIN_STEPS steps;
  its cache lives in the run dir, so a requeued attempt reloads the compiled kernels instead of paying again.

Pure: `decide` takes what it needs as values; the trainer asks the device and model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Speed", "Proof", "PROVEN", "decide", "proof_table", "COMPILE_MIN_STEPS", "COMPILE_CACHE"]

# torch.compile of a ResNet-50 takes about a minute the first time; at a 10-20% faster step of ~0.1 s it
# earns that back after several thousand steps. Below this many steps in the run, "auto" leaves it off.
COMPILE_MIN_STEPS = 5000
COMPILE_CACHE = "compile-cache"      # inside the run dir: inductor's and triton's caches
DEVICE_DATASETS = ("mnist", "cifar10", "imagefolder")


@dataclasses.dataclass(frozen=True)
class Proof:
    """A run in which a setting trained to a finite loss on a real GPU."""
    gpu: str
    date: str      # YYYY-MM-DD
    how: str


_H100_BENCH = Proof("NVIDIA H100 80GB HBM3", "2026-11-26", "bench/README.md's GPU rows: ResNet-50, 60 steps")
_H200_ISSUE_40 = Proof("NVIDIA H200", "2026-11-27", "issue 40: ResNet-50 on JPEGs, 40 steps, data_path cpu")

# What "auto" may turn on, and where each was proven. Add a Proof only from a GPU run that trained to a
# finite loss (make gpu-check's summary says which settings it proved, on which GPU, on which date).
PROVEN: dict[str, tuple[Proof, ...]] = {
    "precision": (_H100_BENCH, _H200_ISSUE_40),      # bf16 autocast
    "channels_last": (_H100_BENCH, _H200_ISSUE_40),
    "compile": (_H100_BENCH,),
    # The device data path: NaN at step 4 on an H200 (issue 40) from the nvjpeg decode writing into memory
    # the rank's stream still used; fixed (data.devicebatches.DecodeStream) but not yet run on a GPU.
    "data_path": (),
}
OPT_IN = "opt-in until proven on a GPU (make gpu-check)"


def proof_table() -> list[str]:
    """docs/trainer.md's table of the GPU defaults: setting, what "auto" does on a GPU, where proven."""
    what = {"precision": ('"bf16" where the GPU has it', '"fp32" (set "bf16")'),
            "channels_last": ("on for conv nets", "off (set true)"),
            "compile": (f"on from {COMPILE_MIN_STEPS:,} steps", "off (set true)"),
            "data_path": ('"device" for JPEGs and MNIST/CIFAR', '"cpu" (set "device")')}
    rows = ['| setting | "auto" on a GPU | proven on |', "|---|---|---|"]
    for name, proofs in PROVEN.items():
        where = "; ".join(f"{p.gpu}, {p.date} ({p.how})" for p in proofs) or "not yet: " + OPT_IN
        rows.append(f"| `{name}` | {what[name][0 if proofs else 1]} | {where} |")
    return rows


@dataclasses.dataclass(frozen=True)
class Speed:
    precision: str           # fp32 | bf16 | fp16
    data_path: str           # cpu | device
    channels_last: bool
    compile: bool
    notes: tuple[str, ...] = ()    # one line per "auto" decided, for the rank's log

    def describe(self) -> str:
        return (f"precision {self.precision}, data on {self.data_path}, channels_last {'on' if self.channels_last else 'off'}, "
                f"compile {'on' if self.compile else 'off'}")


def decide(cfg: Any, *, device_type: str, bf16_supported: bool, convolutional: bool, total_steps: int,
           native_size: bool, jpegs: bool, proven: dict[str, tuple[Proof, ...]] | None = None) -> Speed:
    """The settings for this attempt. `native_size`: MNIST/CIFAR at their own image size (the device path
    keeps their arrays as they are); `jpegs`: an ImageFolder whose files are JPEGs. `proven`: what "auto"
    may turn on (PROVEN unless a test says)."""
    proven = PROVEN if proven is None else proven
    gpu = device_type == "cuda"
    notes = []

    def auto(name: str, value: Any, on: bool, why_on: str, why_off: str) -> bool:
        if value != "auto":
            return bool(value)
        if on and not proven.get(name):
            notes.append(f"{name} off ({OPT_IN}: set {name} = true)")
            return False
        notes.append(f"{name} {'on' if on else 'off'} ({why_on if on else why_off})")
        return on

    if cfg.precision == "auto":
        bf16 = gpu and bf16_supported and bool(proven.get("precision"))
        precision = "bf16" if bf16 else "fp32"
        notes.append(f"precision {precision} (" + ("the GPU supports bf16" if bf16 else "no GPU" if not gpu else
                     "this GPU has no bf16" if not bf16_supported else f'bf16 is {OPT_IN}: set precision = "bf16"')
                     + ")")
    else:
        precision = cfg.precision
    device_data = cfg.dataset in DEVICE_DATASETS and (jpegs if cfg.dataset == "imagefolder" else native_size)
    if cfg.data_path == "auto":
        device = gpu and device_data and bool(proven.get("data_path"))
        data_path = "device" if device else "cpu"
        notes.append(f"data on {data_path} (" + ("decoded and augmented on the GPU" if device else
                     "no GPU" if not gpu else f"the {cfg.dataset} data has no device path" if not device_data else
                     f'the GPU data path is {OPT_IN}: set data_path = "device"') + ")")
    else:
        data_path = cfg.data_path
    channels_last = auto("channels_last", cfg.channels_last, gpu and convolutional, "a conv net on a GPU",
                         "no GPU" if not gpu else "no 2-d convolutions")
    compile_ = auto("compile", cfg.compile, gpu and total_steps >= COMPILE_MIN_STEPS,
                    f"{total_steps} steps", "no GPU" if not gpu else
                    f"{total_steps} steps, fewer than the {COMPILE_MIN_STEPS} that earn compilation back")
    return Speed(precision, data_path, channels_last, compile_, tuple(notes))
