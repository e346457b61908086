"""The code snapshot submit takes (snapshot.snapshot): which files, what is left out and linked, the limits,
the content id, the copy, and what changed since an earlier snapshot. Real git, real files; no Slurm."""

import dataclasses
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.snapshot import snapshot
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import Item, Listing, check_limits, list_project
from hpc_ddp.spec.code import Code, parse_excludes, pinned
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main"]


def git(root: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A git project: a script, a helper module, a package, a .gitignore'd data folder, one commit."""
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("import helper\n")
    (root / "helper.py").write_text("VALUE = 1\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "model.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("data/\n*.log\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 1000)
    (root / "train.log").write_text("log\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "init")
    return root


def spec_for(script: Path, **values):
    return build_spec([Layer("test", values)] if values else [], target=Target("script", str(script)),
                      workdir=str(script.parent), python=sys.executable)


def rels(listing, kind=None):
    return sorted(i.rel for i in listing.items if kind is None or i.kind == kind)


def test_a_git_project_is_its_tracked_and_untracked_files_with_ignored_ones_linked(repo):
    (repo / "new.py").write_text("NEW = 1\n")          # untracked, not ignored: code
    (repo / "helper.py").write_text("VALUE = 2\n")     # an uncommitted edit
    listing = list_project(repo)
    assert rels(listing, "file") == [".gitignore", "helper.py", "new.py", "pkg/__init__.py", "pkg/model.py",
                                     "run.sh", "train.py"]
    assert rels(listing, "live") == ["data", "train.log"]
    live = {i.rel: i.target for i in listing.items if i.kind == "live"}
    assert live["data"] == str(repo / "data")
    state = listing.git
    assert state.commit and state.branch == "main" and state.dirty
    assert state.changed == ("helper.py",) and state.untracked == ("new.py",)
    assert b"VALUE = 2" in state.patch
    assert "1 changed, 1 untracked" in state.describe()


def test_untracked_venvs_run_dirs_and_caches_are_left_out_but_tracked_files_are_copied(repo):
    (repo / "runs" / "a-run").mkdir(parents=True)
    (repo / "runs" / "a-run" / "spec.json").write_text("{}")
    (repo / "myenv").mkdir()
    (repo / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")
    (repo / "myenv" / "lib.py").write_text("")
    (repo / "pkg" / "__pycache__").mkdir()
    (repo / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (repo / "weights.pt").write_bytes(b"\0" * 10)
    (repo / "checkpoints").mkdir()
    (repo / "checkpoints" / "keep.txt").write_text("tracked on purpose\n")
    git(repo, "add", "checkpoints/keep.txt")
    listing = list_project(repo)
    files = rels(listing, "file")
    assert "checkpoints/keep.txt" in files  # tracked: copied, whatever its folder's name
    assert not any(r.startswith(("runs", "myenv", "pkg/__pycache__")) or r == "weights.pt" for r in files)
    assert {"runs", "myenv", "weights.pt"} <= set(rels(listing, "live"))
    assert not any("__pycache__" in r for r in rels(listing))  # dropped, not even linked


def test_outside_git_the_scripts_folder_is_walked_with_the_same_left_outs(tmp_path):
    root = tmp_path / "plain"
    (root / "lib").mkdir(parents=True)
    (root / "train.py").write_text("")
    (root / "lib" / "util.py").write_text("")
    (root / ".venv").mkdir()
    (root / ".venv" / "x.py").write_text("")
    (root / ".hidden").mkdir()
    (root / "data").mkdir()
    listing = list_project(root, git=Git(executable=""))  # as where git is not installed
    assert listing.git is None
    assert rels(listing, "file") == ["lib/util.py", "train.py"]
    assert rels(listing, "live") == [".hidden", ".venv", "data"]


def test_exclude_patterns_match_names_anywhere_or_paths_from_the_root(repo):
    (repo / "notebooks" / "big").mkdir(parents=True)
    (repo / "notebooks" / "big" / "a.ipynb").write_text("{}")
    (repo / "notebooks" / "small.ipynb").write_text("{}")
    (repo / "pkg" / "table.h5").write_bytes(b"\0")
    listing = list_project(repo, excludes=("notebooks/big", "*.h5"))
    assert "notebooks/small.ipynb" in rels(listing, "file")
    assert {"notebooks/big", "pkg/table.h5"} <= set(rels(listing, "live"))


def test_exclude_patterns_cannot_point_outside_the_project():
    assert parse_excludes(["data/", " *.h5 "]) == ("data", "*.h5")
    for bad in ("/etc", "../x", "a/../../b", "", "\n"):
        with pytest.raises(ValueError):
            parse_excludes([bad])


def test_symlinks_stay_links_and_one_out_of_the_project_is_noted(repo, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not code\n")
    (repo / "out.txt").symlink_to(outside)
    (repo / "inside_abs.py").symlink_to(repo / "helper.py")
    (repo / "inside_rel.py").symlink_to("helper.py")
    listing = list_project(repo)
    links = {i.rel: i.target for i in listing.items if i.kind == "link"}
    assert links == {"out.txt": str(outside), "inside_abs.py": "helper.py", "inside_rel.py": "helper.py"}
    assert any("out.txt links out of the project" in n for n in listing.notes)


def test_a_project_over_the_limit_is_refused_naming_its_biggest_folders(repo):
    (repo / "blobs").mkdir()
    (repo / "blobs" / "a.bin").write_bytes(b"\0" * 3_000_000)
    git(repo, "add", "blobs")
    listing = list_project(repo)
    with pytest.raises(UserError) as err:
        check_limits(listing, max_mb=2)
    assert "over the snapshot limit of 2 MB" in err.value.message and "blobs/ 3.0 MB" in err.value.message
    assert "--no-snapshot" in err.value.hint and "--snapshot-exclude" in err.value.hint
    check_limits(listing, max_mb=4)


def test_a_walk_stops_early_in_a_huge_folder(tmp_path):
    root = tmp_path / "home"
    root.mkdir()
    for n in range(30):
        (root / f"f{n}.bin").write_bytes(b"\0" * 100_000)
    listing = list_project(root, git=Git(executable=""), max_bytes=1_000_000)
    assert len(listing.files) < 30
    with pytest.raises(UserError, match="is more than"):
        check_limits(listing, max_mb=1)


def test_plan_then_take_copies_read_only_with_an_id_of_the_content(repo, tmp_path):
    spec = spec_for(repo / "train.py")
    planned = snapshot.plan(spec, str(tmp_path / "run" / "code"))
    assert not (tmp_path / "run").exists()  # planning writes nothing
    taken = snapshot.take(planned)
    assert taken.id == planned.id and len(taken.id) == 16
    copy = Path(taken.dir)
    assert (copy / "helper.py").read_text() == "VALUE = 1\n"
    assert stat.S_IMODE((copy / "helper.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((copy / "run.sh").stat().st_mode) == 0o555
    assert os.readlink(copy / "data") == str(repo / "data")   # left out: the working tree's, live
    code = taken.code()
    assert code.script == str(copy / "train.py") and code.project == str(repo)
    manifest = snapshot.manifest_of(taken.code_root, taken.id)
    assert manifest["items"]["helper.py"] == taken.hashes["helper.py"] and manifest["left_out"]["data"]
    assert not any(p.name.startswith(".tmp-") for p in Path(taken.code_root).iterdir())


def test_the_same_content_gets_the_same_id_and_is_reused(repo, tmp_path):
    root = str(tmp_path / "code")
    first = snapshot.take(snapshot.plan(spec_for(repo / "train.py"), root))
    marker = Path(first.dir) / "helper.py"
    before = marker.stat().st_ino
    again = snapshot.take(snapshot.plan(spec_for(repo / "train.py"), root))
    assert again.id == first.id and marker.stat().st_ino == before  # not replaced
    (repo / "helper.py").write_text("VALUE = 3\n")
    changed = snapshot.take(snapshot.plan(spec_for(repo / "train.py"), root))
    assert changed.id != first.id
    diff = snapshot.changes(snapshot.manifest_of(root, first.id), changed)
    assert diff == {"changed": ["helper.py"], "added": [], "removed": []}
    assert snapshot.describe_changes(diff) == "1 changed (helper.py)"


def test_a_file_changed_between_plan_and_take_gives_the_copy_its_own_id(repo, tmp_path):
    planned = snapshot.plan(spec_for(repo / "train.py"), str(tmp_path / "code"))
    (repo / "helper.py").write_text("VALUE = 99\n")
    taken = snapshot.take(planned)
    assert taken.id != planned.id and Path(taken.dir, "helper.py").read_text() == "VALUE = 99\n"
    assert not Path(planned.dir).exists()


def test_no_snapshot_and_the_trainer_pin_nothing(repo, tmp_path):
    assert snapshot.plan(spec_for(repo / "train.py", snapshot=False), str(tmp_path)) is None
    job = build_spec([], target=Target("trainer", str(repo / "job.toml")), workdir=str(repo), python=sys.executable)
    assert snapshot.plan(job, str(tmp_path)) is None


def test_a_module_in_the_working_directory_is_pinned_and_an_installed_one_is_not(repo, tmp_path):
    mod = build_spec([], target=Target("module", "pkg.model"), workdir=str(repo), python=sys.executable)
    planned = snapshot.plan(mod, str(tmp_path / "code"))
    assert planned is not None and planned.script is None and "pkg/model.py" in planned.hashes
    installed = build_spec([], target=Target("module", "json.tool"), workdir=str(repo), python=sys.executable)
    assert snapshot.plan(installed, str(tmp_path / "code")) is None


def test_a_repo_with_no_commits_is_all_untracked(tmp_path):
    root = tmp_path / "fresh"
    root.mkdir()
    (root / "train.py").write_text("")
    git(root, "init", "-q")
    listing = list_project(root)
    assert rels(listing, "file") == ["train.py"]
    assert listing.git.commit is None and listing.git.dirty and "no commits yet" in listing.git.describe()


def test_pinned_maps_paths_of_the_project_into_the_copy(tmp_path):
    code = Code(project=str(tmp_path / "p"), dir=str(tmp_path / "run" / "code" / "abc"), id="abc")
    assert pinned(code, str(tmp_path / "p")) == code.dir
    assert pinned(code, str(tmp_path / "p" / "src" / "a.py")) == os.path.join(code.dir, "src", "a.py")
    assert pinned(code, str(tmp_path / "pother")) == str(tmp_path / "pother")
    assert pinned(None, "/x") == "/x"


def test_the_spec_keeps_the_code_through_its_json(repo, tmp_path):
    spec = spec_for(repo / "train.py", snapshot_exclude=["data"], snapshot_max_mb=10)
    code = Code(str(repo), str(tmp_path / "c"), "0123456789abcdef", str(tmp_path / "c" / "train.py"))
    import dataclasses

    from hpc_ddp.spec.jobspec import JobSpec

    pinned_spec = dataclasses.replace(spec, code=code)
    back = JobSpec.from_dict(json.loads(json.dumps(pinned_spec.to_dict())))
    assert back == pinned_spec and back.program().startswith(str(tmp_path / "c" / "train.py"))


def test_the_readme_shows_what_submit_and_status_print(tmp_path):
    """docs/snapshots.md's sample lines are what the code prints for the same snapshot and records."""
    from hpc_ddp.snapshot.gitinfo import GitState
    from hpc_ddp.watch.status import code_line, environment_line, snapshots_of

    readme = (Path(__file__).resolve().parents[2] / "docs" / "snapshots.md").read_text()
    commit, later = "7f70d79121f2" + "0" * 28, "f2e14cbdd826" + "0" * 28
    run = "/home/me/proj/runs/train-20261127-005424"
    items = tuple(Item(n, "file", s) for n, s in (("train.py", 38), ("model.py", 12), (".gitignore", 12)))
    listing = Listing("/home/me/proj", (*items, Item("data", "live", target="/home/me/proj/data")),
                               git=GitState(commit, "main", True, ("model.py",), (), b"diff"))
    snap = snapshot.Snapshot(listing, "5af6266a1f87cee1", {}, f"{run}/code", "train.py")
    assert f"hpc-ddp: {snap.describe()}\n" in readme
    events = [{"event": "snapshot", "code": snap.id, "git": listing.git.to_json(),
               "patch": f"{snap.id}-{commit[:12]}.diff"}]
    assert f"    {code_line(snap.id, snapshots_of(events))}\n" in readme
    env = {"python": "3.11.7", "torch": "2.14.1", "cuda": "13.0", "nccl": "2.30.7", "packages": "715272fa92383828"}
    assert f"    {environment_line(env)} on node001\n" in readme
    # a resubmission: the line record() says, from the run dir's records
    (tmp_path / "code").mkdir()
    (tmp_path / "events.jsonl").write_text(json.dumps(events[0]) + "\n")
    (tmp_path / "code" / f"{snap.id}.json").write_text(json.dumps({"items": {"model.py": "a", "train.py": "t",
                                                                                         ".gitignore": "g"}}))
    newer = snapshot.Snapshot(dataclasses.replace(listing, git=GitState(later, "main", False, (), (), b"")),
                              "48ffe11b750f2cb0", {"model.py": "b", "train.py": "t", ".gitignore": "g"},
                              str(tmp_path / "code"), "train.py")
    newer = dataclasses.replace(newer, listing=dataclasses.replace(newer.listing, items=items))
    lines = snapshot.record(newer, [tmp_path], Code("/home/me/proj", str(tmp_path / "code" / snap.id), snap.id))
    said = [line for line in lines if "a new snapshot" in line]
    assert said and f"  hpc-ddp: {said[0]}\n" in readme


# ------------------------------------------------------------------------- the copy in two processes


@pytest.fixture
def many(tmp_path):
    """A project of 300 files in 12 folders (one executable, one empty, a few of 200 KB)."""
    root = tmp_path / "many"
    for n in range(300):
        path = root / f"pkg{n % 12}" / f"mod{n}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(200_000) if n % 50 == 7 else f"N = {n}\n".encode() * (n % 9))
    (root / "pkg0" / "run.sh").write_text("#!/bin/sh\n")
    (root / "pkg0" / "run.sh").chmod(0o755)
    (root / "train.py").write_text("x\n")
    return root


def test_two_processes_copy_the_same_files_as_one(many, tmp_path, monkeypatch):
    spec = spec_for(many / "train.py")
    one = snapshot.take(snapshot.plan(spec, str(tmp_path / "one"), git=Git(executable="")))
    monkeypatch.setattr("hpc_ddp.snapshot.copying.FORK_FROM_FILES", 0)
    two = snapshot.take(snapshot.plan(spec, str(tmp_path / "two"), git=Git(executable=""), read=False))
    assert two.id == one.id and two.hashes == one.hashes and len(two.hashes) == 302
    for rel, digest in one.hashes.items():
        copied = Path(two.dir, rel)
        assert hashlib.sha256(copied.read_bytes()).hexdigest() == digest
        assert stat.S_IMODE(copied.stat().st_mode) == (0o555 if rel.endswith(".sh") else 0o444)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


@pytest.mark.parametrize("half", ["first", "second"])
def test_a_file_that_grew_in_either_half_is_refused_and_nothing_is_left(many, tmp_path, monkeypatch, half):
    monkeypatch.setattr("hpc_ddp.snapshot.copying.FORK_FROM_FILES", 0)
    snap = snapshot.plan(spec_for(many / "train.py", snapshot_max_mb=2), str(tmp_path / "code"),
                         git=Git(executable=""), read=False)
    files = snap.listing.files
    grown = files[1] if half == "first" else files[-2]
    with open(many / grown.rel, "r+b") as fh:
        fh.truncate(3 * 10**6)
    with pytest.raises(UserError) as err:
        snapshot.take(snap)
    assert "grew past the snapshot limit" in err.value.message and grown.rel in err.value.message
    assert list((tmp_path / "code").iterdir()) == []  # the half-made copy is gone, both halves stopped
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_no_fork_while_another_thread_runs(many, tmp_path, monkeypatch):
    monkeypatch.setattr("hpc_ddp.snapshot.copying.FORK_FROM_FILES", 0)
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked"))
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    taken = snapshot.take(snapshot.plan(spec_for(many / "train.py"), str(tmp_path / "code"), git=Git(executable="")))
    assert len(taken.hashes) == 302
