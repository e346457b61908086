"""Which files make the project a snapshot copies (see snapshot.py for the copy itself):
  - in a git repo (the script's): the tracked files and the untracked files git does not ignore;
  - elsewhere: the script's folder, walked.
Left out, and seen live through a link in the copy (so `Path(__file__).parent / "data"` still finds the
data, and outputs written there still land in the working tree): what git ignores, and among untracked files
virtual environments, run dirs, caches, logs, data and weights folders (`LEFT_OUT`), and the user's
`snapshot_exclude` patterns. `__pycache__` and `*.pyc` are dropped. Symbolic links stay links: one out of the
project is named in a note (it is not pinned); nothing is ever read through one. FIFOs, sockets and devices
are skipped with a note; an unreadable file is left out as a link (the ranks could not read it either). A
project over `snapshot_max_mb` is refused in one line that names its biggest folders, never copied
(`check_limits`).

Reads names and metadata only: no file's content.
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.rundir import CHECKPOINTS, CODE, EVENTS, SCRIPT, SPEC, SUBMISSIONS, SWEEP
from hpc_ddp.common.units import MB, human_bytes
from hpc_ddp.snapshot.gitinfo import MAX_LISTED, Git, GitError, GitState
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["Item", "Listing", "LEFT_OUT", "MAX_FILES", "MAX_LINKS", "MAX_DEPTH", "project_root", "list_project",
           "check_limits", "parents"]

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


def parents(rel: str) -> Iterator[str]:
    """'a', 'a/b', 'a/b/c' for 'a/b/c': the folders on the way to `rel`, and `rel`."""
    parts = rel.split("/")
    for depth in range(1, len(parts) + 1):
        yield "/".join(parts[:depth])


def _shown(name: str | None) -> str:
    """A file name as one line can hold it: quoted where it has a newline, a control character or a
    byte that is not UTF-8."""
    text = str(name)
    return text if text.isprintable() and not any(0xDC80 <= ord(c) <= 0xDCFF for c in text) else repr(text)
