"""Reading a checkpoint directory that may have been tampered with or broken by hand: its manifest, and
each file verified (size, sha256) before it is unpickled weights-only. What checkpoint.py's module docstring
promises of reading is kept here; checkpoint.py writes, lists and prunes, and re-exports these names."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.common.durable import NotRegularFile, TooLarge, file_kind, read_regular
from hpc_ddp.common.errors import HpcDdpError

__all__ = ["BeyondSchedule", "CheckpointError", "Loaded", "MANIFEST", "load", "read_manifest", "verify"]

MANIFEST = "manifest.json"
MANIFEST_MAX = 1 << 20  # bytes; a real manifest is a few KiB
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CheckpointError(HpcDdpError):
    """A checkpoint is damaged, incomplete or refused; the message names the file."""


class BeyondSchedule(CheckpointError):
    """A checkpoint that verifies, at a step beyond the caller's `max_step`."""


@dataclasses.dataclass
class Loaded:
    path: Path
    manifest: dict[str, Any]
    payloads: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def _plain_name(fname: object) -> bool:
    """One plain file name inside a checkpoint directory: no path, no link out, not the manifest."""
    if not isinstance(fname, str) or fname in ("", ".", "..", MANIFEST) or "/" in fname or "\0" in fname:
        return False
    try:
        return len(fname.encode()) <= 255
    except UnicodeEncodeError:
        return False


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _open_dir(path: Path) -> int:
    """A descriptor of the checkpoint directory `path` itself: a symlink there is refused, not followed."""
    try:
        return os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        try:
            kind = file_kind(os.lstat(path).st_mode)
        except OSError:
            kind = "a directory"
        if kind != "a directory":
            raise CheckpointError(f"checkpoint {path} is {kind}, not a directory (not followed)") from None
        raise CheckpointError(f"checkpoint {path} cannot be opened ({exc.strerror})") from None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, read and checked for form, no file verified."""
    fd = _open_dir(path)
    try:
        return _read_manifest(path, fd)
    finally:
        os.close(fd)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, after checking every file's size and sha256."""
    fd = _open_dir(path)
    try:
        manifest = _read_manifest(path, fd)
        for fname, want in manifest["files"].items():
            _read_verified(path, fname, want, fd)
        return manifest
    finally:
        os.close(fd)


def _read_manifest(path: Path, dir_fd: int) -> dict[str, Any]:
    try:
        raw = read_regular(MANIFEST, limit=MANIFEST_MAX, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (incomplete or not ours)") from None
    except (NotRegularFile, TooLarge) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} {exc.strerror}") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({exc.strerror})") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested 100,000 deep
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({_shown(str(exc))[1:-1]})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed (no files, or no step >= 0)")
    for fname, entry in files.items():
        if not _plain_name(fname):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed: file name {_shown(fname)} is not "
                                  f"one plain name in the checkpoint directory")
        size = entry.get("size") if isinstance(entry, dict) else None
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(sha, str) \
                or not _SHA256.fullmatch(sha):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} is malformed: the entry of {fname} needs a "
                                  f"size >= 0 and a sha256")
    return manifest


def _read_verified(path: Path, fname: str, want: Mapping[str, Any], dir_fd: int) -> bytes:
    file = path / fname
    try:
        st = os.stat(fname, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_size != want["size"]:  # found without reading the file
            raise CheckpointError(f"checkpoint file {file} is damaged: {st.st_size} bytes, "
                                  f"manifest says {want['size']}")
        data = read_regular(fname, dir_fd=dir_fd)
    except NotRegularFile as exc:
        raise CheckpointError(f"checkpoint file {file} {exc.strerror}") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {file} is missing (the manifest lists it)") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({exc.strerror})") from None
    if len(data) != want["size"]:
        raise CheckpointError(f"checkpoint file {file} is damaged: {len(data)} bytes, manifest says {want['size']}")
    if hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise CheckpointError(f"checkpoint file {file} is damaged: sha256 does not match the manifest")
    return data


def _check_present(path: Path, fname: str, want: Mapping[str, Any], dir_fd: int) -> None:
    """A file another rank verifies: here only there, a regular file, of the manifest's size."""
    try:
        st = os.stat(fname, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        what = "missing (the manifest lists it)" if isinstance(exc, FileNotFoundError) else f"unreadable ({exc.strerror})"
        raise CheckpointError(f"checkpoint file {path / fname} is {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"checkpoint file {path / fname} is {file_kind(st.st_mode)}, not a file")
    if st.st_size != want["size"]:
        raise CheckpointError(f"checkpoint file {path / fname} is damaged: {st.st_size} bytes, "
                              f"manifest says {want['size']}")


def load(path: Path, files: tuple[str, ...] | None = None, max_step: int | None = None) -> Loaded:
    """Verify every file of one checkpoint and load (weights only) those named in `files` (None: all).
    With `max_step`, a checkpoint beyond it raises BeyondSchedule (after it verified)."""
    return _load(path, files, max_step)


def _load(path: Path, files: tuple[str, ...] | None, max_step: int | None, name_step: int | None = None,
          hashed: Any = None) -> Loaded:
    """`hashed`: the files whose bytes this caller verifies (None: every file); the others are checked to be
    there at their size. The ranks of a sharded checkpoint split its files so (trainer.sharded)."""
    fd = _open_dir(path)
    try:
        manifest = _read_manifest(path, fd)
        step = manifest["step"]
        if name_step is not None and step != name_step:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} says step {step}, the directory's name says "
                                  f"{name_step} (not saved by hpc-ddp as it is)")
        beyond = max_step is not None and step > max_step
        payloads = {}
        for fname, want in manifest["files"].items():
            wanted = not beyond and (files is None or fname in files)
            if hashed is not None and fname not in hashed and not wanted:
                _check_present(path, fname, want, fd)
                continue
            data = _read_verified(path, fname, want, fd)  # every file is verified, even those not unpickled
            if not wanted:
                continue
            try:
                payloads[fname] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else "refused by the weights-only loader"
                raise CheckpointError(f"checkpoint file {path / fname} was refused: it holds objects the weights-only "
                                      f"loader does not allow (pickled code?): {first}") from None
            except Exception as exc:  # corrupt zip structure etc., with a matching hash: not ours
                raise CheckpointError(f"checkpoint file {path / fname} cannot be loaded: {exc}") from None
    finally:
        os.close(fd)
    if beyond:
        raise BeyondSchedule(f"checkpoint {path} is at step {step}, beyond this run's schedule of {max_step} steps: "
                             f"resuming from it would end the run at once",
                             hint="this run dir holds another schedule's checkpoints: start afresh with another "
                                  "--run-dir, or restore the schedule they were saved under")
    return Loaded(path, manifest, payloads)
