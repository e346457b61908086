"""The built-in trainer's speed settings, decided once per attempt from the job's `[train]` table and the
device: each "auto" setting is on where it pays on a GPU and off on CPUs, where it would cost time or
change nothing; true or false in the job file is taken as given.

- precision "auto": bf16 autocast where the GPU supports bf16 (Ampere and later), else fp32. bf16 needs
  no loss scaling (its range is fp32's).
- data_path "auto": the device path (data.devicebatches: JPEG decoding and augmentation on the GPU) on a
  GPU for ImageFolders of JPEGs and for MNIST/CIFAR at their native size; the CPU path otherwise.
- channels_last "auto": on a GPU, for models with 2-d convolutions (NHWC is what tensor cores read).
- compile "auto": on a GPU when the run is long enough to earn back compilation, COMPILE_MIN_STEPS steps;
  its cache lives in the run dir, so a requeued attempt reloads the compiled kernels instead of paying again.

Pure: `decide` takes what it needs as values; the trainer asks the device and model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Speed", "decide", "COMPILE_MIN_STEPS", "COMPILE_CACHE"]

# torch.compile of a ResNet-50 takes about a minute the first time; at a 10-20% faster step of ~0.1 s it
# earns that back after several thousand steps. Below this many steps in the run, "auto" leaves it off.
COMPILE_MIN_STEPS = 5000
COMPILE_CACHE = "compile-cache"      # inside the run dir: inductor's and triton's caches
DEVICE_DATASETS = ("mnist", "cifar10", "imagefolder")


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
           native_size: bool, jpegs: bool) -> Speed:
    """The settings for this attempt. `native_size`: MNIST/CIFAR at their own image size (the device path
    keeps their arrays as they are); `jpegs`: an ImageFolder whose files are JPEGs."""
    gpu = device_type == "cuda"
    notes = []

    def auto(name: str, value: Any, on: bool, why_on: str, why_off: str) -> bool:
        if value != "auto":
            return bool(value)
        notes.append(f"{name} {'on' if on else 'off'} ({why_on if on else why_off})")
        return on

    if cfg.precision == "auto":
        precision = "bf16" if gpu and bf16_supported else "fp32"
        notes.append(f"precision {precision} (" + ("the GPU supports bf16" if precision == "bf16" else
                     "no GPU" if not gpu else "this GPU has no bf16") + ")")
    else:
        precision = cfg.precision
    device_data = cfg.dataset in DEVICE_DATASETS and (jpegs if cfg.dataset == "imagefolder" else native_size)
    if cfg.data_path == "auto":
        data_path = "device" if gpu and device_data else "cpu"
        notes.append(f"data on {data_path} (" + ("decoded and augmented on the GPU" if data_path == "device" else
                     "no GPU" if not gpu else f"the {cfg.dataset} data has no device path") + ")")
    else:
        data_path = cfg.data_path
    channels_last = auto("channels_last", cfg.channels_last, gpu and convolutional, "a conv net on a GPU",
                         "no GPU" if not gpu else "no 2-d convolutions")
    compile_ = auto("compile", cfg.compile, gpu and total_steps >= COMPILE_MIN_STEPS,
                    f"{total_steps} steps", "no GPU" if not gpu else
                    f"{total_steps} steps, fewer than the {COMPILE_MIN_STEPS} that earn compilation back")
    return Speed(precision, data_path, channels_last, compile_, tuple(notes))
