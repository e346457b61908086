"""This machine as the NVIDIA driver and the kernel show it: GPUs the driver lists, CPU cores we may use.
No torch (the CLI and the batch shell must stay light); read where the answer is needed, never cached."""

from __future__ import annotations

import os
import shutil
import subprocess

NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def nvidia_gpu_entries(gpu_dir: str = NVIDIA_GPUS_DIR) -> list[str] | None:
    """The driver's entry per GPU; None where there is no such directory (no driver, WSL, a container
    that hides /proc/driver): the caller may ask nvidia-smi instead."""
    try:
        return os.listdir(gpu_dir)
    except OSError:
        return None


def physical_gpus(gpu_dir: str = NVIDIA_GPUS_DIR, smi=None) -> int:
    """GPUs the loaded NVIDIA driver lists (0 without a driver), whatever CUDA_VISIBLE_DEVICES says: its
    entries in /proc, else (WSL, containers that hide /proc/driver) `nvidia-smi -L`. A rank's runner asks
    this for its backend: counting no GPU there would set gloo and train a GPU job on the CPU."""
    entries = nvidia_gpu_entries(gpu_dir)
    return count_nvidia_gpus(entries, (smi or nvidia_smi_lines)() if entries is None else None)


def count_nvidia_gpus(entries: list[str] | None, smi_lines: list[str] | None) -> int:
    """GPUs the NVIDIA driver lists: /proc/driver/nvidia/gpus entries, else `nvidia-smi -L` lines."""
    if entries is not None:
        return len(entries)
    return sum(1 for line in smi_lines or () if line.startswith("GPU "))


def nvidia_smi_lines() -> list[str] | None:
    """`nvidia-smi -L`'s lines; None without nvidia-smi, or when it fails or hangs (a broken driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def usable_cpus() -> int:
    """The cores this process may run on (taskset, cgroup cpusets), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
