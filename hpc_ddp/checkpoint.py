"""Crash-safe checkpoints: a kill at any moment leaves either the old state or the new one, never half.

Layout under the checkpoint root:

    step-000000120/           one complete checkpoint: payload files + manifest.json (sizes, sha256)
    step-000000160/
    step-000000160-r1/        the same step saved again (e.g. the final save after a periodic one):
                              a new name, so the complete older copy is never moved or deleted first
    latest                    the name of the newest complete checkpoint (replaced atomically)
    .tmp-...                  an unfinished save; ignored and removed on the next save

A save writes into a temporary directory next to its target (same filesystem), fsyncs every file and
the manifest, fsyncs the directory, renames it into place, then replaces `latest`. Loading verifies
sizes and sha256 of every file before unpickling it with `torch.load(weights_only=True)`, and falls
back to the newest older checkpoint that verifies, saying which file failed. It never retries with full
unpickling: a checkpoint that needs it is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .durable import fsync_dir as _fsync_dir
from .durable import replace_durable
from .durable import write_durable as _write_durable
from .errors import HpcDdpError

__all__ = ["CheckpointManager", "CheckpointError", "Loaded", "state_sha256", "verify", "inspect_checkpoint"]

MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "step-"
FORMAT = 1
_NAME = re.compile(r"^step-(\d+)(?:-r(\d+))?$")


class CheckpointError(HpcDdpError):
    """A checkpoint is damaged, incomplete or refused; the message names the file."""


@dataclasses.dataclass
class Loaded:
    path: Path
    manifest: dict[str, Any]
    payloads: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def state_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' raw bytes, in key order (dtype-agnostic: bf16 works too)."""
    digest = hashlib.sha256()
    for key in state_dict:
        value = state_dict[key]
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _hash_while(data: bytes, write: Callable[[], None]) -> str:
    """sha256 of `data`, computed in a thread while `write()` runs: hashing and writing (fsync included)
    both release the GIL, so the manifest costs little more than the write itself."""
    digest: list[str] = []
    worker = threading.Thread(target=lambda: digest.append(hashlib.sha256(data).hexdigest()))
    worker.start()
    try:
        write()
    finally:
        worker.join()
    if not digest:  # sha256 of bytes cannot fail short of memory; say so rather than IndexError
        raise CheckpointError("hashing a checkpoint file failed (out of memory?)")
    return digest[0]


class CheckpointManager:
    """Save (rank 0) and load (every rank) checkpoints under `root`, keeping the newest `keep` (>= 2)."""

    def __init__(self, root: str | os.PathLike, keep: int = 3, log: Callable[[str], None] = print):
        if keep < 2:
            raise ValueError("keep must be at least 2: the newest checkpoint may be the damaged one")
        self.root, self.keep, self.log = Path(root), keep, log

    # ---- saving ----

    def save(self, step: int, payloads: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
        """Write `payloads` (file name -> object for torch.save) as checkpoint `step`; return its path."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._remove_unfinished()
        name = self._free_name(step)
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=0o700)
        files = {}
        for fname, obj in payloads.items():
            data = _serialize(obj)
            files[fname] = {"size": len(data), "sha256": _hash_while(data, lambda: _write_durable(tmp / fname, data))}
        manifest = {**meta, "format": FORMAT, "step": step, "created": time.time(), "files": files}
        _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        final = self.root / name
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._point_latest_to(name)
        self._prune(keep_name=name)
        return final

    def _free_name(self, step: int) -> str:
        """step-N, or step-N-rK when step N was saved before: nothing complete is ever replaced in place."""
        name, revision = f"{PREFIX}{step:09d}", 0
        while (self.root / name).exists():
            revision += 1
            name = f"{PREFIX}{step:09d}-r{revision}"
        return name

    def _point_latest_to(self, name: str) -> None:
        replace_durable(self.root / LATEST, (name + "\n").encode())

    def _prune(self, keep_name: str) -> None:
        complete = self.checkpoints()
        for path in complete[:-self.keep]:
            if path.name != keep_name and path.name != self._latest_name():
                shutil.rmtree(path, ignore_errors=True)

    def _remove_unfinished(self) -> None:
        for path in self.root.glob(".tmp-*"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    # ---- loading ----

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories, oldest first (by step)."""
        if not self.root.is_dir():
            return []
        found = [(m, p) for p in self.root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
        return [p for m, p in sorted(found, key=lambda mp: (int(mp[0].group(1)), int(mp[0].group(2) or 0)))]

    def _latest_name(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def load_latest(self, files: tuple[str, ...] | None = None) -> Loaded | None:
        """The newest checkpoint that verifies (the one `latest` names first), or None if there is none."""
        candidates = list(reversed(self.checkpoints()))
        latest = self._latest_name()
        if latest and (self.root / latest) in candidates:
            candidates.remove(self.root / latest)
            candidates.insert(0, self.root / latest)
        elif candidates:
            self.log(f"hpc-ddp: {self.root / LATEST} does not name a checkpoint ({latest!r}); "
                     f"using the newest one found")
        if candidates:
            for place in (self.root.parent, self.root):
                self._warn_if_others_can_write(place)
        for path in candidates:
            try:
                return load(path, files)
            except CheckpointError as exc:
                self.log(f"hpc-ddp: {exc}; trying the previous checkpoint")
        if candidates:
            self.log(f"hpc-ddp: no valid checkpoint among {len(candidates)} in {self.root}; starting from scratch")
        return None

    def _warn_if_others_can_write(self, place: Path) -> None:
        try:
            reason = others_can_write(place.stat(), os.getuid())
        except OSError:
            return
        if reason:
            self.log(f"hpc-ddp: warning: {place} {reason}: they could plant a checkpoint this run would resume "
                     f"from. HINT: chmod go-w {place}")


def others_can_write(st: os.stat_result, uid: int) -> str | None:
    """Why users other than `uid` can change what is in a directory with this stat, or None."""
    if st.st_uid != uid:
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o002:
        return "is writable by every user"
    if st.st_mode & 0o020:
        return "is writable by its group"
    return None


def verify(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, after checking every file's size and sha256."""
    manifest = _read_manifest(path)
    for fname, want in manifest["files"].items():
        _read_verified(path, fname, want)
    return manifest


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (incomplete or not ours)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int) or not all(
            isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)
            for f in files.values()):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed")
    return manifest


def _read_verified(path: Path, fname: str, want: Mapping[str, Any]) -> bytes:
    file = path / fname
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({exc.strerror})") from None
    if len(data) != want.get("size"):
        raise CheckpointError(f"checkpoint file {file} is damaged: {len(data)} bytes, manifest says {want.get('size')}")
    if hashlib.sha256(data).hexdigest() != want.get("sha256"):
        raise CheckpointError(f"checkpoint file {file} is damaged: sha256 does not match the manifest")
    return data


def load(path: Path, files: tuple[str, ...] | None = None) -> Loaded:
    """Verify every file of one checkpoint and load (weights only) those named in `files` (None: all)."""
    manifest = _read_manifest(path)
    payloads = {}
    for fname, want in manifest["files"].items():
        data = _read_verified(path, fname, want)  # every file is verified, even those not unpickled
        if files is not None and fname not in files:
            continue
        try:
            payloads[fname] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "refused by the weights-only loader"
            raise CheckpointError(f"checkpoint file {path / fname} was refused: it holds objects the weights-only "
                                  f"loader does not allow (pickled code?): {first}") from None
        except Exception as exc:  # corrupt zip structure etc., with a matching hash: not ours
            raise CheckpointError(f"checkpoint file {path / fname} cannot be loaded: {exc}") from None
    return Loaded(path, manifest, payloads)


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a checkpoint root / run dir -> the newest valid checkpoint in it."""
    if (path / MANIFEST).exists():
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir():
            manager = CheckpointManager(root, log=lambda _msg: None)
            found = manager.load_latest(files=())
            if found:
                return found.path
    raise CheckpointError(f"no valid checkpoint at {path}")


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """What `hpc-ddp inspect` prints: step, epoch, model_sha256 (recomputed from model.pt), files."""
    target = resolve(path)
    loaded = load(target, files=("model.pt",))
    if "model.pt" not in loaded.payloads:
        raise CheckpointError(f"checkpoint {target} has no model.pt")
    manifest = loaded.manifest
    return {
        "path": str(target), "step": manifest["step"], "epoch": manifest.get("epoch"),
        "batch_in_epoch": manifest.get("batch_in_epoch"),
        "model_sha256": state_sha256(loaded.payloads["model.pt"]),
        "files": manifest["files"], "verified": verify(target) is not None,
        "fingerprint": manifest.get("fingerprint"),
    }
