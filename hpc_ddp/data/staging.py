"""Dataset staging: copy (or extract) a dataset from the shared filesystem to node-local disk, once per
node, race-free and verified.

    stage(src, scratch, name=...) -> the staged directory

- One stager per node and dataset: an exclusive `flock` on a lock file *on the local disk* (file locks on
  Lustre/GPFS/NFS can silently succeed for everyone). Other callers block on the lock, then find the
  completed copy and reuse it.
- Never a half-written dataset: the copy goes to `.NAME.tmp-XXXXXXXX` beside the target, is verified against
  a manifest of the source (sizes; sha256 when asked) and the source is checked unchanged, then renamed into
  place, and only then is the completion marker written (atomically). Any failure removes the temp copy; a
  stager killed mid-copy leaves only a temp dir, which the next stager removes before starting again.
- Reuse: a marker whose source key (path, and every file's size and mtime) matches means "already
  staged": a requeued job on the same node does not copy again.
- Only what hpc-ddp provably made is ever deleted or replaced: a target with our marker beside it (written
  before the rename that makes the target appear, naming the device and inode of the very directory it
  vouches for, so a marker copied in or left beside a folder of the user's vouches for nothing) and our own
  temp names. A user's directory at the target,
  a source that overlaps the target in either direction, and names that are not one plain path component
  are refused before anything is touched.
- Archives (.tar, .tar.gz, .tgz, .zip) are extracted with the same care; members with absolute paths or
  `..`, and links that would resolve outside the way tar resolves them (through the archive's own symlinks;
  hard links from the archive root), are refused before anything is written. A truncated or corrupt
  archive is a one-line error.
- Free space is checked first in whole blocks of the destination filesystem (and inodes), naming what is
  needed and what is available.

Here the plan, the copy and its checks; archives in `archives.py`, the marker, syncfs and the lock in
`stagelock.py`, the errors in `stageerrors.py`, and what may be a source (which the spec checks too, before
any job) in `spec/datasource.py`; all re-exported here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from hpc_ddp.common.durable import file_kind
from hpc_ddp.common.durable import fsync_dir as _fsync_dir
from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.rundir import RANK_LOGS_GLOB
from hpc_ddp.common.units import human_bytes
from hpc_ddp.data.archives import _archive_dirs, _check_members, _extract, _first_line, _list_archive
from hpc_ddp.data.stageerrors import BadArchive, HostileArchive, ScratchUnusable, StagingError, TargetOccupied
from hpc_ddp.data.stagelock import (
    _complete,
    _die_with_parent,
    _exclusive,
    _fsync_tree,
    _identity,
    _read_marker,
    _write_marker,
)
from hpc_ddp.spec.datasource import ARCHIVE_SUFFIXES, StageRefused, missing_here, source_kind, source_problem

__all__ = ["stage", "wait_for_stage", "download_once", "is_archive", "StagingError", "source_manifest",
           "ARCHIVE_SUFFIXES", "StageResult", "StageRefused", "ScratchUnusable", "TargetOccupied", "BadArchive",
           "HostileArchive", "source_problem", "missing_here", "check_name"]

MARKER_SUFFIX = ".complete.json"
SPACE_MARGIN = 1.05
_TMP_INFIX = ".tmp-"
# The longest names made from NAME are the marker (NAME.complete.json) and the temp dir (.NAME.tmp-XXXXXXXX),
# 14 bytes more each; a file name has at most 255 bytes.
MAX_NAME_BYTES = 255 - len(MARKER_SUFFIX)
_NAME_HINT = "pass --name NAME: one plain path component (letters, digits, _ - .), not starting with a dot"





@dataclasses.dataclass(frozen=True)
class StageResult:
    path: Path
    copied: bool          # False: an existing verified copy was reused
    files: int
    bytes: int
    seconds: float


def is_archive(src: Path) -> bool:
    return src.is_file() and src.name.endswith(ARCHIVE_SUFFIXES)


def source_manifest(src: Path, checksums: bool = False) -> dict[str, dict]:
    """relative path -> {size[, sha256]} for every regular file under `src` (or of the archive itself)."""
    return _walk(src, checksums)[0]


def _walk(src: Path, checksums: bool) -> tuple[dict[str, dict], int]:
    """The manifest and the number of directories (they take blocks and inodes too)."""
    if src.is_file():
        return {src.name: _entry(src, checksums)}, 0
    out, dirs = {}, 0
    for root, _dirs, files in os.walk(src):
        dirs += 1
        for name in files:
            path = Path(root, name)
            out[path.relative_to(src).as_posix()] = _entry(path, checksums)
    return out, dirs


def _entry(path: Path, checksums: bool) -> dict:
    """Size and mtime (and sha256) of a dataset file: a regular file, or a link to one (cp -L copies what
    it points to). A FIFO, a device or a link to one is refused: it would hang the copy or never end."""
    try:
        info = path.stat()
    except OSError as exc:
        raise StageRefused(f"{path} cannot be read: {exc.strerror or exc}",
                           hint="fix or remove it; a dataset is made of regular files") from None
    if not stat.S_ISREG(info.st_mode):
        raise StageRefused(f"{path} is {file_kind(info.st_mode)}, not a regular file: it is not staged",
                           hint="remove it from the dataset; a dataset is made of regular files")
    entry = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
    if checksums:
        entry["sha256"] = _sha256(path)
    return entry


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)  # swapped for a FIFO: no hang
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StageRefused(f"{path} is not a regular file: it is not staged", hint="remove it from the dataset")
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _source_key(src: Path, manifest: dict[str, dict]) -> str:
    text = json.dumps({"src": str(src.resolve()), "files": manifest}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


# ---- what may be staged, and where ----

def check_name(name: str) -> str:
    """`name` if it is one plain path component that cannot collide with our temp, lock or marker names.
    The target is scratch/NAME and a stale one is deleted: `..`, `a/b` or an empty name would point that
    deletion at a sibling or at scratch itself."""
    if not name:
        raise StageRefused("the dataset name is empty", hint=_NAME_HINT)
    if name in (".", "..") or "/" in name or "\0" in name:
        raise StageRefused(f"dataset name {name!r} is not a single plain path component", hint=_NAME_HINT)
    if name.startswith("."):
        raise StageRefused(f"dataset name {name!r} starts with a dot (hpc-ddp's temp and lock names do)",
                           hint=_NAME_HINT)
    if name.endswith(MARKER_SUFFIX) or _TMP_INFIX in name:
        raise StageRefused(f"dataset name {name!r} looks like one of hpc-ddp's own marker or temp names",
                           hint=_NAME_HINT)
    if len(os.fsencode(name)) > MAX_NAME_BYTES:
        raise StageRefused(f"dataset name is {len(os.fsencode(name))} bytes long (at most {MAX_NAME_BYTES})",
                           hint=_NAME_HINT)
    return name


def _default_name(src: Path) -> str:
    """The source's name up to its first dot: mnist/ -> mnist, mnist.tar.gz -> mnist. Taken from the absolute
    path without resolving symlinks, so `stage .` names the current directory and a link keeps its own name."""
    name = os.path.basename(os.path.abspath(src)).split(".")[0]
    if not name:
        raise StageRefused(f"cannot derive a dataset name from {str(src)!r}", hint=_NAME_HINT)
    return name


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _refuse_overlap(src: Path, root: Path, name: str) -> None:
    """Refuse a source that is, contains or lies inside anything stage() may delete or write: the target,
    its marker, its temp and lock names, or the scratch dir itself. Real paths: a symlink does not hide it."""
    real_src, real_root = os.path.realpath(src), os.path.realpath(root)
    hint = "stage into a --dest outside the source, and keep the source outside the destination's NAME"
    if _within(real_root, real_src):
        raise StageRefused(f"the destination {root} is the source {src} or inside it", hint=hint)
    for ours in (root / name, root / f"{name}{MARKER_SUFFIX}"):
        real = os.path.realpath(ours)
        if _within(real, real_src) or _within(real_src, real):
            raise StageRefused(f"the source {src} overlaps the staged copy {ours}", hint=hint)
    if _within(real_src, real_root):
        first = os.path.relpath(real_src, real_root).split(os.sep)[0]
        if _is_tmp_name(first, name) or first == f".{name}.lock":
            raise StageRefused(f"the source {src} is one of hpc-ddp's own temp names in {root}", hint=hint)


def _scratch(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        raise ScratchUnusable(f"cannot stage into {root}: it exists and is not a directory",
                              hint="pass a directory to --dest (or set the profile's scratch to one)") from None
    except OSError as exc:
        raise ScratchUnusable(f"cannot stage into {root}: {exc.strerror}",
                              hint="pass a writable directory to --dest (or set the profile's scratch)") from None
    return root


def stage(src: str | os.PathLike, scratch: str | os.PathLike, *, name: str | None = None, checksums: bool = False,
          lock_timeout: float = 3600, log: Callable[[str], None] = print) -> StageResult:
    """Stage `src` (a directory or an archive) into `scratch`/NAME; return where it is."""
    src = Path(src)
    kind = source_kind(src)
    name = check_name(name if name is not None else _default_name(src))
    root = Path(scratch)
    _refuse_overlap(src, root, name)  # before mkdir: a --dest inside the source must not even be created
    _scratch(root)
    manifest, dirs = _walk(src, checksums)
    key = _source_key(src, manifest)
    target, marker = root / name, root / f"{name}{MARKER_SUFFIX}"
    with _exclusive(root / f".{name}.lock", lock_timeout, log):
        if _complete(target, marker, key):
            log(f"hpc-ddp stage: {name}: reusing the verified copy in {target}")
            return StageResult(target, False, len(manifest), _total(manifest), 0.0)
        return _stage_locked(src, kind, target, marker, key, manifest, dirs, checksums, log)


def wait_for_stage(src: str | os.PathLike, scratch: str | os.PathLike, *, name: str, timeout: float,
                   checksums: bool = False) -> Path:
    """For the node's other ranks: wait until the stager (local rank 0) has completed `name`."""
    src = Path(src)
    root = Path(scratch)
    name = check_name(name)
    key = _source_key(src, source_manifest(src, checksums))
    target, marker = root / name, root / f"{name}{MARKER_SUFFIX}"
    return _wait_complete(target, marker, key, timeout,
                          f"waited {timeout:.0f} s for local rank 0 to stage {name} into {root}",
                          f"see local rank 0's log on this node ({RANK_LOGS_GLOB})")


def _wait_complete(target: Path, marker: Path, key: str, timeout: float, message: str, hint: str) -> Path:
    deadline = time.monotonic() + timeout
    while not _complete(target, marker, key):
        if time.monotonic() > deadline:
            raise StagingError(message, hint=hint)
        time.sleep(0.2)
    return target


def download_once(download: Callable[[Path], None], target: str | os.PathLike, *, key: str, builder: bool,
                  timeout: float = 3600, log: Callable[[str], None] = print) -> Path:
    """Run `download(tmp_dir)` once and publish its result at `target`; everyone else waits.

    `builder` says who downloads: local rank 0 when `target` is on node-local disk (one download per
    node), global rank 0 when it is on a shared filesystem (one download in all). torchvision's own
    `download=True` writes in place with no completion marker, so concurrent ranks corrupt each other;
    here the download goes to a temporary directory, is renamed into place, and only then marked done.
    A marker whose `key` (e.g. the URL and version) differs means "download again".
    """
    target = Path(target)
    marker = target.with_name(f"{target.name}{MARKER_SUFFIX}")
    if not builder:
        return _wait_complete(target, marker, key, timeout, f"waited {timeout:.0f} s for {target.name} to be downloaded",
                              "see the log of the rank that downloads it (local rank 0, or rank 0)")
    target.parent.mkdir(parents=True, exist_ok=True)
    if _complete(target, marker, key):
        return target
    _clear_leftovers(target.parent, target.name)
    _clear_stale(target, marker)
    tmp = _new_tmp(target)
    tmp.mkdir(mode=0o700)
    started = time.monotonic()
    with _removed_on_failure(tmp):
        download(tmp)
        _fsync_tree(tmp)
        _publish(tmp, target, marker)
    _write_marker(marker, {"key": key}, target)
    log(f"hpc-ddp: downloaded {target.name} in {time.monotonic() - started:.1f} s -> {target}")
    return target


def _stage_locked(src: Path, kind: str, target: Path, marker: Path, key: str, manifest: dict[str, dict],
                  dirs: int, checksums: bool, log: Callable[[str], None]) -> StageResult:
    root = target.parent
    _clear_leftovers(root, target.name)  # a stager that died mid-copy
    _clear_stale(target, marker)  # only a copy our marker proves we made; anything else is refused
    if kind == "archive":
        members = _list_archive(src)
        _check_members(src, members)
        files = [m for m in members if m.kind == "file"]
        _check_space(root, [m.size for m in files], _archive_dirs(members), target.name)
    else:
        members = []
        _check_space(root, [e["size"] for e in manifest.values()], dirs, target.name)
    tmp = _new_tmp(target)
    started = time.monotonic()
    with _removed_on_failure(tmp):
        if kind == "archive":
            counts = _extract(src, members, tmp)
        else:
            _copy_tree(src, tmp)
            counts = _verify(tmp, manifest, checksums)
            _unchanged(src, manifest)
        _fsync_tree(tmp)
        _publish(tmp, target, marker)
    _write_marker(marker, {"key": key, "source": str(src), "files": counts[0], "bytes": counts[1]}, target)
    seconds = time.monotonic() - started
    log(f"hpc-ddp stage: {target.name}: {counts[0]} files, {counts[1] / 1e6:.1f} MB in {seconds:.1f} s "
        f"({counts[1] / 1e6 / max(seconds, 1e-9):.0f} MB/s) -> {target}")
    return StageResult(target, True, counts[0], counts[1], seconds)


# ---- ours and only ours: temp names, markers, stale copies ----

def _new_tmp(target: Path) -> Path:
    return target.parent / f".{target.name}{_TMP_INFIX}{uuid.uuid4().hex[:8]}"


def _is_tmp_name(entry: str, name: str) -> bool:
    return re.fullmatch(re.escape(f".{name}{_TMP_INFIX}") + "[0-9a-f]{8}", entry) is not None


def _clear_leftovers(root: Path, name: str) -> None:
    """Remove temp dirs of dead stagers: exactly our temp naming, real directories only (not links)."""
    with os.scandir(root) as entries:
        stale = [Path(e.path) for e in entries if _is_tmp_name(e.name, name) and e.is_dir(follow_symlinks=False)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


class _removed_on_failure:
    """Whatever goes wrong (disk full, source changed, bad archive, Ctrl-C), the temp copy goes too."""

    def __init__(self, tmp: Path):
        self.tmp = tmp

    def __enter__(self):
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, HpcDdpError):
                raise StagingError(f"staging failed, nothing kept: {exc.strerror or exc}",
                                   hint="check the free space and permissions of the scratch directory") from None
        return False


def _marker_is_ours(marker: Path, target: Path) -> bool:
    """A marker hpc-ddp wrote, for the directory now at `target` if there is one there: a marker copied
    in from elsewhere, or one whose folder was replaced by the user's own, vouches for nothing."""
    data = _read_marker(marker)
    if data is None:
        return False
    return not os.path.lexists(target) or data["dir"] == _identity(target)


def _clear_stale(target: Path, marker: Path) -> None:
    """Make room for a new copy, deleting only what our marker proves we made. The stale target is first
    renamed to one of our temp names, so a kill mid-delete leaves a leftover the next stager removes,
    never a half-deleted dataset under the real name."""
    hint = "move it away, or stage under another --name or --dest"
    marker_there, target_there = os.path.lexists(marker), os.path.lexists(target)
    if marker_there and not _marker_is_ours(marker, target):
        raise TargetOccupied(f"{marker} exists and was not written by hpc-ddp for {target.name}; refusing to "
                             "replace either", hint=hint)
    if target_there:
        if not marker_there or target.is_symlink() or not target.is_dir():
            raise TargetOccupied(f"{target} exists and was not staged by hpc-ddp (no {marker.name} beside it); "
                                 "refusing to replace it", hint=hint)
        doomed = _new_tmp(target)
        os.rename(target, doomed)
        marker.unlink()
        shutil.rmtree(doomed)
    elif marker_there:
        marker.unlink()


def _publish(tmp: Path, target: Path, marker: Path) -> None:
    """Claim the target with a pending marker, then rename the copy into place: a stager killed between
    the rename and the completion marker leaves a target that is still provably ours."""
    _write_marker(marker, {"key": "", "state": "publishing"}, tmp)
    os.rename(tmp, target)
    _fsync_dir(target.parent)


def _copy_tree(src: Path, tmp: Path) -> None:
    """GNU cp where there is one (it is what the benchmark compares against), else shutil."""
    if shutil.which("cp"):
        done = subprocess.run(["cp", "-r", "-L", "--preserve=timestamps", "--", str(src.absolute()), str(tmp.absolute())],
                              capture_output=True, text=True, preexec_fn=_die_with_parent)
        if done.returncode != 0:
            raise StagingError(f"copying {src} failed, nothing kept: {_first_line(done.stderr)}",
                               hint="check the free space of the scratch directory and that the source is readable")
    else:
        shutil.copytree(src, tmp, copy_function=shutil.copy2, symlinks=False)


def _total(manifest: dict[str, dict]) -> int:
    return sum(entry["size"] for entry in manifest.values())


# ---- free space ----

def blocks_needed(sizes: Iterable[int], dirs: int, block: int) -> int:
    """Bytes `sizes` take on a filesystem with `block`-byte blocks: every file rounded up to whole blocks
    (8,000 files of 100 B take 8,000 blocks, 32 MB at 4 KiB, not 800 kB), and one block per directory."""
    return sum(-(-size // block) * block for size in sizes) + dirs * block


def _check_space(root: Path, sizes: list[int], dirs: int, name: str) -> None:
    fs = os.statvfs(root)
    block = fs.f_frsize or fs.f_bsize or 4096
    needed, free = blocks_needed(sizes, dirs, block), fs.f_bavail * block
    hint = "choose another scratch directory (profile `scratch`, or --dest) or read the data in place"
    if needed * SPACE_MARGIN > free:
        raise StagingError(f"not enough space to stage {name} in {root}: needs {human_bytes(needed)} "
                           f"({len(sizes)} files in {block} B blocks), {human_bytes(free)} free", hint=hint)
    inodes = len(sizes) + dirs
    if fs.f_files and inodes > fs.f_favail:  # f_files 0: a filesystem without an inode limit
        raise StagingError(f"not enough inodes to stage {name} in {root}: needs {inodes}, {fs.f_favail} free",
                           hint=hint)


def _verify(tmp: Path, manifest: dict[str, dict], checksums: bool) -> tuple[int, int]:
    copied = source_manifest(tmp, checksums)
    missing = sorted(set(manifest) - set(copied))
    if missing:
        raise StagingError(f"staged copy is missing {len(missing)} file(s), e.g. {missing[0]}")
    for rel, want in manifest.items():
        got = copied[rel]
        if got["size"] != want["size"] or (checksums and got.get("sha256") != want.get("sha256")):
            raise StagingError(f"staged copy of {rel} does not match the source (size or sha256)",
                               hint="the source may have changed while it was copied; stage again")
    return len(manifest), _total(manifest)


def _unchanged(src: Path, manifest: dict[str, dict]) -> None:
    """The source as it is now must be the source the copy started from (every file's size and mtime, no
    file added or gone): a copy taken while it was being written is not a copy of anything."""
    now = source_manifest(src, False)
    changed = sorted(set(now) ^ set(manifest)) or sorted(
        rel for rel, entry in now.items()
        if (entry["size"], entry["mtime_ns"]) != (manifest[rel]["size"], manifest[rel]["mtime_ns"]))
    if changed:
        raise StagingError(f"the source {src} changed while it was copied (e.g. {changed[0]}); nothing kept",
                           hint="stage again once nothing writes to the source")
