"""Sizes as people read them: decimal units (1 kB = 1000 B), as `df -H` and the filesystems' quotas say."""

from __future__ import annotations

__all__ = ["MB", "human_bytes"]

MB = 1000 * 1000


def human_bytes(n: float) -> str:
    """`512 B`, `1.5 kB`, `3.0 MB`, `2.1 GB`, `1.2 TB`."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
