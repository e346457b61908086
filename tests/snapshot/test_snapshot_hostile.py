"""Hostile and unlucky trees for the code snapshot (snapshot.snapshot, snapshot.gitinfo, job/exitsite/hpc_ddp_code):
links out of the project, FIFOs and sockets, unreadable files, odd names, a .git that is a file, submodules
and nested repos, a repo with no commits, huge trees, run dirs inside the project, the shell's GIT_* and the
repo's own programs, files that change between plan and take, what someone else left where the copy goes,
and the ways a rank's Python finds the project. Each one is handled or refused in one line, nothing outside
the project is read into the snapshot, and hpc-ddp replaces only what it made.

Each bug this pass found was fixed; its test stays."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.common.errors import UserError
from hpc_ddp.job import runner
from hpc_ddp.job.exitsite import hpc_ddp_code
from hpc_ddp.snapshot import snapshot
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import _STOPPED, check_limits, list_project
from hpc_ddp.spec.code import parse_excludes
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

REPO = Path(__file__).resolve().parents[2]
HELP = REPO / "tests" / "spec" / "helptext"
GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main",
       "-c", "protocol.file.allow=always"]
SECRET = b"SECRET-OUTSIDE-THE-PROJECT"
NOBODY = 65534


def git(root: Path, *args: str) -> str:
    done = subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True)
    return done.stdout.decode(errors="replace")


def spec_for(script: Path, **values):
    return build_spec([Layer("test", values)] if values else [], target=Target("script", str(script)),
                      workdir=str(script.parent), python=sys.executable)


def rels(listing, kind=None):
    return sorted(i.rel for i in listing.items if kind is None or i.kind == kind)


def make_repo(root: Path, files: dict[str, str] | None = None, commit: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in (files or {"train.py": "print('hi')\n"}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q")
    if commit:
        git(root, "add", ".")
        git(root, "commit", "-qm", "init")
    return root


def regular_files_under(top: Path):
    """Every regular file under `top`, never through a link."""
    for folder, dirs, files in os.walk(top):
        for name in files + dirs:
            path = Path(folder) / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                yield path


def assert_nothing_outside_was_read(code_root: Path) -> None:
    for path in regular_files_under(code_root):
        assert SECRET not in path.read_bytes(), path


def one_line(text: str) -> bool:
    return "\n" not in text.rstrip("\n")


def bind_socket(path: Path) -> socket.socket:
    """A Unix socket at `path`, bound by its short relative name (sun_path holds ~108 bytes)."""
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        sock.bind(path.name)
    finally:
        os.chdir(here)
    return sock


# ------------------------------------------------------------------------------------------------- links


@pytest.fixture
def outside(tmp_path):
    out = tmp_path / "outside"
    (out / "deep" / "deeper").mkdir(parents=True)
    (out / "secret.txt").write_bytes(SECRET)
    (out / "deep" / "secret.txt").write_bytes(SECRET)
    return out


def _linked_project(root: Path, out: Path) -> None:
    (root / "sub").mkdir(parents=True)
    (root / "train.py").write_text("x\n")
    (root / "sub" / "m.py").write_text("m\n")
    (root / "f_out").symlink_to(out / "secret.txt")              # a file outside, absolute
    (root / "d_out").symlink_to(out)                              # a folder outside
    (root / "rel_out").symlink_to("../outside/secret.txt")        # outside, relative
    (root / "abs_in").symlink_to(root / "sub" / "m.py")           # inside, absolute
    (root / "loop1").symlink_to("loop2")                          # a loop
    (root / "loop2").symlink_to("loop1")
    (root / "self").symlink_to("self")
    (root / "dangling").symlink_to("nope")
    (root / "sub" / "up").symlink_to("..")                        # the project itself, from below


@pytest.mark.parametrize("mode", ["git", "walk"])
def test_links_stay_links_ones_out_of_the_project_are_noted_and_never_read(tmp_path, outside, mode):
    root = tmp_path / "proj"
    _linked_project(root, outside)
    if mode == "git":
        make_repo(root, files={})
    gitter = Git() if mode == "git" else Git(executable="")
    listing = list_project(root, git=gitter)
    links = {i.rel: i.target for i in listing.items if i.kind == "link"}
    assert links == {"f_out": str(outside / "secret.txt"), "d_out": str(outside),
                     "rel_out": str(outside / "secret.txt"), "abs_in": "sub/m.py", "loop1": "loop2",
                     "loop2": "loop1", "self": "self", "dangling": "nope", "sub/up": ".."}
    assert rels(listing, "file") == ["sub/m.py", "train.py"]
    noted = {n.split(" ", 1)[0] for n in listing.notes if "links out of the project" in n}
    assert noted == {"f_out", "d_out", "rel_out"}
    snap = snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"), git=gitter)
    taken = snapshot.take(snap)
    copy = Path(taken.dir)
    for rel, target in links.items():
        assert os.readlink(copy / rel) == target
    assert_nothing_outside_was_read(tmp_path / "run")
    manifest = (Path(taken.code_root) / f"{taken.id}.json").read_bytes()
    assert SECRET not in manifest


def test_a_link_that_leaves_the_project_through_another_link_is_noted(tmp_path, outside):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    (root / "deep_link").symlink_to(outside / "deep" / "deeper")
    (root / "sneaky").symlink_to("deep_link/../secret.txt")
    listing = list_project(root, git=Git(executable=""))
    assert os.path.realpath(root / "sneaky") == str(outside / "deep" / "secret.txt")
    assert any(n.startswith("sneaky links out of the project") for n in listing.notes), listing.notes


# ---------------------------------------------------------------------------------- FIFOs, sockets, devices


@pytest.mark.timeout(20)
def test_fifos_and_sockets_outside_git_are_skipped_with_a_note_and_never_opened(tmp_path):
    root = tmp_path / "plain"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    os.mkfifo(root / "pipe")
    sock = bind_socket(root / "sock")
    try:
        gitter = Git(executable="")
        snap = snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"), git=gitter)
        assert rels(snap.listing) == ["train.py"]
        assert "pipe skipped: a FIFO, not code" in snap.listing.notes
        assert "sock skipped: a socket, not code" in snap.listing.notes
        taken = snapshot.take(snap)
        assert sorted(os.listdir(taken.dir)) == ["train.py"]
    finally:
        sock.close()


@pytest.mark.timeout(20)
def test_untracked_fifos_and_sockets_in_git_do_not_hang_and_are_not_copied(tmp_path):
    root = make_repo(tmp_path / "proj")
    os.mkfifo(root / "pipe")
    sock = bind_socket(root / "sock")
    try:
        taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code")))
        assert sorted(os.listdir(taken.dir)) == ["train.py"]
        assert taken.listing.git is not None  # git does not list them: still git's view
    finally:
        sock.close()


@pytest.mark.timeout(20)
def test_a_tracked_file_replaced_by_a_fifo_does_not_hang_and_is_said_in_one_line(tmp_path):
    root = make_repo(tmp_path / "proj", {"train.py": "x\n", "pipe.py": "p\n"})
    os.unlink(root / "pipe.py")
    os.mkfifo(root / "pipe.py")
    snap = snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"))
    assert "pipe.py" not in rels(snap.listing)
    said = [n for n in snap.listing.notes if "pipe.py" in n] + [snap.listing.git_error or ""]
    assert any("pipe.py" in s and one_line(s) for s in said)
    taken = snapshot.take(snap)
    assert sorted(os.listdir(taken.dir)) == ["train.py"]


@pytest.mark.timeout(20)
def test_a_fifo_in_place_of_a_tracked_file_does_not_make_ignored_files_code(tmp_path):
    root = make_repo(tmp_path / "proj", {"train.py": "x\n", "pipe.py": "p\n", ".gitignore": "*.log\n"})
    (root / "big.log").write_text("not code\n")
    os.unlink(root / "pipe.py")
    os.mkfifo(root / "pipe.py")
    listing = list_project(root)
    assert "big.log" not in rels(listing, "file")
    assert listing.git is not None


# ------------------------------------------------------------------------------------------- unreadable


def test_as_root_a_mode_000_file_is_readable_so_it_is_copied(tmp_path):
    """Tests run as root here: chmod 000 does not stop root, so the file is code like any other (the ranks,
    root too, could read it). The unreadable case proper runs as nobody, below."""
    if os.geteuid() != 0:
        pytest.skip("the root case")
    root = tmp_path / "plain"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    (root / "locked.py").write_text("L = 1\n")
    (root / "locked.py").chmod(0)
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"),
                                        git=Git(executable="")))
    assert Path(taken.dir, "locked.py").read_text() == "L = 1\n"


_AS_NOBODY = r"""
import json, os, sys
from pathlib import Path
from hpc_ddp.common.errors import UserError
from hpc_ddp.snapshot import snapshot
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.spec.jobspec import Target, build_spec
top = Path(sys.argv[1])
out = {}
for mode in ("walk", "git", "git-tracked-in-closed"):
    root = top / mode
    spec = build_spec([], target=Target("script", str(root / "train.py")), workdir=str(root), python=sys.executable)
    gitter = Git(executable="") if mode == "walk" else Git()
    try:
        snap = snapshot.take(snapshot.plan(spec, str(top / ("run-" + mode) / "code"), git=gitter))
        out[mode] = {"items": {i.rel: i.kind for i in snap.listing.items}, "notes": list(snap.listing.notes),
                     "git_error": snap.listing.git_error, "copy": sorted(os.listdir(snap.dir))}
    except UserError as exc:
        out[mode] = {"refused": str(exc)}
print(json.dumps(out))
"""


def test_unreadable_files_and_folders_as_a_plain_user_are_left_out_in_one_line_each():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root to drop to nobody with setpriv")
    top = Path(tempfile.mkdtemp(prefix="hpc-ddp-hostile-", dir="/tmp"))
    try:
        top.chmod(0o755)
        for mode in ("walk", "git", "git-tracked-in-closed"):
            root = top / mode
            (root / "closed").mkdir(parents=True)
            (root / "train.py").write_text("x\n")
            (root / "secret.py").write_text("S = 1\n")
            (root / "closed" / "c.py").write_text("C = 1\n")
            if mode == "git":
                make_repo(root, files={}, commit=False)
                git(root, "add", "train.py", "secret.py")      # closed/ stays untracked
                git(root, "commit", "-qm", "init")
            elif mode == "git-tracked-in-closed":
                make_repo(root, files={})
            (root / "secret.py").chmod(0)
            (root / "closed").chmod(0)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(top)], check=True)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(top), "PYTHONPATH": str(REPO)}
        done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                               "-c", _AS_NOBODY, str(top)], capture_output=True, text=True, env=env, timeout=60,
                              cwd="/tmp", check=False)
        if done.returncode != 0 and "Permission denied" in done.stderr and "hpc_ddp" not in done.stderr:
            pytest.skip(f"nobody cannot run this Python here: {done.stderr[-200:]}")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        # outside git: each unreadable thing is left out (linked live) with a one-line note
        walk = result["walk"]
        assert "train.py" in walk["copy"]
        assert walk["items"].get("secret.py") == "live" and walk["items"].get("closed") == "live"
        said = [n for n in walk["notes"] if "cannot be read" in n]
        assert {n.split(" ", 1)[0] for n in said} == {"secret.py", "closed"} and all(one_line(n) for n in said)
        # in git: the unreadable tracked file is not copied, and a line names it
        got = result["git"]
        assert "refused" not in got, got
        assert "train.py" in got["copy"] and got["items"].get("secret.py") in ("live", None)
        assert any("secret.py" in n and one_line(n) for n in [*got["notes"], got["git_error"] or ""]), got
        # a tracked file in a folder that cannot be opened: refused in one line naming it
        refused = result["git-tracked-in-closed"]["refused"]
        assert one_line(refused) and "cannot read closed/c.py" in refused
        assert not (top / "run-git-tracked-in-closed").exists()
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(top)], check=False)
        shutil.rmtree(top, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- names

ODD = ["new\nline.py", "tab\t.py", os.fsdecode(b"bad\xff.py"), "sp ace;$(x).py"]


@pytest.mark.parametrize("mode", ["git", "walk"])
def test_names_with_newlines_tabs_and_bytes_that_are_not_utf8_are_copied_byte_for_byte(tmp_path, mode):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    for n, name in enumerate(ODD):
        (root / name).write_text(f"V = {n}\n")
    (root / os.fsdecode(b"out\n\xfe")).symlink_to(tmp_path)   # a link out, with an odd name
    if mode == "git":
        make_repo(root, files={})
        (root / "new\nline.py").write_text("V = 'changed'\n")
    gitter = Git() if mode == "git" else Git(executable="")
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"), git=gitter))
    for n, name in enumerate(ODD):
        expected = "V = 'changed'\n" if mode == "git" and n == 0 else f"V = {n}\n"
        assert Path(taken.dir, name).read_text() == expected
    lines = snapshot.record(taken, [str(tmp_path / "run")], None)
    assert all(one_line(line) for line in lines), lines
    assert any("links out of the project" in line for line in lines)
    manifest = snapshot.manifest_of(taken.code_root, taken.id)
    assert manifest is not None and len(manifest["items"]) == len(ODD) + 2
    for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines():
        json.loads(line)


def test_a_project_folder_with_a_newline_in_its_name_is_still_said_in_one_line(tmp_path):
    root = tmp_path / "my\nproj"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    snap = snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"), git=Git(executable=""))
    assert one_line(snap.describe()), snap.describe()


# ------------------------------------------------------------------------------ .git as a file, submodules


def test_a_worktree_whose_git_is_a_file_is_listed_by_git(tmp_path):
    main = make_repo(tmp_path / "main", {"train.py": "x\n", ".gitignore": "data/\n"})
    git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    wt = tmp_path / "wt"
    assert (wt / ".git").is_file()
    (wt / "extra.py").write_text("e\n")
    (wt / "data").mkdir()
    (wt / "data" / "d.bin").write_text("d")
    taken = snapshot.take(snapshot.plan(spec_for(wt / "train.py"), str(tmp_path / "run" / "code")))
    assert taken.listing.project == str(wt) and taken.listing.git.branch == "wt"
    assert rels(taken.listing, "file") == [".gitignore", "extra.py", "train.py"]
    assert os.readlink(Path(taken.dir, "data")) == str(wt / "data")
    assert not os.path.lexists(Path(taken.dir, ".git"))


def test_a_git_file_pointing_nowhere_is_walked_and_not_copied(tmp_path):
    root = tmp_path / "broken"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    (root / ".git").write_text("gitdir: /nonexistent/worktrees/gone\n")
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code")))
    assert taken.listing.git is None and sorted(os.listdir(taken.dir)) == ["train.py"]


@pytest.fixture
def with_submodule(tmp_path):
    lib = make_repo(tmp_path / "libsrc", {"lib.py": "L = 1\n", ".gitignore": "cache/\n"})
    root = make_repo(tmp_path / "proj")
    git(root, "submodule", "add", "-q", str(lib), "ext")
    git(root, "commit", "-qm", "sub")
    return root


def test_an_initialized_submodule_is_its_own_files(with_submodule, tmp_path):
    root = with_submodule
    assert (root / "ext" / ".git").is_file()
    (root / "ext" / "lib.py").write_text("L = 2\n")
    (root / "ext" / "new.py").write_text("N = 1\n")
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code")))
    files = rels(taken.listing, "file")
    assert {"ext/lib.py", "ext/new.py", "ext/.gitignore", ".gitmodules", "train.py"} <= set(files)
    assert not any(r.endswith(".git") for r in rels(taken.listing))
    assert Path(taken.dir, "ext", "lib.py").read_text() == "L = 2\n"


def test_a_submodules_ignored_folder_is_linked_live(with_submodule, tmp_path):
    root = with_submodule
    (root / "ext" / "cache").mkdir()
    (root / "ext" / "cache" / "c.bin").write_text("c")
    listing = list_project(root)
    assert "ext/cache" in rels(listing, "live")


def test_a_submodule_never_checked_out_is_skipped(with_submodule, tmp_path):
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(with_submodule), str(clone))
    assert (clone / "ext").is_dir() and not os.listdir(clone / "ext")
    taken = snapshot.take(snapshot.plan(spec_for(clone / "train.py"), str(tmp_path / "run" / "code")))
    assert rels(taken.listing) == [".gitmodules", "train.py"]


def test_an_untracked_nested_repo_is_copied(tmp_path):
    root = make_repo(tmp_path / "proj")
    make_repo(root / "vendor", {"lib.py": "V = 1\n"})
    snap = snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"))
    assert "vendor/lib.py" in rels(snap.listing, "file")


def test_a_repo_with_no_commits_is_snapshotted_without_a_diff(tmp_path):
    root = make_repo(tmp_path / "fresh", {"train.py": "x\n", "staged.py": "s\n"}, commit=False)
    git(root, "add", "staged.py")
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code")))
    assert rels(taken.listing, "file") == ["staged.py", "train.py"]
    state = taken.listing.git
    assert state.commit is None and state.changed == ("staged.py",) and state.untracked == ("train.py",)
    lines = snapshot.record(taken, [str(tmp_path / "run")], None)
    assert "no commits yet" in lines[0] and not any(p.suffix == ".diff" for p in Path(taken.code_root).iterdir())


# ---------------------------------------------------------------------------------------------- size


def test_a_huge_sparse_file_outside_git_is_refused_in_one_line_fast_and_nothing_is_written(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "train.py").write_text("x\n")
    with open(home / "big.bin", "wb") as fh:
        fh.truncate(300 * 2**20)   # sparse: 300 MiB of nothing on disk
    code_root = tmp_path / "run" / "code"
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        snapshot.plan(spec_for(home / "train.py"), str(code_root))
    assert time.monotonic() - start < 2
    assert one_line(str(err.value)) and "over the snapshot limit of 256 MB" in err.value.message
    assert "big.bin" in err.value.message
    assert not (tmp_path / "run").exists()


def test_a_folder_of_too_many_files_is_refused_after_a_walk_that_stops_early(tmp_path, monkeypatch):
    monkeypatch.setattr("hpc_ddp.snapshot.listing.MAX_FILES", 200)
    home = tmp_path / "home"
    (home / "lots").mkdir(parents=True)
    (home / "train.py").write_text("x\n")
    for n in range(1000):
        (home / "lots" / f"{n}.py").touch()
    listing = list_project(home, git=Git(executable=""))
    assert len(listing.files) <= 201 and _STOPPED in listing.notes
    with pytest.raises(UserError, match=r"more than 201 files, more than the 200") as err:
        check_limits(listing, 256)
    assert one_line(str(err.value))


def test_a_file_that_grew_past_the_limit_between_plan_and_take_is_refused(tmp_path):
    root = tmp_path / "plain"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    (root / "out.txt").write_text("small\n")
    snap = snapshot.plan(spec_for(root / "train.py", snapshot_max_mb=1), str(tmp_path / "run" / "code"),
                         git=Git(executable=""))
    with open(root / "out.txt", "r+b") as fh:
        fh.truncate(3 * 2**20)
    with pytest.raises(UserError):
        snapshot.take(snap)


# ------------------------------------------------------------------------------------------ the CLI


@pytest.fixture
def cli_project(tmp_path, monkeypatch):
    """A git project with train.py, a fake sbatch (and sinfo) on PATH, the shell in the project."""
    root = make_repo(tmp_path / "proj", {"train.py": "print('hi')\n", "helper.py": "H = 1\n"})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f"#!/bin/bash\nif [ \"$1\" = --help ]; then cat '{HELP / 'sbatch-22.05.txt'}'; exit 0; fi\n"
                    "echo '4711;cluster'\n")
    fake.chmod(0o755)
    sinfo = bin_dir / "sinfo"
    sinfo.write_text("#!/bin/bash\nfor n in hpcn1 hpcn2; do echo \"debug*|up|infinite|$n|idle|4|4000|gpu:2\"; done\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.delenv("HPC_DDP_PROFILE", raising=False)
    monkeypatch.chdir(root)
    return root


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def errors(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("hpc-ddp: error:")]


def code_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("hpc-ddp: code:")]


def test_cli_a_huge_project_is_refused_in_one_line_and_no_run_dir_is_made(cli_project, tmp_path):
    with open(cli_project / "big.bin", "wb") as fh:
        fh.truncate(300 * 2**20)
    result = invoke("submit", "--no-preflight", "--run-dir", str(tmp_path / "runA"), "train.py")
    assert result.exit_code == 2, result.output
    assert len(errors(result)) == 1 and "over the snapshot limit" in errors(result)[0]
    assert not (tmp_path / "runA").exists()


@pytest.mark.parametrize("pattern", ["/etc", "../x", "a/../../b", "..", "/"])
def test_cli_exclude_patterns_that_leave_the_project_are_refused_in_one_line(cli_project, pattern):
    result = invoke("submit", "--dry-run", "--snapshot-exclude", pattern, "train.py")
    assert result.exit_code == 2 and len(errors(result)) == 1, result.output
    with pytest.raises(ValueError):
        parse_excludes([pattern])


def test_cli_a_file_changed_between_plan_and_take_the_spec_names_the_copy_taken(cli_project, tmp_path, monkeypatch):
    real_take = snapshot.take
    seen = {}

    def take(snap):
        seen["planned"] = snap.id
        (cli_project / "helper.py").write_text("H = 2\n")
        return real_take(snap)

    monkeypatch.setattr(snapshot, "take", take)
    run_dir = tmp_path / "runB"
    result = invoke("submit", "--no-preflight", "--run-dir", str(run_dir), "train.py")
    assert result.exit_code == 0, result.output
    code = json.loads((run_dir / "spec.json").read_text())["code"]
    assert code["id"] != seen["planned"]
    assert Path(code["dir"], "helper.py").read_text() == "H = 2\n"
    assert code["script"] == str(Path(code["dir"], "train.py"))
    assert code["dir"] in (run_dir / "job.sbatch").read_text()
    assert not (run_dir / "code" / seen["planned"]).exists()


def test_cli_two_submits_of_the_same_code_reuse_the_copy(cli_project, tmp_path):
    run_dir = tmp_path / "elsewhere" / "runC"   # outside the project
    first = invoke("submit", "--no-preflight", "--run-dir", str(run_dir), "train.py")
    assert first.exit_code == 0, first.output
    before = {p.name: os.lstat(p).st_ino for p in (run_dir / "code").iterdir()}
    again = invoke("submit", "--no-preflight", "--run-dir", str(run_dir), "train.py")
    assert again.exit_code == 0, again.output
    assert {p.name: os.lstat(p).st_ino for p in (run_dir / "code").iterdir()} == before
    assert any("the same as the run dir's last snapshot" in line for line in code_lines(again))


def test_cli_two_submits_of_the_same_code_reuse_the_copy_with_the_run_dir_in_the_project(cli_project):
    first = invoke("submit", "--no-preflight", "--run-dir", "runs/x", "train.py")
    again = invoke("submit", "--no-preflight", "--run-dir", "runs/x", "train.py")
    assert first.exit_code == 0 and again.exit_code == 0, again.output
    assert len([p for p in (cli_project / "runs" / "x" / "code").iterdir() if p.is_dir()]) == 1, again.output


def test_cli_the_default_runs_folder_is_never_copied_into_the_next_snapshot(cli_project):
    first = invoke("submit", "--no-preflight", "--run-dir", "runs/a", "train.py")
    assert first.exit_code == 0, first.output
    second = invoke("submit", "--dry-run", "--json", "--run-dir", "runs/b", "train.py")
    assert second.exit_code == 0, second.output
    assert any("2 files" in line for line in code_lines(second)), code_lines(second)
    snap = snapshot.plan(spec_for(cli_project / "train.py"), str(cli_project / "runs" / "c" / "code"))
    assert not any(r.startswith("runs/") for r in rels(snap.listing)) and "runs" in rels(snap.listing, "live")


def test_cli_a_rendered_run_dir_in_the_project_is_not_copied_into_the_next_snapshot(cli_project):
    rendered = invoke("render", "--run-dir", "exp1", "train.py")
    assert rendered.exit_code == 0, rendered.output
    snap = snapshot.plan(spec_for(cli_project / "train.py"), str(cli_project / "exp2" / "code"))
    assert not any(r.startswith("exp1/") for r in rels(snap.listing, "file")), rels(snap.listing, "file")


def test_cli_a_repo_whose_config_points_its_worktree_elsewhere_is_not_an_internal_error(cli_project, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    git(cli_project, "config", "core.worktree", str(tmp_path / "elsewhere"))
    result = invoke("submit", "--dry-run", "train.py")
    assert "internal error" not in result.output and result.exit_code in (0, 2), result.output


def test_cli_a_code_folder_that_is_a_file_is_refused_in_one_line_and_left_alone(cli_project, tmp_path):
    run_dir = tmp_path / "runD"
    run_dir.mkdir()
    (run_dir / "code").write_text("someone's file\n")
    result = invoke("submit", "--no-preflight", "--run-dir", str(run_dir), "train.py")
    assert result.exit_code != 0 and len(errors(result)) == 1, result.output
    assert "internal error" not in result.output
    assert (run_dir / "code").read_text() == "someone's file\n"


# ----------------------------------------------------------------------------- .gitignore, GIT_*, config


def test_a_project_that_ignores_everything_still_pins_the_script_or_says_it_does_not(tmp_path):
    root = make_repo(tmp_path / "proj", {"train.py": "x\n", ".gitignore": "*\n"}, commit=False)
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code")))
    script = Path(taken.code().script)
    assert stat.S_ISREG(os.lstat(script).st_mode) or any("train.py" in n for n in taken.listing.notes)


def test_git_variables_in_the_shell_do_not_point_the_listing_at_another_repo(tmp_path, monkeypatch):
    other = make_repo(tmp_path / "other", {"other_only.py": "o\n"})
    root = make_repo(tmp_path / "proj")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    monkeypatch.setenv("GIT_INDEX_FILE", str(other / ".git" / "index"))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    snap = snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code"))
    assert snap.listing.project == str(root) and rels(snap.listing) == ["train.py"]
    assert snap.listing.git is not None and snap.listing.git.commit


def _program(tmp_path: Path, name: str, body: str = "cat") -> str:
    path = tmp_path / f"{name}.sh"
    path.write_text(f"#!/bin/sh\ntouch '{tmp_path}/RAN-{name}'\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_the_repos_fsmonitor_pager_and_diff_programs_do_not_run(tmp_path):
    root = make_repo(tmp_path / "proj", {"train.py": "x\n", "m.py": "m\n", ".gitattributes": "*.py diff=evil\n"})
    git(root, "config", "core.fsmonitor", _program(tmp_path, "fsmonitor", "echo 0"))
    git(root, "config", "diff.evil.textconv", _program(tmp_path, "textconv"))
    git(root, "config", "diff.evil.command", _program(tmp_path, "extdiff"))
    git(root, "config", "diff.external", _program(tmp_path, "external"))
    git(root, "config", "core.pager", _program(tmp_path, "pager"))
    (root / "m.py").write_text("changed\n")
    listing = list_project(root)
    assert listing.git is not None and listing.git.changed == ("m.py",) and b"changed" in listing.git.patch
    assert sorted(p.name for p in tmp_path.glob("RAN-*")) == []


def test_the_repos_filter_programs_do_not_run(tmp_path):
    root = make_repo(tmp_path / "proj", {"train.py": "x\n", "m.py": "m\n", ".gitattributes": "*.py filter=evil\n"})
    git(root, "config", "filter.evil.clean", _program(tmp_path, "clean"))
    (root / "m.py").write_text("changed\n")
    list_project(root)
    assert sorted(p.name for p in tmp_path.glob("RAN-*")) == []


def test_a_repo_owned_by_someone_else_is_not_silently_walked(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the repo")
    root = make_repo(tmp_path / "proj", {"train.py": "x\n", ".gitignore": "*.log\n"})
    (root / "out.log").write_text("ignored\n")
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(root)], check=True)
    listing = list_project(root)
    assert listing.git is not None or listing.git_error


# ---------------------------------------------------------------------------- what is in RUN_DIR/code


@pytest.fixture
def planned(tmp_path):
    root = tmp_path / "plain"
    root.mkdir()
    (root / "train.py").write_text("x\n")
    code_root = tmp_path / "run" / "code"
    code_root.mkdir(parents=True)
    return snapshot.plan(spec_for(root / "train.py"), str(code_root), git=Git(executable="")), code_root


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "keep.txt").write_text("theirs\n")
    return victim


@pytest.mark.parametrize("what", ["file", "link-to-file", "link-to-folder", "empty-folder", "dangling-link"])
def test_something_planted_where_the_copy_goes_is_refused_in_one_line_and_left_alone(planned, tmp_path, what):
    snap, code_root = planned
    place = code_root / snap.id
    victim = _victim(tmp_path)
    {"file": lambda: place.write_text("theirs\n"), "link-to-file": lambda: place.symlink_to(victim / "keep.txt"),
     "link-to-folder": lambda: place.symlink_to(victim), "empty-folder": lambda: place.mkdir(),
     "dangling-link": lambda: place.symlink_to(tmp_path / "nowhere")}[what]()
    before = os.lstat(place)
    with pytest.raises(UserError, match="is in the way of the code snapshot") as err:
        snapshot.take(snap)
    assert one_line(str(err.value))
    after = os.lstat(place)
    assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (before.st_ino, before.st_mode, before.st_mtime_ns)
    assert sorted(os.listdir(victim)) == ["keep.txt"] and (victim / "keep.txt").read_text() == "theirs\n"
    assert sorted(p.name for p in code_root.iterdir()) == [snap.id]   # no manifest, no leftover .tmp-


def test_a_planted_folder_with_a_manifest_that_is_not_hpc_ddps_is_not_reused(planned):
    snap, code_root = planned
    (code_root / snap.id).mkdir()
    (code_root / f"{snap.id}.json").write_text("{}")
    with pytest.raises(UserError):
        snapshot.take(snap)


def test_a_link_planted_at_the_manifests_temp_name_is_not_written_through(planned, tmp_path):
    snap, code_root = planned
    victim = _victim(tmp_path) / "keep.txt"
    (code_root / f".{snap.id}.json.tmp-{os.getpid()}").symlink_to(victim)
    try:
        snapshot.take(snap)
    except (UserError, OSError):
        pass
    assert victim.read_text() == "theirs\n"


def test_a_failed_copy_leaves_nothing_of_its_own_behind(planned, monkeypatch):
    snap, code_root = planned

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot, "_write_manifest", boom)
    with pytest.raises(OSError):
        snapshot.take(snap)
    assert list(code_root.iterdir()) == []


# ------------------------------------------------------------------------ how a rank's Python finds it


@pytest.fixture
def pinned_project(tmp_path):
    """A project with a package and a helper, and its snapshot taken outside it."""
    root = make_repo(tmp_path / "proj", {
        "helper.py": "WHERE = __file__\n",
        "pkg/__init__.py": "",
        "pkg/main.py": "import helper\nprint(helper.WHERE)\n",
        "train.py": "import sys\nsys.path.insert(0, '.')\nimport helper\nprint(helper.WHERE)\n",
    })
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(tmp_path / "run" / "code")))
    return root, taken


def _rank_python(args, cwd, project, copy):
    env = {**os.environ, "PYTHONPATH": runner.EXIT_GUARD_DIR, hpc_ddp_code.PROJECT_VARIABLE: str(project),
           hpc_ddp_code.DIR_VARIABLE: str(copy)}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_module_run_from_the_project_imports_the_copy(pinned_project, tmp_path):
    root, taken = pinned_project
    mod = build_spec([], target=Target("module", "pkg.main"), workdir=str(root), python=sys.executable)
    snap = snapshot.plan(mod, taken.code_root)
    assert snap.id == taken.id and snap.script is None
    assert _rank_python(["-m", "pkg.main"], root, root, taken.dir) == str(Path(taken.dir, "helper.py"))


def test_a_script_that_puts_dot_on_sys_path_imports_the_copy(pinned_project):
    root, taken = pinned_project
    assert _rank_python([taken.code().script], root, root, taken.dir) == str(Path(taken.dir, "helper.py"))


def test_an_editable_installs_finder_is_pointed_at_the_copy(pinned_project, tmp_path, monkeypatch):
    root, taken = pinned_project
    alias = tmp_path / "alias"
    alias.symlink_to(root)                         # the same project, by another path
    (root / "only_here").mkdir()                   # a folder the copy does not have
    finder = type(sys)("__editable___proj_0_1_finder")
    finder.MAPPING = {"pkg": str(alias / "pkg"), "gone": str(root / "only_here"), "other": "/elsewhere/other"}
    finder.NAMESPACES = {"ns": [str(root / "pkg"), "/elsewhere/ns"]}
    monkeypatch.setitem(sys.modules, finder.__name__, finder)
    monkeypatch.setitem(sys.modules, "__editable___broken_finder", None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    hpc_ddp_code.install({hpc_ddp_code.PROJECT_VARIABLE: str(root), hpc_ddp_code.DIR_VARIABLE: taken.dir})
    assert finder.MAPPING == {"pkg": str(Path(taken.dir, "pkg")), "gone": str(root / "only_here"),
                              "other": "/elsewhere/other"}
    assert finder.NAMESPACES == {"ns": [str(Path(taken.dir, "pkg")), "/elsewhere/ns"]}


def test_a_sys_path_entry_already_in_a_copy_inside_the_project_is_left_alone(tmp_path):
    root = make_repo(tmp_path / "proj", {"helper.py": "WHERE = __file__\n",
                                          "train.py": "import helper\nprint(helper.WHERE)\n"})
    (root / "runs" / "old").mkdir(parents=True)           # an earlier run: runs/ is left out, linked live
    (root / "runs" / "old" / "spec.json").write_text("{}")
    taken = snapshot.take(snapshot.plan(spec_for(root / "train.py"), str(root / "runs" / "x" / "code")))
    assert os.path.islink(Path(taken.dir, "runs"))
    assert hpc_ddp_code.pinned_entry(taken.dir, str(root), taken.dir, str(root)) == taken.dir
    assert _rank_python([taken.code().script], root, root, taken.dir) == str(Path(taken.dir, "helper.py"))
