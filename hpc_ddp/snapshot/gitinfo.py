"""What git says about the user's project, for its snapshot: the repo's root, which files it holds
(tracked, and untracked but not ignored), what it ignores, and the commit, branch and uncommitted changes.

Only read-only git commands, run with the user's git but none of the repo's programs: no fsmonitor hook,
no external diff or textconv driver, no pager; and none of the shell's GIT_DIR/GIT_WORK_TREE/GIT_INDEX_FILE,
which would point the commands at another repo. git opens its rule files (.gitignore, .gitattributes,
info/exclude, core.excludesFile...) as they are: one that is a FIFO or a device would make it wait forever,
so `check_inputs` refuses those first. Those it cannot know of beforehand (a file an include.path of the
configuration names, a .gitignore in an untracked folder) are caught as git opens them: every git command
is watched while it runs, and one that waits to open a FIFO is ended at once (`GitWaits`, one line naming
the FIFO where it can be found); any other is ended after HPC_DDP_GIT_TIMEOUT_S (default 120 s). Either is
a refusal, never a fallback to walking the folder (which would copy what git ignores). `Git.run` is the
one edge; tests fake it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpc_ddp.common.errors import UserError

__all__ = ["Git", "GitState", "GitError", "GitWaits"]

# The repo's own configuration may name programs to run (core.fsmonitor, diff drivers): not from here.
_SAFE = ("--no-pager", "-c", "core.fsmonitor=false", "-c", "core.untrackedCache=false")
# Variables that would make git read another repo, index or configuration than the project's own.
_REPO_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
                   "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES", "GIT_DISCOVERY_ACROSS_FILESYSTEM",
                   "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT",
                   "GIT_EXTERNAL_DIFF", "GIT_PAGER", "GIT_TRACE", "GIT_TRACE2", "GIT_TRACE2_EVENT")
MAX_LISTED = 50  # changed and untracked files named in the record (the diff and the copy hold all of them)


class GitError(Exception):
    """git failed where it should not have (not: the folder is no repo)."""


class GitWaits(UserError):
    """git waits on something that does not answer (a FIFO it opens, or past its bound): the snapshot is
    refused, never made another way."""


GIT_S = 120.0   # the bound of one git command (HPC_DDP_GIT_TIMEOUT_S overrides)
# What /proc/PID/wchan says of a process blocked opening a FIFO that has no writer (Linux).
_FIFO_WAITS = ("wait_for_partner", "fifo_open")


@dataclasses.dataclass(frozen=True)
class GitState:
    commit: str | None          # None: a repo with no commits yet
    branch: str | None          # None: a detached HEAD
    dirty: bool                 # uncommitted changes to tracked files, or untracked files
    changed: tuple[str, ...]    # tracked files that differ from the commit (at most MAX_LISTED)
    untracked: tuple[str, ...]  # untracked files, not ignored (at most MAX_LISTED)
    patch: bytes                # `git diff --binary HEAD`: the changes to tracked files; b"" when none

    def describe(self) -> str:
        head = f"commit {self.commit[:12]}" if self.commit else "no commits yet"
        if self.commit and self.branch:
            head += f" on {self.branch}"
        if not self.dirty:
            return f"git {head}, clean"
        parts = [f"{len(self.changed)}{'+' if len(self.changed) >= MAX_LISTED else ''} changed"] if self.changed else []
        if self.untracked:
            parts.append(f"{len(self.untracked)}{'+' if len(self.untracked) >= MAX_LISTED else ''} untracked")
        return f"git {head} + uncommitted changes ({', '.join(parts) or 'staged'})"

    def to_json(self) -> dict:
        return {"commit": self.commit, "branch": self.branch, "dirty": self.dirty, "changed": list(self.changed),
                "untracked": list(self.untracked)}


Runner = Callable[[list[str], str], "subprocess.CompletedProcess[bytes]"]


def _subprocess(argv: list[str], cwd: str) -> "subprocess.CompletedProcess[bytes]":
    """One git command, watched while it runs: ended at once where it waits to open a FIFO, and after
    `git_bound()` seconds in any case; either is a GitWaits."""
    env = {k: v for k, v in os.environ.items() if k not in _REPO_VARIABLES}
    env["GIT_OPTIONAL_LOCKS"] = "0"  # reading must not take the index lock another git holds
    bound = git_bound()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline, wait = time.monotonic() + bound, 0.002
    with proc:
        while True:
            try:
                out, err = proc.communicate(timeout=wait)
                return subprocess.CompletedProcess(argv, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                pass
            on_fifo = _waits_on_fifo(proc.pid)
            if on_fifo or time.monotonic() > deadline:
                proc.kill()
                proc.communicate()
                what = " ".join(a for a in argv[len(_SAFE) + 1:] if not a.startswith("-"))[:60]
                if on_fifo:
                    found = _fifo_named(cwd)
                    raise GitWaits(f"git {what} waits to open {_shown(found) if found else 'a FIFO'}, a FIFO where git "
                                   "reads its rules or configuration: nothing was copied",
                                   hint="remove the FIFO (or the include.path that names it)")
                raise GitWaits(f"git {what} did not finish within {bound:g} s in {_shown(cwd)}: nothing was copied",
                               hint="find what it waits on (GIT_TRACE=1 git status), or raise HPC_DDP_GIT_TIMEOUT_S")
            wait = min(wait * 2, 0.05)


def git_bound() -> float:
    """The bound of one git command: HPC_DDP_GIT_TIMEOUT_S seconds, default GIT_S."""
    raw = os.environ.get("HPC_DDP_GIT_TIMEOUT_S")
    try:
        value = float(raw) if raw else GIT_S
        if not 0 < value < 1e7:
            raise ValueError
    except ValueError:
        raise UserError(f"HPC_DDP_GIT_TIMEOUT_S={raw!r} is not a number of seconds",
                        hint="give a positive number, e.g. HPC_DDP_GIT_TIMEOUT_S=120") from None
    return value


def _waits_on_fifo(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/wchan", "rb") as fh:
            return fh.read(64).decode(errors="replace").strip() in _FIFO_WAITS
    except OSError:  # not Linux, or gone: the bound still holds
        return False


def _fifo_named(cwd: str, budget_s: float = 2.0) -> str | None:
    """The FIFO git waits on, where it can be told within `budget_s`: a file an include.path of the repo's
    or the user's configuration names, or a .gitignore/.gitattributes under `cwd`."""
    home = os.path.expanduser("~")
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    for config in (os.path.join(cwd, ".git", "config"), os.path.join(home, ".gitconfig"),
                   os.path.join(config_home, "git", "config")):
        try:
            if not stat.S_ISREG(os.stat(config).st_mode):
                continue
            with open(config, "rb") as fh:
                text = fh.read(1 << 20).decode(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            key, eq, value = line.strip().partition("=")
            if eq and key.strip().lower() == "path":
                value = value.strip().strip('"')
                path = os.path.join(os.path.dirname(config), os.path.expanduser(value))
                if _is_fifo(path):
                    return path
    deadline = time.monotonic() + budget_s
    for folder, dirs, files in os.walk(cwd):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in (".gitignore", ".gitattributes"):
            if name in files and _is_fifo(os.path.join(folder, name)):
                return os.path.join(folder, name)
        if time.monotonic() > deadline:
            break
    return None


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _shown(path: str) -> str:
    return path if path.isprintable() else repr(path)


class Git:
    """git for one folder's repo. `run(argv, cwd)` runs one git command line (tests pass a fake)."""

    def __init__(self, run: Runner | None = None, executable: str | None = None) -> None:
        self._run = run or _subprocess
        self.executable = executable if executable is not None else (shutil.which("git") or "")
        self._toplevels: dict[str, Path | None] = {}

    @property
    def available(self) -> bool:
        return bool(self.executable)

    def _git(self, cwd: str | Path, *args: str, ok: tuple[int, ...] = (0,)) -> "subprocess.CompletedProcess[bytes]":
        try:
            done = self._run([self.executable, *_SAFE, *args], str(cwd))
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GitError(f"git {args[0]} failed: {exc}") from None
        if done.returncode not in ok:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise GitError(f"git {args[0]} failed: {said[-1] if said else f'exit code {done.returncode}'}")
        return done

    def _all(self, cwd: str | Path, commands: Sequence[tuple[tuple[str, ...], tuple[int, ...]]]
             ) -> list["subprocess.CompletedProcess[bytes]"]:
        """Several independent git commands (args, ok exit codes), run at the same time; their results in
        order, or the first one's GitError. Each is a few milliseconds of starting git: together they cost
        about one."""
        if len(commands) == 1:
            return [self._git(cwd, *commands[0][0], ok=commands[0][1])]
        with ThreadPoolExecutor(len(commands)) as pool:
            futures = [pool.submit(self._git, cwd, *args, ok=ok) for args, ok in commands]
            return [f.result() for f in futures]

    def toplevel(self, folder: str | Path) -> Path | None:
        """The root of the repo `folder` is in; None where it is in none (or git is not installed).
        Asked once per folder (plan and list_project both ask)."""
        if not self.available:
            return None
        key = os.path.abspath(folder)
        if key not in self._toplevels:
            self._toplevels[key] = self._toplevel(folder)
        return self._toplevels[key]

    def _toplevel(self, folder: str | Path) -> Path | None:
        done = self._git(folder, "rev-parse", "--show-toplevel", ok=(0, 128))
        out = done.stdout.decode(errors="surrogateescape").rstrip("\n")
        if done.returncode == 128 and b"not a git repository" not in done.stderr:
            # a repo git refuses to read (another user's: "dubious ownership"): not "no repo"
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise GitError(f"git refuses the repo: {said[0] if said else 'exit code 128'}")
        return Path(out) if done.returncode == 0 and out else None

    def files(self, root: Path, *, untracked_only: bool = False) -> list[str]:
        """Tracked files and untracked files that are not ignored (relative, '/'-separated); with
        `untracked_only`, the untracked ones alone. Submodules are listed as their folder."""
        which = ["--others"] if untracked_only else ["--cached", "--others"]
        return _split(self._git(root, "ls-files", "-z", *which, "--exclude-standard").stdout)

    def check_inputs(self, root: Path) -> list[str]:
        """The tracked files (`git ls-files --cached`, which reads no rule file), once every file git reads
        its rules from for them is checked: the repo's info/exclude and info/attributes, the configured and
        default excludesFile and attributesFile, and .gitignore and .gitattributes in the root and in every
        folder of a tracked file. One that is a FIFO is a GitError: git would wait on it forever (a device
        or a folder there git reads as empty, or skips)."""
        done = self._all(root, [(("ls-files", "-z", "--cached"), (0,)),
                                (("rev-parse", "--git-common-dir"), (0,)),
                                (("config", "-z", "--path", "--get-regexp", r"^core\.(excludesfile|attributesfile)$"),
                                 (0, 1))])
        tracked = _split(done[0].stdout)
        common = os.path.join(root, done[1].stdout.decode(errors="surrogateescape").rstrip("\n"))  # relative to root
        configured = [entry.split("\n", 1)[1] for entry in _split(done[2].stdout) if "\n" in entry]
        config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        paths = [os.path.join(common, "info", "exclude"), os.path.join(common, "info", "attributes"),
                 os.path.join(common, "index"), *configured,
                 os.path.join(config_home, "git", "ignore"), os.path.join(config_home, "git", "attributes")]
        for folder in sorted({rel.rpartition("/")[0] for rel in tracked} | {""}):
            base = os.path.join(root, folder) if folder else str(root)
            paths += [os.path.join(base, ".gitignore"), os.path.join(base, ".gitattributes")]
        for path in paths:
            try:
                fifo = stat.S_ISFIFO(os.stat(path).st_mode)  # through a link: git follows the configured ones
            except (OSError, ValueError):
                continue
            if fifo:
                raise GitError(f"git would wait forever on {path if path.isprintable() else repr(path)}, a FIFO where "
                               "git reads its rules")
        return tracked

    def listing(self, root: Path, tracked: list[str] | None = None) -> tuple[list[str], list[str], list[str]]:
        """(tracked, untracked and not ignored, ignored) of the repo at `root`, as `files` and `ignored` say,
        asked at the same time (`tracked`: as check_inputs gave it, not asked again)."""
        base = ("ls-files", "-z")
        others = [((*base, "--others", "--exclude-standard"), (0,)),
                  ((*base, "--others", "--ignored", "--exclude-standard", "--directory"), (0,))]
        if tracked is not None:
            done = self._all(root, others)
            return tracked, _split(done[0].stdout), _split(done[1].stdout)
        done = self._all(root, [((*base, "--cached"), (0,)), *others])
        return _split(done[0].stdout), _split(done[1].stdout), _split(done[2].stdout)

    def ignored(self, root: Path) -> list[str]:
        """What the repo ignores, a whole ignored folder as one entry ending in '/'."""
        return _split(self._git(root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                                "--directory").stdout)

    def state(self, root: Path, untracked: list[str]) -> GitState:
        """The commit, branch and uncommitted changes; `untracked` (the untracked files the snapshot copies)
        is recorded as given. In two rounds of commands run together."""
        done = self._all(root, [(("rev-parse", "--verify", "-q", "HEAD"), (0, 1)),
                                (("symbolic-ref", "-q", "--short", "HEAD"), (0, 1)),
                                (("config", "--name-only", "--get-regexp", r"^filter\."), (0, 1))])
        head = done[0].stdout.decode().strip() or None
        branch = done[1].stdout.decode(errors="replace").strip() or None if done[1].returncode == 0 else None
        if head is None:
            changed = _split(self._git(root, "ls-files", "-z", "--cached").stdout)
            patch = b""
        else:
            # comparing the working tree runs the repo's clean filters (.gitattributes filter=NAME): none of them
            off = _filters_off(done[2].stdout)
            diffs = self._all(root, [((*off, "diff", "--name-only", "-z", "--no-ext-diff", "HEAD"), (0,)),
                                     ((*off, "diff", "--binary", "--no-ext-diff", "--no-textconv", "HEAD"), (0,))])
            changed = _split(diffs[0].stdout)
            patch = diffs[1].stdout if changed else b""
        return GitState(head, branch, bool(changed or untracked), tuple(changed[:MAX_LISTED]),
                        tuple(untracked[:MAX_LISTED]), patch)


def _filters_off(config: bytes) -> list[str]:
    """`-c` options that turn off every filter driver the configuration names (a program it would run),
    from `git config --name-only --get-regexp '^filter\\.'`."""
    names = {line.rsplit(".", 1)[0] for line in config.decode(errors="replace").split()}
    return [w for name in sorted(names) for key in ("clean", "smudge", "process")
            for w in ("-c", f"{name}.{key}=")] + [w for name in sorted(names) for w in ("-c", f"{name}.required=false")]


def _split(out: bytes) -> list[str]:
    return [p for p in out.decode(errors="surrogateescape").split("\0") if p]
