"""The snapshot of the user's project that submit takes, so that every attempt runs the code as submitted.

Which files make the project, and what is left out: `listing.py`. Reading and copying them: `copying.py`.
Here: the snapshot planned (its id, the content's hash), taken into the run dir with its manifest, and
recorded in the run dir's events.

    RUN_DIR/code/<id>/          the copy (files read-only): the project's layout, its id the content's hash
    RUN_DIR/code/<id>.json      its manifest: every file's sha256, every link, what was left out
    RUN_DIR/code/<id>-<commit>.diff   the uncommitted changes to tracked files (git diff --binary HEAD)

A sweep keeps one copy for all its tasks (SWEEP_DIR/code); a chain, a requeue and its fallback job all
run the run dir's spec, which names the copy. `plan` reads (for --dry-run: the id it would have);
`take` writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import read_regular
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.rundir import CODE
from hpc_ddp.common.units import MB, human_bytes
from hpc_ddp.snapshot.copying import _Budget, _copy, _each_file, _remove_copy
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import Listing, _shown, check_limits, list_project, project_root
from hpc_ddp.spec.code import Code
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["Snapshot", "plan", "hashed", "take", "record", "changes", "manifest_of", "CODE_DIR"]

CODE_DIR = CODE


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A planned snapshot: what will be copied, and the id and place it will have."""

    listing: Listing
    id: str
    hashes: dict[str, str]           # rel -> sha256 of each file
    code_root: str                   # RUN_DIR/code (a sweep's: SWEEP_DIR/code)
    script: str | None               # the script, relative to the project
    max_bytes: int | None = None     # the limit the copy is held to too (a file may grow after the plan)
    expected: dict[str, str] | None = None  # a shipped snapshot: the hash each file must have (snapshot.shipped)

    @property
    def dir(self) -> str:
        return os.path.join(self.code_root, self.id)

    def code(self) -> Code:
        return Code(self.listing.project, self.dir, self.id,
                    os.path.join(self.dir, self.script) if self.script is not None else None, self.listing.origin)

    def describe(self) -> str:
        size = self.listing.size
        count = len(self.listing.files)
        what = (f"{count} file{'s' if count != 1 else ''}, {human_bytes(size)}"
                + (f", {sum(i.kind == 'live' for i in self.listing.items)} left out" if any(
                    i.kind == "live" for i in self.listing.items) else ""))
        where = self.listing.git.describe() if self.listing.git else (
            f"walked, not asked of git: {self.listing.git_error}" if self.listing.git_error else "not in git")
        return (f"code: snapshot {self.id} of {_shown(self.listing.project)} ({where}; {what}) in "
                f"{_shown(self.dir)}")


# ---------------------------------------------------------------------------------------- reading, copying


def _content_id(listing: Listing, hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    for item in listing.items:
        if item.kind == "live":  # links to the working tree: where the project is, not what the code is
            continue
        detail = hashes[item.rel] if item.kind == "file" else item.target
        h.update(f"{item.kind}\0{item.rel}\0{detail}\0{'x' if item.executable else '-'}\n".encode(
            errors="surrogateescape"))
    return h.hexdigest()[:16]


PENDING = "pending"  # the id of a snapshot planned without reading its files: `take` gives it its own


def plan(spec: JobSpec, code_root: str, git: Git | None = None, *, read: bool = True,
         shipped: tuple[Listing, dict[str, str]] | None = None) -> Snapshot | None:
    """The snapshot submit will take of the spec's project (None: nothing to pin, or snapshot = false).
    Writes nothing. With `read` every file is read and hashed, so the id is known (--dry-run shows it);
    without, only names and sizes are (a submit reads each file once, as it copies it). `shipped`: the
    listing and hashes of a project shipped from a laptop (snapshot.shipped), used instead of listing it."""
    if not spec.snapshot:
        return None
    expected = None
    if shipped is not None:
        listing, expected = shipped
        script = None
        if spec.target.kind == "script":
            path = Path(os.path.realpath(spec.target.value))
            if not path.is_relative_to(listing.project):
                raise UserError(f"the script {spec.target.value} is not in the shipped project {listing.project}",
                                hint="give the script's path inside the project")
            script = path.relative_to(listing.project).as_posix()
        _check_shipped(listing)
    else:
        git = git or Git()
        found = project_root(spec, git)
        if found is None:
            return None
        root, script = found
        if root == Path(root.anchor):
            raise UserError(f"the script's project would be the whole filesystem ({root}): {spec.target.value} is "
                            "in no repo and in no folder of its own",
                            hint="move the script into a project folder, or submit with --no-snapshot")
        listing = list_project(root, spec.snapshot_exclude, git, max_bytes=spec.snapshot_max_mb * MB, script=script)
    check_limits(listing, spec.snapshot_max_mb)
    limit = spec.snapshot_max_mb * MB
    if not read:
        return Snapshot(listing, PENDING, {}, code_root, script, limit, expected)
    snapshot_id, hashes = hashed(listing, limit)
    _check_expected(hashes, expected)
    return Snapshot(listing, snapshot_id, hashes, code_root, script, limit, expected)


def hashed(listing: Listing, max_bytes: int | None) -> tuple[str, dict[str, str]]:
    """(id, each file's sha256) of a listing, every file read once (what a laptop ships: snapshot.shipped)."""
    hashes = {item.rel: hashlib.sha256(data).hexdigest()
              for item, data in _each_file(listing.project, listing.files, _Budget(max_bytes))}
    return _content_id(listing, hashes), hashes


INCOMPLETE = "the code shipped to this cluster is incomplete"


def _check_shipped(listing: Listing) -> None:
    """Before anything is read: every shipped file is there, with its size (a transfer cut short)."""
    root = listing.project
    for item in listing.files:
        try:
            st = os.lstat(f"{root}/{item.rel}")
            whole = stat.S_ISREG(st.st_mode) and st.st_size == item.size
        except OSError:
            whole = False
        if not whole:
            raise UserError(f"{INCOMPLETE} (e.g. {_shown(item.rel)} is missing or of another size than the laptop's): "
                            "no job runs on it", hint="submit again from the laptop: the copy is finished first")


def _check_expected(hashes: dict[str, str], expected: dict[str, str] | None) -> None:
    """A shipped snapshot's files must be the laptop's, byte for byte: a connection dropped mid-copy left
    some old, and no job may run on that."""
    if expected is None:
        return
    differ = sorted(rel for rel, digest in expected.items() if hashes.get(rel) != digest)
    if differ:
        raise UserError(f"{INCOMPLETE} ({len(differ)} file"
                        f"{'s' if len(differ) != 1 else ''} differ from the laptop's, e.g. {_shown(differ[0])}): "
                        "no job runs on it", hint="submit again from the laptop: the copy is finished first")


def take(snap: Snapshot) -> Snapshot:
    """Copy the planned snapshot into its place and write its manifest; the snapshot as taken (its id
    differs from the plan's where a file changed in between). A copy with the same id is reused as it is."""
    root = Path(snap.code_root)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # a link there would send the copy elsewhere
        raise UserError(f"{_shown(str(root))} is not a folder of yours: the code snapshot does not go there",
                        hint="move it away, or submit with another --run-dir")
    tmp = root / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        hashes = _copy(snap.listing, tmp, snap.max_bytes)
        _check_expected(hashes, snap.expected)
        taken = dataclasses.replace(snap, hashes=hashes, id=_content_id(snap.listing, hashes))
        final = Path(taken.dir)
        if _is_our_copy(taken):
            shutil.rmtree(tmp)  # the same content, copied before: ours to remove, theirs to keep
        elif os.path.lexists(final):
            raise UserError(f"{final} is in the way of the code snapshot (it is not one hpc-ddp took: no manifest "
                            "beside it, or not a folder)", hint="move it away, or submit with another --run-dir")
        else:
            _write_manifest(taken)  # first: a copy in its place always has its manifest beside it
            os.rename(tmp, final)
        return taken
    except BaseException:
        if tmp.exists():
            _remove_copy(tmp)
        raise


def _is_our_copy(snap: Snapshot) -> bool:
    """A folder at the snapshot's place that hpc-ddp took with this content: a real folder, its manifest
    beside it naming this id, and every file and link of the manifest in it."""
    final = Path(snap.dir)
    manifest = manifest_of(snap.code_root, snap.id)
    if manifest is None or manifest.get("id") != snap.id or final.is_symlink() or not final.is_dir():
        return False
    return all(os.path.lexists(final / rel) for rel in manifest["items"])


def manifest_path(code_root: str | Path, snapshot_id: str) -> Path:
    return Path(code_root) / f"{snapshot_id}.json"


def _write_manifest(snap: Snapshot) -> None:
    path = manifest_path(snap.code_root, snap.id)
    if path.is_file():
        return
    data = {"id": snap.id, "project": snap.listing.project, "taken_at": time.time(),
            "files": len(snap.listing.files), "bytes": snap.listing.size,
            "items": {i.rel: (snap.hashes[i.rel] if i.kind == "file" else f"-> {i.target}") for i in snap.listing.items
                      if i.kind != "live"},
            "left_out": {i.rel: i.target for i in snap.listing.items if i.kind == "live"},
            "notes": list(snap.listing.notes)}
    _write_new(path, (json.dumps(data, indent=1) + "\n").encode())


def _write_new(path: Path, data: bytes) -> None:
    """`path`'s content, through a temp file of a random name made here and now (O_EXCL, never through a
    link planted in its place), renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def manifest_of(code_root: str | Path, snapshot_id: str) -> dict[str, Any] | None:
    try:
        data = json.loads(read_regular(manifest_path(code_root, snapshot_id), limit=256 * MB))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("items"), dict) else None


def write_patch(snap: Snapshot) -> str | None:
    """The uncommitted changes beside the copy; its name relative to the code folder, or None."""
    state = snap.listing.git
    if state is None or not state.patch:
        return None
    name = f"{snap.id}-{(state.commit or 'none')[:12]}.diff"
    path = Path(snap.code_root) / name
    if not os.path.lexists(path):
        _write_new(path, state.patch)
    return name


def changes(before: dict[str, Any] | None, after: Snapshot) -> dict[str, list[str]] | None:
    """What differs between an earlier snapshot's manifest and this one: changed, added, removed."""
    if before is None:
        return None
    old: dict[str, str] = before["items"]
    new = {i.rel: (after.hashes[i.rel] if i.kind == "file" else f"-> {i.target}") for i in after.listing.items
           if i.kind != "live"}
    return {"changed": sorted(r for r in new if r in old and old[r] != new[r]),
            "added": sorted(r for r in new if r not in old), "removed": sorted(r for r in old if r not in new)}


def describe_changes(diff: dict[str, list[str]]) -> str:
    parts = []
    for key in ("changed", "added", "removed"):
        names = diff.get(key) or []
        if names:
            shown = ", ".join(_shown(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{len(names)} {key} ({shown})")
    return "; ".join(parts) or "no file changed"


def record(snap: Snapshot, run_dirs: Sequence[str | Path], previous: Code | None) -> list[str]:
    """After `take`: the uncommitted changes beside the copy, the "snapshot" record in the run dir's events
    (what status shows by attempt), and the lines submit says: the snapshot, its notes, and what changed
    since the snapshot the run dir had before (a resubmission to fix a bug and go on)."""
    from hpc_ddp.common.events import JsonLines
    from hpc_ddp.common.rundir import RunDir

    patch = write_patch(snap)
    lines = [snap.describe()] + [f"code: note: {n}" for n in snap.listing.notes]
    entry: dict[str, Any] = {"event": "snapshot", "code": snap.id, "dir": snap.dir, "project": snap.listing.project,
                             "files": len(snap.listing.files), "bytes": snap.listing.size,
                             "git": snap.listing.git.to_json() if snap.listing.git else None,
                             "patch": patch, "notes": list(snap.listing.notes)}
    if previous is not None:
        entry["previous"] = previous.id
        if previous.id == snap.id:
            lines.append(f"code: the same as the run dir's last snapshot ({previous.id})")
        else:
            diff = changes(manifest_of(Path(previous.dir).parent, previous.id), snap)
            entry["changes"] = {k: v[:50] for k, v in diff.items()} if diff else None
            said = describe_changes(diff) if diff else "its manifest is gone: what changed is not known"
            before = _last_commit(RunDir(run_dirs[0]).events, previous.id)
            after = snap.listing.git.commit if snap.listing.git else None
            commits = f", commit {(before or 'none')[:12]} -> {(after or 'none')[:12]}" if before or after else ""
            lines.append(f"code: a new snapshot for this run dir, replacing {previous.id}{commits}: {said}; the "
                         "run resumes from its checkpoint with the new code")
    for run_dir in run_dirs:  # a sweep's tasks each get the record
        Path(run_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        JsonLines(RunDir(run_dir).events).write(entry)
    return lines


def _last_commit(events_path: Path, snapshot_id: str) -> str | None:
    from hpc_ddp.common.events import read_jsonl

    for event in reversed(read_jsonl(events_path)):
        if event.get("event") == "snapshot" and event.get("code") == snapshot_id:
            return (event.get("git") or {}).get("commit")
    return None
