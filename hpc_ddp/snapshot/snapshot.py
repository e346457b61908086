"""The snapshot of the user's project that submit takes, so that every attempt runs the code as submitted.

Which files make the project:
  - in a git repo (the script's): the tracked files and the untracked files git does not ignore;
  - elsewhere: the script's folder, walked.
Left out, and seen live through a link in the copy (so `Path(__file__).parent / "data"` still finds the
data, and outputs written there still land in the working tree): what git ignores, and among untracked files
virtual environments, run dirs, caches, logs, data and weights folders (`LEFT_OUT`), and the user's
`snapshot_exclude` patterns. `__pycache__` and `*.pyc` are dropped. Symbolic links stay links: one out of the
project is named in a note (it is not pinned); nothing is ever read through one. FIFOs, sockets and devices
are skipped with a note; an unreadable file is left out as a link (the ranks could not read it either). A project over `snapshot_max_mb` is refused in one
line that names its biggest folders, never copied.

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
import errno
import fnmatch
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import NotRegularFile, TooLarge, read_regular
from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.common.rundir import CHECKPOINTS, CODE, EVENTS, SCRIPT, SPEC, SUBMISSIONS, SWEEP
from hpc_ddp.common.units import MB, human_bytes
from hpc_ddp.snapshot.gitinfo import MAX_LISTED, Git, GitError, GitState
from hpc_ddp.spec.code import Code
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["Item", "Listing", "Snapshot", "LEFT_OUT", "project_root", "list_project", "check_limits", "plan", "hashed",
           "take", "changes", "manifest_of", "parents", "CODE_DIR"]

CODE_DIR = CODE
# A folder with spec.json and one of these is an hpc-ddp run dir (a rendered one has no submissions yet).
_RUN_DIR_FILES = (SUBMISSIONS, EVENTS, SCRIPT, CODE)
# Folders of an untracked tree (or of a project outside git) that are not code: kept out of the copy and
# reached through a link instead. Tracked files are always copied unless snapshot_exclude names them.
LEFT_OUT = frozenset({
    ".git", ".hg", ".svn", ".venv", "venv", ".conda", ".tox", ".nox", ".mypy_cache", ".pytest_cache",
    ".ruff_cache", ".ipynb_checkpoints", "node_modules", "runs", "wandb", "lightning_logs", "mlruns", "outputs",
    "multirun", CHECKPOINTS, "data", "datasets", ".cache", "build", "dist",
})
LEFT_OUT_FILES = ("*.pt", "*.pth", "*.ckpt", "*.safetensors", "*.npz", "*.h5", "*.hdf5", "*.tar", "*.tar.gz",
                  "*.zip", "*.egg-info")
DROPPED = ("__pycache__", "*.pyc", "*.pyo")
MAX_FILES = 100_000
MAX_LINKS = 2_000
# Folders nested deeper than this are refused: no project's code is, and a deeper tree would take the walk,
# the rule's cache and the copy past Python's recursion limit (an internal error instead of a line).
MAX_DEPTH = 200
_STOPPED = "the walk stopped early: the folder holds more than a snapshot may"


@dataclasses.dataclass(frozen=True)
class Item:
    """One entry of the copy. kind "file": copied (`size`, `executable`); "link": a symbolic link of the
    project, recreated with `target`; "live": left out, a link to the working tree's `target`."""

    rel: str
    kind: str
    size: int = 0
    executable: bool = False
    target: str = ""


@dataclasses.dataclass(frozen=True)
class Listing:
    project: str                     # the project's root, resolved
    items: tuple[Item, ...]
    notes: tuple[str, ...] = ()      # links out of the project, special files skipped, links not made
    git: GitState | None = None
    git_error: str | None = None     # git was there but failed: the project was walked instead
    origin: str | None = None        # shipped from a laptop (submit --ssh): the project's path there

    @property
    def files(self) -> list[Item]:
        return [i for i in self.items if i.kind == "file"]

    @property
    def size(self) -> int:
        return sum(i.size for i in self.files)


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


# ----------------------------------------------------------------------------------------------- listing


def project_root(spec: JobSpec, git: Git) -> tuple[Path, str | None] | None:
    """(the project's root, the script relative to it) for a script or a module found in the working
    directory; None for the built-in trainer and for a module that is not the user's (an installed one)."""
    if spec.target.kind == "script":
        script = Path(os.path.realpath(spec.target.value))
        root = _git_root(script.parent, git)
        if root is None or not script.is_relative_to(root):  # a repo whose core.worktree is elsewhere
            root = script.parent
        return root, script.relative_to(root).as_posix()
    if spec.target.kind == "module":
        workdir = Path(os.path.realpath(spec.workdir))
        top = spec.target.value.split(".")[0]
        if not ((workdir / top).is_dir() or (workdir / f"{top}.py").is_file()):
            return None
        root = _git_root(workdir, git)
        return (root if root is not None and workdir.is_relative_to(root) else workdir), None
    return None


def _git_root(folder: Path, git: Git) -> Path | None:
    try:
        top = git.toplevel(folder)
    except GitError:
        return None
    return Path(os.path.realpath(top)) if top else None


def list_project(root: Path, excludes: Sequence[str] = (), git: Git | None = None,
                 max_bytes: int | None = None, script: str | None = None) -> Listing:
    """Every file and link the copy of `root` will hold. Reads names and metadata only; a walk stops once
    it passed `max_bytes` (check_limits then refuses)."""
    root = Path(os.path.realpath(root))
    git = git or Git()
    rule = _Rule(root, excludes)
    error = None
    try:
        top = git.toplevel(root)
        if top is not None and Path(os.path.realpath(top)) == root:
            return _with_script(_from_git(root, git, rule), script)
    except GitError as exc:
        error = str(exc)
    items, notes = _walk(root, rule, max_bytes)
    return _with_script(Listing(str(root), tuple(items), tuple(notes), None, error), script)


def _with_script(listing: Listing, script: str | None) -> Listing:
    """The submitted script is always copied, even where git ignores it or it sits in a left-out folder:
    it is the code the run is about. Said in a note."""
    if script is None or any(i.rel == script and i.kind == "file" for i in listing.items):
        return listing
    root = Path(listing.project)
    notes = list(listing.notes)
    item = _item(root, script, notes)
    if item is None or item.kind != "file":
        return dataclasses.replace(listing, notes=tuple(notes))
    covering = [i for i in listing.items if i.kind == "live" and (script == i.rel or script.startswith(i.rel + "/"))]
    items = [i for i in listing.items if i not in covering]
    for cover in covering:  # the left-out folder around it: its other entries are linked one by one (at most
        if cover.rel != script:  # MAX_LINKS of them: a scratch folder of 100,000 files is not 100,000 links)
            items += _live_items(root, [f"{cover.rel}/{n}" for n in os.listdir(root / cover.rel)
                                        if f"{cover.rel}/{n}" != script and not script.startswith(f"{cover.rel}/{n}/")],
                                 set(), notes)
    notes.append(f"{_shown(script)} is left out by git or the snapshot's rules, but it is the script you submit: "
                 "copied anyway")
    return dataclasses.replace(listing, items=tuple(sorted([*items, item], key=_order)), notes=tuple(notes))


def _matcher(patterns: Iterable[str]):
    """One compiled test for "matches any of these fnmatch patterns" (case-sensitive, as fnmatchcase)."""
    patterns = list(patterns)
    if not patterns:
        return lambda _name: None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


class _Rule:
    """What is left out: the user's patterns (anything), then, for untracked files, LEFT_OUT."""

    def __init__(self, root: Path, excludes: Sequence[str]) -> None:
        self.root, self.excludes = root, tuple(excludes)
        self._root = str(root)
        self._dropped = _matcher(DROPPED)
        self._by_name = _matcher(p for p in self.excludes if "/" not in p)
        self._by_path = _matcher(p for p in self.excludes if "/" in p)
        self._not_code_file = _matcher(LEFT_OUT_FILES)
        self._dirs: dict[tuple[bool, str], str | None] = {}

    def dropped(self, rel: str) -> bool:
        return self._dropped(rel.rpartition("/")[2]) is not None

    def asked(self, rel: str) -> bool:
        return self._by_name(rel.rpartition("/")[2]) is not None or self._by_path(rel) is not None

    def not_code_dir(self, rel: str) -> bool:
        name = rel.rpartition("/")[2]
        path = f"{self._root}/{rel}"
        return (name in LEFT_OUT or name.endswith(".egg-info") or os.path.lexists(f"{path}/pyvenv.cfg")
                or os.path.lexists(f"{path}/conda-meta")
                or os.path.lexists(f"{path}/{SWEEP}")
                or (os.path.lexists(f"{path}/{SPEC}") and any(os.path.lexists(f"{path}/{n}") for n in _RUN_DIR_FILES)))

    def not_code_file(self, rel: str) -> bool:
        return self._not_code_file(rel.rpartition("/")[2]) is not None

    def left_out_above(self, rel: str, untracked: bool) -> str | None:
        """The folder above `rel` (or `rel` itself) that is left out, as the link that stands for it."""
        folder = rel.rpartition("/")[0]
        if folder:
            out = self._folder(folder, untracked)
            if out is not None:
                return out
        if self.dropped(rel) or self.asked(rel) or (untracked and self.not_code_file(rel)):
            return rel
        return None

    def _folder(self, folder: str, untracked: bool) -> str | None:
        """The left-out folder at or above `folder`, asked once per folder (from the top down, no recursion)."""
        key = (untracked, folder)
        if key in self._dirs:
            return self._dirs[key]
        out = None
        for path in parents(folder):
            cached = self._dirs.get((untracked, path), False)
            if cached is not False:
                out = cached
                continue
            if out is None and (self.dropped(path) or self.asked(path) or (untracked and self.not_code_dir(path))):
                out = path
            self._dirs[(untracked, path)] = out
        return out


def _too_deep(root: Path, rel: str) -> UserError:
    return UserError(f"the project {_shown(str(root))} nests folders deeper than {MAX_DEPTH} levels "
                     f"({_shown('/'.join(rel.split('/')[:3]))}/...)",
                     hint="leave that folder out (--snapshot-exclude NAME), or run the working tree as it is "
                          "(--no-snapshot)")


def _from_git(root: Path, git: Git, rule: _Rule) -> Listing:
    known = git.check_inputs(root)  # no FIFO where git reads its rules: it would wait on it forever
    with ThreadPoolExecutor(1) as pool:
        # the commit, branch and diff are git's work alone: asked while the files are looked at here
        state_of = pool.submit(git.state, root, [])
        tracked, untracked_list, ignored = git.listing(root, known)
        untracked = set(untracked_list)
        listed = sorted({*tracked, *untracked_list})
        items: dict[str, Item] = {}
        live: dict[str, list[str]] = {}   # a left-out folder (or file) -> the listed files it stands for
        notes: list[str] = []
        inner_ignored: list[str] = []
        for rel, is_untracked, st in _with_submodules(root, git, listed, untracked, notes, inner_ignored):
            out = rule.left_out_above(rel, is_untracked)
            if out is not None:
                if not rule.dropped(out):
                    live.setdefault(out, []).append(rel)
                continue
            if rel.count("/") >= MAX_DEPTH:
                raise _too_deep(root, rel)
            item = _item(root, rel, notes, st)
            if item is not None and item.kind == "live":
                live.setdefault(rel, []).append(rel)
            elif item is not None:
                items[rel] = item
        folders = {p for folder in {rel.rpartition("/")[0] for rel in items} for p in parents(folder) if p}
        links: set[str] = set()
        for out, under in live.items():
            # a left-out folder that also holds copied files (tracked ones) is a folder of the copy: its
            # left-out files get a link each instead
            links.update(under if out in folders else [out])
        for rel in [*ignored, *inner_ignored]:
            rel = rel.rstrip("/")
            if rel and rel not in folders and not rule.dropped(rel) and not any(rel.startswith(p + "/") for p in links):
                links.add(rel)
        # untracked files the copy holds (not those left out): with the commit and the diff, they are the code
        copied_untracked = sorted(r for r in untracked if r in items)
        try:
            state = state_of.result()
            state = dataclasses.replace(state, dirty=state.dirty or bool(copied_untracked),
                                        untracked=tuple(copied_untracked[:MAX_LISTED]))
        except GitError as exc:  # a tracked path that is now a FIFO or unreadable: the listing stands
            notes.append(f"the uncommitted changes are not known ({exc}); the copy holds them all the same")
            state = GitState(None, None, True, (), tuple(copied_untracked[:MAX_LISTED]), b"")
    return Listing(str(root), tuple(sorted([*items.values(), *_live_items(root, links, set(items), notes)],
                                           key=_order)), tuple(notes), state)


def _with_submodules(root: Path, git: Git, listed: list[str], untracked: set[str], notes: list[str],
                     ignored: list[str]) -> Iterator[tuple[str, bool, os.stat_result | None]]:
    """git's list (with each entry's lstat; None: gone since), with a submodule's (a folder in the list)
    or an untracked nested repo's ('vendor/') own files in its place; what such a repo ignores goes into
    `ignored`."""
    base = str(root)
    for listed_rel in listed:
        rel = listed_rel.rstrip("/")
        path = f"{base}/{rel}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # tracked but deleted in the working tree: the copy is the working tree
        except OSError as exc:
            raise _unreadable(root, rel, exc) from None
        if stat.S_ISDIR(st.st_mode):
            if not os.path.lexists(f"{path}/.git"):
                continue  # a submodule never checked out: an empty folder
            try:
                git.check_inputs(Path(path))  # its own .gitignore may be a FIFO too
                inner = git.files(Path(path))
                inner_untracked = set(git.files(Path(path), untracked_only=True))
                ignored.extend(f"{rel}/{sub}" for sub in git.ignored(Path(path)))
            except GitError as exc:
                notes.append(f"submodule {_shown(rel)} skipped: {exc}")
                continue
            nested = listed_rel in untracked  # a clone inside the project: all of it untracked here
            yield from ((f"{rel}/{sub}", nested or sub in inner_untracked, None) for sub in inner)
        else:
            yield rel, rel in untracked, st


def _walk(root: Path, rule: _Rule, max_bytes: int | None) -> tuple[list[Item], list[str]]:
    """The project's folder, walked. Stops once it holds more than a snapshot may (a script in a home
    folder, outside any repo, must not have the whole home folder listed before the refusal)."""
    items: list[Item] = []
    live: set[str] = set()
    notes: list[str] = []
    size = 0

    def unreadable(exc: OSError) -> None:
        rel = os.path.relpath(exc.filename, root).replace(os.sep, "/")
        if exc.errno == errno.ENAMETOOLONG:  # no link can name it either: the system refuses its path
            notes.append(f"{_shown(rel[:60])}... left out: its path is longer than the system allows")
            return
        notes.append(f"{_shown(rel)} left out: it cannot be read ({exc.strerror}), by the ranks either")
        live.add(rel)

    for folder, dirs, files in os.walk(root, onerror=unreadable):
        base = os.path.relpath(folder, root)
        base = "" if base == "." else base.replace(os.sep, "/") + "/"
        kept = []
        for name in sorted(dirs):
            rel = base + name
            if name == ".git" or rule.dropped(rel):
                continue
            if os.path.islink(os.path.join(folder, name)):
                files.append(name)  # a link to a folder is a link: recreated, never followed
            elif rule.asked(rel) or rule.not_code_dir(rel) or name.startswith("."):
                live.add(rel)
            elif rel.count("/") >= MAX_DEPTH:
                raise _too_deep(root, rel)
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            rel = base + name
            if name == ".git" or rule.dropped(rel):
                continue
            if rule.asked(rel) or rule.not_code_file(rel):
                live.add(rel)
                continue
            item = _item(root, rel, notes)
            if item is not None and item.kind == "live":
                live.add(rel)
            elif item is not None:
                items.append(item)
                size += item.size
                if len(items) > MAX_FILES or (max_bytes is not None and size > max_bytes):
                    notes.append(_STOPPED)
                    break
        if _STOPPED in notes:
            break
    names = {i.rel for i in items}
    return sorted([*items, *_live_items(root, live, names, notes)], key=_order), notes


def _item(root: Path, rel: str, notes: list[str], st: os.stat_result | None = None) -> Item | None:
    """The entry for `rel`, from its lstat (`st`, where the caller made it already)."""
    path = f"{root}/{rel}"
    if st is None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None  # tracked but deleted in the working tree: the copy is the working tree
        except OSError as exc:
            raise _unreadable(root, rel, exc) from None
    if stat.S_ISREG(st.st_mode):
        if not _readable(path, st):
            notes.append(f"{_shown(rel)} left out: it cannot be read (permission denied), by the ranks either")
            return Item(rel, "live", target=path)
        return Item(rel, "file", st.st_size, bool(st.st_mode & 0o111))
    if stat.S_ISLNK(st.st_mode):
        return _link(root, rel, notes)
    kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else \
        "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a file"
    notes.append(f"{_shown(rel)} skipped: {kind}, not code")
    return None


_UID = os.getuid()


def _readable(path: str, st: os.stat_result) -> bool:
    """Whether we may read the file: its owner (we, mostly) by its mode bits alone, with no system call;
    anyone else as the kernel says (groups, ACLs)."""
    if st.st_uid == _UID and st.st_mode & stat.S_IRUSR:
        return True
    return os.access(path, os.R_OK)


def _unreadable(root: Path, rel: str, exc: OSError) -> UserError:
    return UserError(f"cannot read {_shown(rel)} in the project {root}: {exc.strerror}",
                     hint="fix its permissions, or leave it out of the snapshot (--snapshot-exclude NAME)")


def _link(root: Path, rel: str, notes: list[str]) -> Item:
    """A symbolic link of the project, as the copy recreates it: one that stays in the project keeps
    pointing there (relative, so into the copy); one that leaves it points at the same place, by its
    absolute path, and is named in a note: what it reaches is not pinned. Never followed."""
    path = root / rel
    target = os.readlink(path)
    # where it really leads: through any other link on the way (names only; nothing is read)
    where = os.path.realpath(os.path.join(os.path.realpath(path.parent), target))
    if where == str(root) or where.startswith(str(root) + os.sep):
        lexical = os.path.normpath(os.path.join(path.parent, target))
        stays = lexical == os.path.realpath(lexical) or not os.path.isabs(target) and lexical == where
        return Item(rel, "link", target=target if stays and not os.path.isabs(target)
                    else os.path.relpath(where, path.parent))
    notes.append(f"{_shown(rel)} links out of the project (to {_shown(where)}): the run sees it live, not pinned")
    return Item(rel, "link", target=where)


def _live_items(root: Path, live: Iterable[str], copied: set[str], notes: list[str]) -> list[Item]:
    chosen = sorted(r for r in live if r not in copied)
    if len(chosen) > MAX_LINKS:
        notes.append(f"{len(chosen) - MAX_LINKS} more left-out entries have no link in the copy")
        chosen = chosen[:MAX_LINKS]
    return [Item(rel, "live", target=str(root / rel)) for rel in chosen]


def _order(item: Item) -> list[str]:
    return item.rel.split("/")


# ------------------------------------------------------------------------------------------------ limits


def check_limits(listing: Listing, max_mb: int) -> None:
    """Refuse a project too big to copy onto the shared filesystem at every submit, before a byte is read."""
    files, size = listing.files, listing.size
    if size <= max_mb * MB and len(files) <= MAX_FILES and _STOPPED not in listing.notes:
        return
    more = "more than " if _STOPPED in listing.notes else ""
    tops: dict[str, int] = {}
    for item in files:
        top = item.rel.split("/")[0] + ("/" if "/" in item.rel else "")
        tops[top] = tops.get(top, 0) + item.size
    biggest = ", ".join(f"{_shown(name)} {human_bytes(n)}" for name, n in sorted(tops.items(), key=lambda t: -t[1])[:3])
    over = (f"{more}{len(files):,} files, more than the {MAX_FILES:,} a snapshot holds" if len(files) > MAX_FILES
            else f"{more}{human_bytes(size)} in {len(files):,} files, over the snapshot limit of {max_mb} MB")
    raise UserError(f"the project {_shown(listing.project)} is {over} (biggest: {biggest})",
                    hint="leave out what is not code (--snapshot-exclude NAME, or snapshot_exclude in the job "
                         "file), raise --snapshot-max-mb, or run the working tree as it is (--no-snapshot)")


# ---------------------------------------------------------------------------------------- reading, copying


class _Folders:
    """Descriptors of a tree's folders, opened one name at a time without following a link, so that a path
    under them reaches nothing outside the tree even where a folder is swapped for a link meanwhile."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: dict[str, int] = {}

    def fd(self, rel: str) -> int:
        if rel in self._fds:
            return self._fds[rel]
        if len(self._fds) > 256:
            self.close()
        parent, _, name = rel.rpartition("/")
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        if rel:
            fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=self.fd(parent))
        else:
            fd = os.open(self.root, flags)
        self._fds[rel] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Tree(_Folders):
    """The project's files, read through folder descriptors (`_Folders`): nothing outside the project."""

    def read(self, rel: str, limit: int | None = None) -> bytes:
        folder, _, name = rel.rpartition("/")
        try:
            return read_regular(name, dir_fd=self.fd(folder), limit=limit, listed=True)
        except TooLarge:
            raise UserError(f"{_shown(rel)} in the project {_shown(self.root)} grew past the snapshot limit while it "
                            "was read", hint="leave it out (--snapshot-exclude NAME), or raise --snapshot-max-mb") \
                from None
        except NotRegularFile:
            raise UserError(f"{_shown(rel)} in the project {self.root} changed while it was copied (it is no longer "
                            "a regular file)", hint="submit again") from None
        except OSError as exc:
            raise UserError(f"cannot read {_shown(rel)} in the project {self.root}: {exc.strerror or exc}",
                            hint="fix its permissions, or leave it out of the snapshot (--snapshot-exclude NAME)") \
                from None


def _content_id(listing: Listing, hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    for item in listing.items:
        if item.kind == "live":  # links to the working tree: where the project is, not what the code is
            continue
        detail = hashes[item.rel] if item.kind == "file" else item.target
        h.update(f"{item.kind}\0{item.rel}\0{detail}\0{'x' if item.executable else '-'}\n".encode(
            errors="surrogateescape"))
    return h.hexdigest()[:16]


class _Budget:
    """The bytes a snapshot may still read: a file that grew since it was listed (a log being written)
    cannot take the copy past the limit."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit

    def spend(self, rel: str, n: int) -> None:
        if self.left is not None:
            self.left -= n
            if self.left < 0:
                raise UserError(f"{_shown(rel)} grew past the snapshot limit while it was read",
                                hint="leave it out (--snapshot-exclude NAME), or raise --snapshot-max-mb")


def _each_file(project: str, files: Iterable[Item], budget: _Budget) -> Iterator[tuple[Item, bytes]]:
    """Each file's bytes, read once, within the budget: never copied past it."""
    tree = _Tree(project)
    try:
        for item in files:
            data = tree.read(item.rel, budget.left)
            budget.spend(item.rel, len(data))
            yield item, data
    finally:
        tree.close()


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


def _copy(listing: Listing, dest: Path, limit: int | None = None) -> dict[str, str]:
    made = {""}
    folders = _Folders(str(dest))  # made one name at a time by descriptor: a path past PATH_MAX is no error
    try:
        for item in listing.items:
            parent = item.rel.rpartition("/")[0]
            if parent not in made:
                for folder in parents(parent):
                    if folder not in made:
                        up, _, name = folder.rpartition("/")
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(name, dir_fd=folders.fd(up))
                        made.add(folder)
            if item.kind != "file":
                os.symlink(item.target, item.rel.rpartition("/")[2], dir_fd=folders.fd(parent))
    finally:
        folders.close()
    files = listing.files
    if not _can_fork() or len(files) < FORK_FROM_FILES:
        return _copy_files(listing.project, files, dest, _Budget(limit))
    # two processes, each copying half the files (the cost of a file: a few creates, then its bytes): the
    # copy is Python per file, which one interpreter's threads cannot share out (bench/README.md)
    cut = _halfway(files)
    mine, theirs = files[:cut], files[cut:]
    slack = None if limit is None else limit - sum(i.size for i in files)  # what files may grow by, in all
    budgets = (_Budget(None if slack is None else sum(i.size for i in mine) + slack // 2),
               _Budget(None if slack is None else sum(i.size for i in theirs) + slack - slack // 2))
    child = _Child.start(lambda: _copy_files(listing.project, theirs, dest, budgets[1]))
    try:
        hashes = _copy_files(listing.project, mine, dest, budgets[0])
    except BaseException:
        child.stop()
        raise
    hashes.update(child.result())
    return hashes


FORK_FROM_FILES = 1_000  # fewer files: one process (a fork costs a few milliseconds)


def _can_fork() -> bool:
    """Linux only (macOS's frameworks are not fork-safe), and only where this process has no other thread
    (one could hold a lock the child would wait on forever)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


def _halfway(files: list[Item]) -> int:
    """Where to cut `files` so both halves cost the same: a file costs its creates (~20 KB of copying)
    plus its bytes."""
    costs = [20_000 + i.size for i in files]
    half, run = sum(costs) / 2, 0
    for n, cost in enumerate(costs):
        run += cost
        if run >= half:
            return n + 1
    return len(files)


def _copy_files(project: str, files: list[Item], dest: Path, budget: _Budget) -> dict[str, str]:
    """Copy `files` of the project into `dest` (its folders made already); their sha256."""
    hashes: dict[str, str] = {}
    folders = _Folders(str(dest))  # our own new folders: created in by descriptor, not by path
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        for item, data in _each_file(project, files, budget):
            hashes[item.rel] = hashlib.sha256(data).hexdigest()
            parent, _, name = item.rel.rpartition("/")
            # read-only from the start: a traceback's file opened in an editor is the copy, and an edit there
            # would be lost
            fd = os.open(name, flags, 0o555 if item.executable else 0o444, dir_fd=folders.fd(parent))
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
    finally:
        folders.close()
    return hashes


class _Child:
    """A forked process that runs one function returning a dict of strings, and hands it (or the error it
    raised) back through a pipe. It writes nothing to the terminal and never returns into our code."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd

    @classmethod
    def start(cls, fn: Callable[[], dict[str, str]]) -> _Child:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.close(read_end)
                try:
                    answer: dict[str, Any] = {"result": fn()}
                except UserError as exc:
                    answer = {"user_error": exc.message, "hint": exc.hint}
                except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                view = memoryview(json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogateescape"))
                while view:
                    view = view[os.write(write_end, view):]
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        return cls(pid, read_end)

    def result(self) -> dict[str, str]:
        chunks = []
        try:
            while chunk := os.read(self.fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self.fd)
            os.waitpid(self.pid, 0)
        try:
            answer = json.loads(b"".join(chunks).decode("utf-8", "surrogateescape"))
        except ValueError:
            raise HpcDdpError("the snapshot's second copying process ended without an answer") from None
        if "user_error" in answer:
            raise UserError(answer["user_error"], hint=answer["hint"])
        if "error" in answer:
            raise HpcDdpError(f"the snapshot's second copying process failed: {answer['error']}")
        return answer["result"]

    def stop(self) -> None:
        """Kill it and wait for it: the half-made copy is removed next, and nothing may write into it then."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.close(self.fd)
        os.waitpid(self.pid, 0)


def parents(rel: str) -> Iterator[str]:
    """'a', 'a/b', 'a/b/c' for 'a/b/c': the folders on the way to `rel`, and `rel`."""
    parts = rel.split("/")
    for depth in range(1, len(parts) + 1):
        yield "/".join(parts[:depth])


def _remove_copy(path: Path) -> None:
    """Remove a half-made copy of ours (read-only files in writable folders: rmtree can)."""
    shutil.rmtree(path, ignore_errors=True)


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


def _shown(name: str | None) -> str:
    """A file name as one line can hold it: quoted where it has a newline, a control character or a
    byte that is not UTF-8."""
    text = str(name)
    return text if text.isprintable() and not any(0xDC80 <= ord(c) <= 0xDCFF for c in text) else repr(text)


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
