"""This machine as the NVIDIA driver and the kernel show it: GPUs the driver lists, CPU cores we may use.
No torch (the CLI and the batch shell must stay light); read where the answer is needed, never cached."""

from __future__ import annotations

import os

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def nvidia_gpu_entries(gpu_dir: str = NVIDIA_GPUS_DIR) -> list[str] | None:
    """The driver's entry per GPU; None where there is no such directory (no driver, WSL, a container
    that hides /proc/driver): the caller may ask nvidia-smi instead."""
    try:
        return os.listdir(gpu_dir)
    except OSError:
        return None


def physical_gpus(gpu_dir: str = NVIDIA_GPUS_DIR) -> int:
    """GPUs the loaded NVIDIA driver lists (0 without a driver), whatever CUDA_VISIBLE_DEVICES says."""
    return len(nvidia_gpu_entries(gpu_dir) or ())


def usable_cpus() -> int:
    """The cores this process may run on (taskset, cgroup cpusets), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
