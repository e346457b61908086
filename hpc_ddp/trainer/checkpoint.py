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

What is in the root may have been tampered with (or broken by hand), so reading is careful:

- Only regular files are opened, and never by following a symlink: every checkpoint file, the manifest
  and `latest` go through `durable.read_regular` (lstat, open O_NONBLOCK|O_NOFOLLOW relative to the
  checkpoint directory's descriptor, fstat, S_ISREG). A FIFO, device, socket or symlink in place of a
  file is "damaged" (skipped with one line, like a bad hash), never a hang or a read of something else.
- A checkpoint directory is a real directory: a symlinked `step-N` is not listed, loaded or pruned.
  The checkpoint root itself may be a symlink (a run dir pointing at scratch space is normal), and so
  may the one path a user types to `hpc-ddp inspect`; nothing found inside either is followed.
- The manifest is at most MANIFEST_MAX bytes, its step must agree with the directory's name, and each
  name in `files` must be one plain name in that directory (no `/`, not `.`/`..`/empty/the manifest).
- `latest` is read as at most LATEST_MAX bytes of a regular file and used only if it holds a checkpoint
  name. When it is unusable the log says why, and quotes what it holds only when that is a name of our
  own scheme: never the contents of some other file.

Where a save finds something other than a file at `latest`: a symlink, FIFO or other non-directory is
replaced by the usual rename, which replaces the directory entry and never touches what a link points
at. An EMPTY directory is removed (rmdir cannot remove anything else, so nothing of anyone's is lost)
and the log says so. A directory with anything in it may be the user's: the save refuses, before
writing anything, with one CheckpointError line that says to move it away.

A save either completes (new directory in place, `latest` naming it) or leaves the root as it was: on
any error the temporary directory is removed, and if `latest` cannot be replaced the new checkpoint
is taken away again. Running out of space (ENOSPC, EDQUOT) is one CheckpointError line naming the free
space on the checkpoint filesystem and the previous checkpoint, which is kept.

Pruning deletes only directories this module completed (a real `step-N` dir holding a manifest file);
it moves each to a `.tmp-` name first, so a kill in the middle leaves nothing half-deleted under a
checkpoint name.

`load_latest(max_step=N)` / `load(path, max_step=N)`: a checkpoint that verifies but whose manifest
step is beyond N raises `BeyondSchedule` (a CheckpointError, with a hint) instead of being returned:
resuming from it would end the run at once. The trainer passes its total steps. It is an error, not a
fallback to an older checkpoint: such a checkpoint means the run dir belongs to another schedule.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.common.durable import NotRegularFile, TooLarge, file_kind, read_regular, replace_durable
from hpc_ddp.common.durable import fsync_dir as _fsync_dir
from hpc_ddp.common.durable import stream_durable as _stream_durable
from hpc_ddp.common.durable import write_durable as _write_durable
from hpc_ddp.common.rundir import CHECKPOINT_NAME as _NAME
from hpc_ddp.common.rundir import LATEST, RunDir, checkpoint_name
from hpc_ddp.trainer.checkpointread import (
    MANIFEST,
    BeyondSchedule,
    CheckpointError,
    Loaded,
    _load,
    _plain_name,
    _shown,
    load,
    verify,
)

__all__ = ["CheckpointManager", "CheckpointError", "BeyondSchedule", "Loaded", "state_sha256", "verify",
           "inspect_checkpoint", "load", "resolve"]

FORMAT = 1
LATEST_MAX = 64         # bytes; "step-000000120-r1\n" is 18
_TMP_NAME = re.compile(r"\.tmp-step-\d+(?:-r\d+)?-[0-9a-f]{8}")  # an unfinished save's directory


def state_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' raw bytes, in key order (dtype-agnostic: bf16 works too). The bytes are
    hashed in place, not copied (`tobytes()` copied each tensor under the GIL: in the background writer
    that stalled the training loop's Python, and it allocated a second copy of the model)."""
    digest = hashlib.sha256()
    for key in state_dict:
        value = state_dict[key]
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class _Sink:
    """What torch.save writes a checkpoint file into: each chunk is hashed for the manifest and written to
    the file as it comes (`stream_durable`). No serialized copy of the state is built in memory, and
    hashing and writing both release the GIL, so a save in the background writer leaves the training
    loop's Python running (torch.save into a BytesIO copied every byte under the GIL)."""

    def __init__(self) -> None:
        self.digest, self.size = hashlib.sha256(), 0  # of what reached the file
        self.failed: OSError | None = None
        self._write: Callable[[Any], int] = _not_opened

    def into(self, write: Callable[[Any], int]) -> "_Sink":
        self._write = write
        return self

    def write(self, chunk: Any) -> int:
        view = memoryview(chunk).cast("B")
        try:
            self._write(view)
        except OSError as exc:
            self.failed = self.failed or exc
            raise
        self.digest.update(view)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing buffered here (torch.save calls it at the end)."""


def _not_opened(_chunk: Any) -> int:
    raise RuntimeError("_Sink.write before into(): no file to write to")


def _write_payload(path: Path, obj: Any, sink: _Sink) -> dict[str, Any]:
    """torch.save `obj` into `path`, fsynced; its manifest entry (size, sha256). A write that fails (a full
    disk) raises its OSError, not the RuntimeError torch.save raises when it then cannot finish the file."""
    try:
        _stream_durable(path, lambda write: torch.save(obj, sink.into(write)))
    except Exception as exc:
        if sink.failed is not None and exc is not sink.failed:
            raise sink.failed from None
        raise
    return {"size": sink.size, "sha256": sink.digest.hexdigest()}


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class CheckpointManager:
    """Save (rank 0) and load (every rank) checkpoints under `root`, keeping the newest `keep` (>= 2)."""

    def __init__(self, root: str | os.PathLike, keep: int = 3, log: Callable[[str], None] = print):
        if keep < 2:
            raise ValueError("keep must be at least 2: the newest checkpoint may be the damaged one")
        self.root, self.keep, self.log = Path(root), keep, log

    # ---- saving ----

    def save(self, step: int, payloads: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
        """Write `payloads` (file name -> object for torch.save) as checkpoint `step`; return its path.

        Raises ValueError for a step that is not an int >= 0 or a file name that is not one plain name,
        and CheckpointError (one line) when the filesystem fails it: then nothing of this save is left
        and `latest` still names the previous checkpoint."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, not {_shown(step)}")
        for fname in payloads:
            if not _plain_name(fname):
                raise ValueError(f"checkpoint file name {_shown(fname)} is not one plain file name "
                                 f"(no '/', NUL, '.', '..', empty or {MANIFEST!r})")
        name, tmp = self.begin(step)
        return self.commit(name, tmp, step, payloads, meta)

    def begin(self, step: int) -> tuple[str, Path]:
        """The name a checkpoint of `step` gets, and its new temporary directory (beside it): what a save
        writes into before `commit`. A sharded save (trainer.sharded) has every rank write its shards there."""
        self._make_root()
        self._remove_unfinished()
        self._clear_latest_slot()
        name = self._free_name(step)
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(mode=0o700)
        except OSError as exc:
            raise self._save_failed(name, "its temporary directory", exc) from None
        return name, tmp

    def commit(self, name: str, tmp: Path, step: int, payloads: Mapping[str, Any], meta: Mapping[str, Any],
               files: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
        """Write `payloads` into `tmp` beside the `files` already there (name -> size, sha256: durable,
        written by the ranks), then the manifest listing them all; rename into place, point `latest`, prune.
        On any error `tmp` is removed and `latest` names the previous checkpoint."""
        final = self.root / name
        writing, sink = "its temporary directory", None
        try:
            files = dict(files or {})
            for fname, obj in payloads.items():
                sink = _Sink()
                writing = fname
                files[fname] = _write_payload(tmp / fname, obj, sink)
            sink = None
            manifest = {**meta, "format": FORMAT, "step": step, "created": time.time(), "files": files}
            writing = MANIFEST
            _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            writing = "the directory into place"
            os.rename(tmp, final)
        except BaseException as exc:  # a failed save leaves nothing; a kill (no cleanup) leaves .tmp-*
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                if sink is not None:  # how far the payload got: "model.pt after 1.2 GB"
                    writing += f" after {_size(sink.size)}"
                raise self._save_failed(name, writing, exc) from None
            raise
        try:
            _fsync_dir(self.root)
            self._point_latest_to(name)
        except OSError as exc:
            # `latest` still names the previous checkpoint: take the new one away, so that what this
            # error says (the previous checkpoint is the one kept) is what the next run finds
            self._discard(final)
            raise self._save_failed(name, f"{LATEST} (pointing it at {name})", exc) from None
        self._prune(keep_name=name)
        return final

    def _make_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            try:
                what = f"it is {file_kind(os.lstat(self.root).st_mode)}"
            except OSError:
                what = exc.strerror or str(exc)
            raise CheckpointError(f"cannot use {self.root} as the checkpoint directory: {what}") from None

    def _save_failed(self, name: str, writing: str, exc: OSError) -> CheckpointError:
        previous = self._latest_name()
        kept = f"the previous checkpoint {previous} is kept" if previous else "there is no earlier checkpoint"
        try:
            free = f"{_size(shutil.disk_usage(self.root).free)} free there"
        except OSError:
            free = "free space unknown"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
            return CheckpointError(f"{what} saving checkpoint {name} in {self.root} (writing {writing}; {free}); "
                                   f"{kept}", hint="free space on that filesystem, or checkpoint to a larger one")
        return CheckpointError(f"saving checkpoint {name} in {self.root} failed writing {writing}: "
                               f"{exc.strerror or exc}; {kept}")

    def _clear_latest_slot(self) -> None:
        """Make sure the rename in _point_latest_to can replace `latest`: see the module docstring."""
        latest = self.root / LATEST
        try:
            if not stat.S_ISDIR(os.lstat(latest).st_mode):
                return
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CheckpointError(f"cannot check {latest}: {exc.strerror}") from None
        try:
            os.rmdir(latest)  # removes only an empty directory: nothing of anyone's is lost
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointError(
                    f"{latest} is a directory with files in it, where hpc-ddp keeps the name of the newest "
                    f"checkpoint; not saving over it", hint="move that directory away, then run again") from None
            raise CheckpointError(f"cannot remove the empty directory {latest}: {exc.strerror}") from None
        self.log(f"hpc-ddp: removed the empty directory {latest}: the file naming the newest checkpoint goes there")

    def _free_name(self, step: int) -> str:
        """step-N, or step-N-rK when step N was saved before: nothing complete is ever replaced in place
        (and nothing else of that name either: a dangling link or a file keeps its name too)."""
        name, revision = checkpoint_name(step), 0
        while os.path.lexists(self.root / name):
            revision += 1
            name = checkpoint_name(step, revision)
        return name

    def _point_latest_to(self, name: str) -> None:
        replace_durable(self.root / LATEST, (name + "\n").encode())

    def _prune(self, keep_name: str) -> None:
        """Delete all but the newest `keep` checkpoints this module made (see the module docstring)."""
        ours = [path for path in self.checkpoints() if _holds_manifest(path)]
        latest = self._latest_name()
        for path in ours[:-self.keep]:
            if path.name != keep_name and path.name != latest:
                self._discard(path)

    def _discard(self, path: Path) -> None:
        """Delete a checkpoint dir: renamed to a temp name first, so no half-deleted dir keeps a step name."""
        gone = self.root / f".tmp-old-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, gone)
        except OSError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def _remove_unfinished(self) -> None:
        """Remove `.tmp-*` (this module's temp naming) in the root; a symlink is unlinked, never followed."""
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        for entry in entries:
            if not entry.name.startswith(".tmp-"):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):  # gone already, or not ours to remove: the save goes on
                    os.unlink(entry.path)

    # ---- loading ----

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories, oldest first (by step): real directories only, never a symlink."""
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        found = [(m, self.root / e.name) for e in entries
                 if (m := _NAME.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)]
        return [p for m, p in sorted(found, key=lambda mp: (int(mp[0].group(1)), int(mp[0].group(2) or 0)))]

    def _latest_name(self) -> str | None:
        return self._read_latest()[0]

    def _read_latest(self) -> tuple[str | None, str]:
        """(the checkpoint name `latest` holds, or None; a line saying what is wrong with it otherwise).
        Never follows a link or opens a non-file; quotes the content only when it is one of our names."""
        path = self.root / LATEST
        try:
            raw = read_regular(path, limit=LATEST_MAX)
        except FileNotFoundError:
            return None, f"{path} is missing"
        except (NotRegularFile, TooLarge) as exc:
            return None, f"{path} {exc.strerror}"
        except OSError as exc:
            return None, f"{path} is unreadable ({exc.strerror})"
        text = raw.decode("ascii", "replace").strip()
        if _NAME.fullmatch(text):
            return text, f"{path} names {text}, which is not a checkpoint directory here"
        shown = repr(text) if _TMP_NAME.fullmatch(text) else f"{len(raw)} bytes, not shown"
        return None, f"{path} does not name a checkpoint ({shown})"

    def latest_manifest(self) -> dict[str, Any] | None:
        """The manifest of the checkpoint a resume would try first (what `latest` names, else the newest), read
        but not verified: what a run plans with before it loads (the world size that saved it). None: none."""
        candidates = self.checkpoints()
        latest = self._latest_name()
        path = self.root / latest if latest and (self.root / latest) in candidates else \
            (candidates[-1] if candidates else None)
        if path is None:
            return None
        try:
            data = json.loads(read_regular(path / MANIFEST, limit=1 << 24))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def load_latest(self, files: tuple[str, ...] | None = None, max_step: int | None = None) -> Loaded | None:
        """The newest checkpoint that verifies (the one `latest` names first), or None if there is none.

        With `max_step`, a verified checkpoint whose step is beyond it raises BeyondSchedule (it is not
        skipped): the caller's schedule and the run dir disagree, and a person has to decide."""
        candidates = self.candidates()
        for path in candidates:
            match = _NAME.fullmatch(path.name)
            try:
                return _load(path, files, max_step, name_step=int(match.group(1)) if match else None)
            except BeyondSchedule:
                raise
            except CheckpointError as exc:
                self.log(f"hpc-ddp: {exc}; trying the previous checkpoint")
        if candidates:
            self.log(f"hpc-ddp: no valid checkpoint among {len(candidates)} in {self.root}; starting from scratch")
        return None

    def candidates(self) -> list[Path]:
        """The checkpoints a resume tries, in order: the one `latest` names, then the rest newest first
        (saying why where `latest` is unusable, and warning where others could plant one)."""
        candidates = list(reversed(self.checkpoints()))
        latest, why = self._read_latest()
        if latest and (self.root / latest) in candidates:
            candidates.remove(self.root / latest)
            candidates.insert(0, self.root / latest)
        elif candidates:
            self.log(f"hpc-ddp: {why}; using the newest checkpoint found")
        if candidates:
            for place in (self.root.parent, self.root):
                self._warn_if_others_can_write(place)
        return candidates

    def _warn_if_others_can_write(self, place: Path) -> None:
        try:
            reason = others_can_write(place.stat(), os.getuid())
        except OSError:
            return
        if reason:
            self.log(f"hpc-ddp: warning: {place} {reason}: they could plant a checkpoint this run would resume "
                     f"from. HINT: chmod go-w {place}")


def _holds_manifest(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path / MANIFEST).st_mode)
    except OSError:
        return False


def others_can_write(st: os.stat_result, uid: int) -> str | None:
    """Why users other than `uid` can change what is in a directory with this stat, or None."""
    if st.st_uid != uid:
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o002:
        return "is writable by every user"
    if st.st_mode & 0o020:
        return "is writable by its group"
    return None


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a checkpoint root / run dir -> the newest valid checkpoint in it.
    `path` itself may be a symlink (the user named it); nothing inside it is followed."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    if os.path.lexists(path / MANIFEST):
        return path
    for root in (path, RunDir(path).checkpoints):
        if root.is_dir():
            manager = CheckpointManager(root, log=lambda _msg: None)
            found = manager.load_latest(files=())
            if found:
                return found.path
    raise CheckpointError(f"no valid checkpoint at {path}")


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """What `hpc-ddp inspect` prints: step, epoch, model_sha256 (recomputed from model.pt, or from the model
    consolidated out of a sharded checkpoint's shards: the hash its `hpc-ddp export` file has), files."""
    from hpc_ddp.trainer.consolidate import model_state

    target = resolve(path)
    loaded = load(target, files=("model.pt",))  # every file verified
    manifest = loaded.manifest
    model = model_state(loaded)
    return {
        "path": str(target), "step": manifest["step"], "epoch": manifest.get("epoch"),
        "batch_in_epoch": manifest.get("batch_in_epoch"),
        "model_sha256": state_sha256(model),
        "files": manifest["files"], "verified": True,
        "fingerprint": manifest.get("fingerprint"), "code": manifest.get("code"),
        "sharded": manifest.get("sharded"),
    }
