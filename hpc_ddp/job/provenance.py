"""The ranks' environment, recorded once per attempt: their Python, its installed packages (a hash, and the
list in the run dir), and the torch, CUDA and NCCL versions, all read without importing torch. When an
attempt finds that any of it differs from the attempt before (a module update, a reinstalled package
under a resumed run), it records what changed and `status` says so.

    RUN_DIR/environments/<hash>.txt     one line per installed package (name==version), written once

Rank 0's runner calls `record` before the program starts; a failure here is a note in the rank's log,
never the run's failure. `fingerprint` and `differences` are pure.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import read_regular, write_file
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.rundir import RunDir

__all__ = ["installed_packages", "fingerprint", "differences", "record"]

_NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", re.M)


def installed_packages(distributions: Iterable[Any] | None = None) -> list[str]:
    """name==version of every distribution this Python can import, sorted, each once."""
    seen: dict[str, str] = {}
    for dist in distributions if distributions is not None else importlib.metadata.distributions():
        try:
            name = dist.metadata["Name"]
        except Exception:  # noqa: BLE001 - a broken dist-info: skipped, as pip list does
            continue
        if name:
            seen.setdefault(re.sub(r"[-_.]+", "-", name).lower(), str(dist.version))
    return sorted(f"{name}=={version}" for name, version in seen.items())


def _torch_cuda() -> str | None:
    """The CUDA version torch was built with, from torch/version.py (torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = read_regular(os.path.join(folder, "version.py"), limit=1 << 16).decode(errors="replace")
        except (OSError, ValueError):
            continue
        m = _CUDA.search(text)
        return (m.group(1) or m.group(2)) if m else None
    return None


def fingerprint(packages: list[str], *, python: str, executable: str, versions: Mapping[str, str | None]) -> dict:
    """What identifies the environment: the Python, the packages' hash, torch, CUDA, NCCL. Pure."""
    digest = hashlib.sha256("\n".join(packages).encode()).hexdigest()[:16]
    return {"python": python, "executable": executable, "packages": digest, "package_count": len(packages),
            **{k: v for k, v in versions.items()}}


def current(packages: list[str] | None = None) -> tuple[dict, list[str]]:
    packages = installed_packages() if packages is None else packages
    by_name = dict(p.split("==", 1) for p in packages)
    nccl = next((by_name[n] for n in _NCCL_PACKAGES if n in by_name), None)
    versions = {"torch": by_name.get("torch"), "cuda": _torch_cuda(), "nccl": nccl}
    return fingerprint(packages, python=platform.python_version(), executable=sys.executable,
                       versions=versions), packages


def differences(before: Mapping[str, Any], after: Mapping[str, Any], before_packages: list[str] | None,
                after_packages: list[str]) -> list[str]:
    """What changed between two attempts' environments, one short phrase each. Pure."""
    out = [f"{key} {before.get(key)} -> {after.get(key)}" for key in ("python", "executable", "torch", "cuda", "nccl")
           if before.get(key) != after.get(key)]
    if before.get("packages") != after.get("packages"):
        if before_packages is None:
            out.append(f"installed packages changed (hash {before.get('packages')} -> {after.get('packages')})")
        else:
            shown = ("torch", *_NCCL_PACKAGES)  # said above already
            old = {n: v for n, v in (p.split("==", 1) for p in before_packages) if n not in shown}
            new = {n: v for n, v in (p.split("==", 1) for p in after_packages) if n not in shown}
            changed = [f"{n} {old[n]} -> {new[n]}" for n in sorted(new) if n in old and old[n] != new[n]]
            changed += [f"{n} {new[n]} added" for n in sorted(new) if n not in old]
            changed += [f"{n} {old[n]} removed" for n in sorted(old) if n not in new]
            out.extend(changed[:10] + ([f"and {len(changed) - 10} more"] if len(changed) > 10 else []))
    return out


def _package_file(run_dir: Path, digest: str) -> Path:
    return RunDir(run_dir).environments / f"{digest}.txt"


def _read_packages(run_dir: Path, digest: str | None) -> list[str] | None:
    if not digest or not re.fullmatch(r"[0-9a-f]{16}", str(digest)):
        return None
    try:
        return read_regular(_package_file(run_dir, digest), limit=16 << 20).decode().splitlines()
    except (OSError, ValueError):
        return None


def record(run_dir: Path, events_path: Path, *, job_id: str | None, attempt: int, node: str) -> dict:
    """Record this attempt's environment (and what changed since the attempt before) in events.jsonl."""
    now, packages = current()
    listing = _package_file(run_dir, now["packages"])
    if not listing.exists():
        listing.parent.mkdir(mode=0o700, exist_ok=True)
        write_file(listing, "\n".join(packages) + "\n")
    earlier = [e for e in read_jsonl(events_path) if e.get("event") == "environment"]
    entry = {"event": "environment", "job_id": job_id, "attempt": attempt, "node": node, **now}
    events = JsonLines(events_path)
    if earlier:
        before = earlier[-1]
        changed = differences(before, now, _read_packages(run_dir, before.get("packages")), packages)
        if changed:
            entry["changed"] = changed
            entry["since"] = {"job_id": before.get("job_id"), "attempt": before.get("attempt")}
    events.write(entry)
    return entry
