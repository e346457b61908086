"""Staging under attack (issue 11, item 1): hpc-ddp deletes or replaces only what it provably made.

Every row builds something the user owns, stages at it, and checks that it is still there, byte for byte,
that the refusal is a UserError (exit 2, one line, with a hint), and that no temp copy is left behind.
The tables also hold the neighbours of each reported case: the same mistake one step away.
"""

import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.data.staging import stage

QUIET = {"log": lambda _m: None}


def user_tree(root: Path, files: int = 3) -> Path:
    """A directory the user owns, with files we can check are untouched."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (root / f"mine-{i}.txt").write_text(f"precious {i}\n")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.is_symlink()}


def temps(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(".*.tmp-*")) if root.exists() else []


def refused(call, *intact: Path, match: str | None = None) -> UserError:
    before = {str(p): snapshot(p) for p in intact}
    with pytest.raises(UserError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    assert {str(p): snapshot(p) for p in intact} == before
    return info.value


# ---- overlapping source and target, in either direction ----

def test_target_equal_to_the_source_is_refused(tmp_path):
    src = user_tree(tmp_path / "d" / "mnist")
    refused(lambda: stage(src, tmp_path / "d", **QUIET), src, match="overlaps")


def test_target_equal_to_the_source_through_a_symlinked_dest_is_refused(tmp_path):
    src = user_tree(tmp_path / "d" / "mnist")
    (tmp_path / "alias").symlink_to(tmp_path / "d")
    refused(lambda: stage(src, tmp_path / "alias", **QUIET), src, match="overlaps")


def test_target_equal_to_the_source_through_name_is_refused(tmp_path):
    src = user_tree(tmp_path / "d" / "data")
    refused(lambda: stage(tmp_path / "d" / "data", tmp_path / "d", name="data", **QUIET), src)


def test_dest_equal_to_the_source_is_refused(tmp_path):
    src = user_tree(tmp_path / "mnist")
    user_tree(src / "mnist")  # the user's own subdirectory that would be the target
    refused(lambda: stage(src, src, **QUIET), src, match="inside")


def test_dest_inside_the_source_is_refused_and_not_even_created(tmp_path):
    src = user_tree(tmp_path / "mnist")
    refused(lambda: stage(src, src / "cache", **QUIET), src, match="inside")
    assert not (src / "cache").exists()


def test_source_inside_the_target_is_refused(tmp_path):
    src = user_tree(tmp_path / "d" / "mnist" / "train")
    refused(lambda: stage(src, tmp_path / "d", name="mnist", **QUIET), tmp_path / "d")


def test_source_that_is_the_marker_path_is_refused(tmp_path):
    src = user_tree(tmp_path / "d" / "mnist.complete.json")  # derived name: mnist
    refused(lambda: stage(src, tmp_path / "d", **QUIET), src)


def test_source_with_our_temp_name_is_refused(tmp_path):
    src = user_tree(tmp_path / "d" / ".mnist.tmp-deadbeef")
    refused(lambda: stage(src, tmp_path / "d", name="mnist", **QUIET), src)


# ---- names: one plain path component ----

def test_a_source_whose_name_gives_no_dataset_name_needs_name(tmp_path):
    src = user_tree(tmp_path / ".cache")
    dest = user_tree(tmp_path / "dest")
    err = refused(lambda: stage(src, dest, **QUIET), src, dest, match="--name")
    assert err.hint and "--name" in err.hint


def test_a_trailing_slash_does_not_change_the_derived_name(tmp_path):
    src = user_tree(tmp_path / "mnist")
    result = stage(f"{src}/", tmp_path / "local", **QUIET)
    assert result.path == tmp_path / "local" / "mnist"


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../victim", "", "x\0y", ".hidden", ".other.tmp-0123abcd",
                                  "x.complete.json", "n" * 300, "ABS"])
def test_names_that_are_not_one_plain_component_are_refused(tmp_path, name):
    src = user_tree(tmp_path / "src")
    dest = tmp_path / "d" / "inner"
    user_tree(dest)
    victim = user_tree(tmp_path / "victim")
    (tmp_path / "d" / "b").mkdir()
    if name == "ABS":  # an absolute path as the name: root / "/x" is "/x"
        name = str(victim)
    refused(lambda: stage(src, dest, name=name, **QUIET), tmp_path / "d", victim)


# ---- something hpc-ddp did not make at the target ----

def test_a_users_directory_at_the_target_is_refused_not_replaced(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    mine = user_tree(tmp_path / "local" / "mnist", files=5)
    err = refused(lambda: stage(src, tmp_path / "local", **QUIET), mine, match=r"was not staged by hpc-ddp")
    assert str(mine) in str(err) and err.hint


def test_a_symlink_at_the_target_is_refused_even_with_our_marker(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    mine = user_tree(tmp_path / "elsewhere")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "mnist").symlink_to(mine)
    (tmp_path / "local" / "mnist.complete.json").write_text('{"key": "old"}')
    refused(lambda: stage(src, tmp_path / "local", **QUIET), mine)
    assert (tmp_path / "local" / "mnist").is_symlink()


def test_a_users_file_at_the_target_is_refused(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "mnist").write_text("my notes")
    refused(lambda: stage(src, tmp_path / "local", **QUIET))
    assert (tmp_path / "local" / "mnist").read_text() == "my notes"


def test_a_users_file_at_the_marker_path_is_refused_not_deleted(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "mnist.complete.json").write_text("not ours")
    refused(lambda: stage(src, tmp_path / "local", **QUIET))
    assert (tmp_path / "local" / "mnist.complete.json").read_text() == "not ours"


def test_only_exact_temp_names_are_cleaned_up(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    local = tmp_path / "local"
    mine = user_tree(local / ".mnist.tmp-mine")          # looks like ours, is not: kept
    linked = user_tree(tmp_path / "linked")
    (local / ".mnist.tmp-0000aaaa").symlink_to(linked)   # our name, but a link: not followed
    dead = user_tree(local / ".mnist.tmp-0123abcd")      # a dead stager's temp dir: removed
    before_mine, before_linked = snapshot(mine), snapshot(linked)
    stage(src, local, **QUIET)
    assert snapshot(mine) == before_mine and snapshot(linked) == before_linked
    assert not dead.exists()


def test_a_copy_we_staged_is_still_replaced_when_the_source_changes(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    stage(src, tmp_path / "local", **QUIET)
    (src / "new.txt").write_text("new")
    again = stage(src, tmp_path / "local", **QUIET)
    assert again.copied and (again.path / "new.txt").read_text() == "new"
    assert temps(tmp_path / "local") == []


def test_killed_between_rename_and_marker_is_still_ours(tmp_path):
    src = user_tree(tmp_path / "shared" / "mnist")
    local = user_tree(tmp_path / "local" / "mnist").parent
    from hpc_ddp.data.staging import _write_marker

    _write_marker(local / "mnist.complete.json", {"key": "", "state": "publishing"}, local / "mnist")  # _publish's
    result = stage(src, local, **QUIET)
    assert result.copied and snapshot(result.path) == snapshot(src)


# ---- the destination ----

def test_dest_that_is_a_file_is_a_user_error(tmp_path):
    (tmp_path / "f").write_text("x")
    refused(lambda: stage(user_tree(tmp_path / "mnist"), tmp_path / "f", **QUIET), match="not a directory")


def test_dest_under_a_file_is_a_user_error(tmp_path):
    (tmp_path / "f").write_text("x")
    refused(lambda: stage(user_tree(tmp_path / "mnist"), tmp_path / "f" / "sub", **QUIET))


def test_dest_under_proc_is_a_user_error(tmp_path):
    refused(lambda: stage(user_tree(tmp_path / "mnist"), "/proc/hpc-ddp-no/such", **QUIET))


# ---- the source ----

def test_a_single_file_is_refused_saying_what_to_do(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"x" * 10)
    err = refused(lambda: stage(tmp_path / "data.bin", tmp_path / "local", **QUIET), match="single file")
    assert "directory" in err.hint


def test_a_fifo_source_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    refused(lambda: stage(tmp_path / "pipe", tmp_path / "local", **QUIET))


@pytest.mark.parametrize("change", ["same size", "new size", "file added"])
def test_a_source_changed_mid_copy_leaves_nothing(tmp_path, monkeypatch, change):
    from hpc_ddp.data import staging

    src = user_tree(tmp_path / "shared" / "mnist")
    copy = staging._copy_tree

    def copy_then_change(s, t):
        copy(s, t)
        if change == "file added":
            (src / "late.txt").write_text("late")
        else:
            (src / "mine-0.txt").write_text("PRECIOUS 0\n" if change == "same size" else "longer now\n\n")
            os.utime(src / "mine-0.txt", ns=(1, 1))

    monkeypatch.setattr(staging, "_copy_tree", copy_then_change)
    with pytest.raises(HpcDdpError, match="changed|does not match"):
        stage(src, tmp_path / "local", **QUIET)
    assert temps(tmp_path / "local") == [] and not (tmp_path / "local" / "mnist").exists()
    assert not (tmp_path / "local" / "mnist.complete.json").exists()


# ---- free space, in blocks; disk full mid-copy (a real tmpfs) ----

def test_blocks_are_counted_not_bytes():
    from hpc_ddp.data.staging import blocks_needed

    assert blocks_needed([100] * 8000, 0, 4096) == 8000 * 4096
    assert blocks_needed([0, 4096, 4097], 2, 4096) == (0 + 1 + 2 + 2) * 4096


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs of our own (needs root); skipped where it cannot be mounted."""
    mounted = []

    def mount(size: str, inodes: int | None = None) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        opts = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def small_files(root: Path, n: int, size: int = 100) -> Path:
    for i in range(n):
        sub = root / f"c{i % 8}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i}.bin").write_bytes(b"x" * size)
    return root


def test_8000_small_files_do_not_fit_20_mb_of_tmpfs(tmp_path, tmpfs):
    src = small_files(tmp_path / "shared" / "tiny", 8000)
    local = tmpfs("20m")
    with pytest.raises(HpcDdpError, match=r"not enough space to stage tiny .*needs 3\d\.\d MB"):
        stage(src, local, **QUIET)
    assert sorted(p.name for p in local.iterdir()) == [".tiny.lock"]


def test_too_few_inodes_is_refused_before_copying(tmp_path, tmpfs):
    src = small_files(tmp_path / "shared" / "tiny", 300)
    local = tmpfs("20m", inodes=100)
    with pytest.raises(HpcDdpError, match="inodes"):
        stage(src, local, **QUIET)
    assert temps(local) == []


def test_disk_full_mid_copy_leaves_no_temp_copy(tmp_path, tmpfs, monkeypatch):
    from hpc_ddp.data import staging

    src = small_files(tmp_path / "shared" / "big", 40, size=100_000)  # 4 MB into 1 MB
    local = tmpfs("1m")
    monkeypatch.setattr(staging, "_check_space", lambda *a: None)  # as if the check had raced another writer
    with pytest.raises(HpcDdpError) as info:
        stage(src, local, **QUIET)
    assert not isinstance(info.value, UserError) and "\n" not in str(info.value)
    assert temps(local) == [] and not (local / "big").exists()


def test_disk_full_mid_extract_leaves_no_temp_copy(tmp_path, tmpfs, monkeypatch):
    from hpc_ddp.data import staging

    src = small_files(tmp_path / "shared" / "big", 40, size=100_000)
    archive = tmp_path / "big.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(src, arcname="big")
    local = tmpfs("1m")
    monkeypatch.setattr(staging, "_check_space", lambda *a: None)
    with pytest.raises(HpcDdpError):
        stage(archive, local, **QUIET)
    assert temps(local) == [] and not (local / "big").exists()


# ---- bad archives: one line, exit 2, nothing left ----

def _tgz(path: Path, n: int = 30) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for i in range(n):
            data = os.urandom(20_000)
            info = tarfile.TarInfo(f"d/{i}.bin")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _truncate(path: Path, fraction: float = 0.5) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def _bad_archive(tmp_path: Path, kind: str) -> Path:
    if kind == "truncated .tar.gz":
        return _truncate(_tgz(tmp_path / "ds.tar.gz"))
    if kind == "truncated .tgz near the end":
        return _truncate(_tgz(tmp_path / "ds.tgz"), 0.98)
    if kind == "truncated .tar":
        src = small_files(tmp_path / "ds", 5, 20_000)
        with tarfile.open(tmp_path / "ds.tar", "w") as tf:
            tf.add(src, arcname="ds")
        return _truncate(tmp_path / "ds.tar", 0.6)
    if kind == "truncated .zip":
        with zipfile.ZipFile(tmp_path / "ds.zip", "w") as zf:
            zf.writestr("a.bin", os.urandom(50_000))
        return _truncate(tmp_path / "ds.zip", 0.7)
    if kind == "not gzip":
        (tmp_path / "ds.tar.gz").write_bytes(os.urandom(5000))
        return tmp_path / "ds.tar.gz"
    if kind == "empty .tar":
        (tmp_path / "ds.tar").write_bytes(b"")
        return tmp_path / "ds.tar"
    if kind == "zip with a bad CRC":
        with zipfile.ZipFile(tmp_path / "ds.zip", "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("a.bin", b"A" * 5000)
        raw = bytearray((tmp_path / "ds.zip").read_bytes())
        raw[100] ^= 0xFF  # inside the stored data: the listing reads fine, the extraction does not
        (tmp_path / "ds.zip").write_bytes(bytes(raw))
        return tmp_path / "ds.zip"
    raise AssertionError(kind)


BAD_ARCHIVES = ["truncated .tar.gz", "truncated .tgz near the end", "truncated .tar", "truncated .zip",
                "not gzip", "empty .tar", "zip with a bad CRC"]


@pytest.mark.parametrize("kind", BAD_ARCHIVES)
def test_a_bad_archive_is_one_line_and_leaves_nothing(tmp_path, kind):
    archive = _bad_archive(tmp_path, kind)
    with pytest.raises(UserError) as info:
        stage(archive, tmp_path / "local", **QUIET)
    assert "\n" not in str(info.value)
    assert temps(tmp_path / "local") == [] and not (tmp_path / "local" / "ds").exists()


def test_a_truncated_tgz_is_exit_2_not_aborted(tmp_path):
    archive = _truncate(_tgz(tmp_path / "ds.tar.gz"))
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "stage", str(archive), "--dest", str(tmp_path / "l")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "aborted" not in done.stderr and "truncated" in done.stderr and len(done.stderr.splitlines()) == 1


# ---- hostile tars: links checked the way tar resolves them ----

def _member(name: str, kind: str = "file", link: str = "", data: bytes = b"pwned\n"):
    info = tarfile.TarInfo(name)
    if kind == "file":
        info.size = len(data)
        return info, io.BytesIO(data)
    info.type = {"sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "dir": tarfile.DIRTYPE}[kind]
    info.linkname = link
    return info, None


HOSTILE = {
    # the two from the issue
    "hard link resolved from the root": [("d/e/ok", "file", ""), ("d/e/h", "hard", "../x")],
    "symlink chain whose .. goes through a symlink": [
        ("a/b/c/d", "sym", "../.."), ("x", "sym", "a/b/c/d/../../.."), ("x/pwned", "file", "")],
    # neighbours
    "hard link one level deeper": [("p/q/r/h", "hard", "../../x")],
    "hard link through an in-archive symlink": [
        ("a/b/c/d", "sym", "../.."), ("h", "hard", "a/b/c/d/../../../etc/passwd")],
    "member written through an escaping chain": [
        ("a/b/c/d", "sym", "../.."), ("a/b/c/d/../../../pwned", "file", "")],
    "member path through a chained symlink dir": [
        ("a/b/c/d", "sym", "../.."), ("a/up", "sym", "b/c/d/.."), ("a/up/../../pwned", "file", "")],
    "member under a symlink to a chain that escapes": [
        ("a/b/c/d", "sym", "../.."), ("a/x", "sym", "b/c/d/../.."), ("a/x/pwned", "file", "")],
    "symlink loop": [("l1", "sym", "l2"), ("l2", "sym", "l1"), ("l1/f", "file", "")],
    "symlink then a member through it, link defined after": [("s/pwned", "file", ""), ("s", "sym", "a/../..")],
    "the same path a dir and then a symlink": [("s", "dir", ""), ("s", "sym", "t"), ("t", "dir", "")],
    "absolute hard link": [("h", "hard", "/etc/passwd")],
    "absolute symlink": [("s", "sym", "/etc")],
    "dotdot member": [("../escape.txt", "file", "")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_tar_is_refused_before_tar_runs(tmp_path, case, monkeypatch):
    from hpc_ddp.data import staging

    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tf:
        for name, kind, link in HOSTILE[case]:
            tf.addfile(*_member(name, kind, link))
    ran = []
    real_run = subprocess.run
    monkeypatch.setattr(staging.subprocess, "run", lambda *a, **k: ran.append(a) or real_run(*a, **k))
    local = tmp_path / "deep" / "er" / "local"
    with pytest.raises(UserError, match="refusing archive"):
        stage(archive, local, name="evil", **QUIET)
    assert not any("tar" in str(a) for a in ran)  # refused by us, not by GNU tar
    assert not (tmp_path / "deep" / "er" / "pwned").exists() and not (tmp_path / "deep" / "pwned").exists()
    assert temps(local) == [] and not (local / "evil").exists()


def test_legitimate_links_inside_the_archive_still_extract(tmp_path):
    archive = tmp_path / "ok.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for name, kind, link in [("./ds/v1/data.bin", "file", ""), ("./ds/latest", "sym", "v1"),
                                 ("./ds/via", "sym", "latest/data.bin"), ("./ds/self", "sym", "."),
                                 ("./ds/up", "sym", ".."), ("./ds/hard", "hard", "ds/v1/data.bin"),
                                 ("./ds/v1/back", "sym", "../latest/../v1")]:
            tf.addfile(*_member(name, kind, link))
    result = stage(archive, tmp_path / "local", **QUIET)
    assert (result.path / "ds" / "via").read_bytes() == b"pwned\n"
    assert (result.path / "ds" / "hard").read_bytes() == b"pwned\n"


def test_zip_with_a_symlink_or_an_absolute_name_is_refused(tmp_path):
    for i, (name, mode) in enumerate([("link", 0o120777), ("/tmp/abs-hpc-ddp-zip", 0o100644)]):
        archive = tmp_path / f"z{i}.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, "/etc/passwd")
        with pytest.raises(UserError, match="refusing archive"):
            stage(archive, tmp_path / "local", **QUIET)
    assert not Path("/tmp/abs-hpc-ddp-zip").exists()


# ---- checked when the job is built, --no-preflight or not ----

def _build(values):
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    target = Target("trainer", "/job.toml") if "train" in values else Target("script", "/t.py")
    return build_spec([Layer("c", values)], target=target, workdir="/", python="p")


@pytest.mark.parametrize("values", [
    {"datasets": ["{tmp}/absent:ds"]}, {"datasets": {"ds": "{tmp}/absent"}},
    {"datasets": ["{tmp}/file/ds"]}, {"datasets": ["{tmp}/file"]}, {"datasets": ["{tmp}/no/such/deeper"]},
    {"train": {"dataset": "mnist", "data_dir": "{tmp}/absent"}},
])
def test_sources_this_machine_can_judge_are_refused_at_build_time(tmp_path, values):
    from hpc_ddp.common.errors import SpecError

    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    fill = lambda v: {k: fill(x) for k, x in v.items()} if isinstance(v, dict) else (  # noqa: E731
        [fill(x) for x in v] if isinstance(v, list) else v.replace("{tmp}", str(tmp_path)))
    with pytest.raises(SpecError) as info:
        _build(fill(values))
    assert "\n" not in str(info.value) and info.value.hint
    assert str(tmp_path / "file") in str(info.value) or str(tmp_path / "absent") in str(info.value) or \
        str(tmp_path / "no") in str(info.value)


def test_a_source_only_compute_nodes_may_mount_is_left_to_the_preflight(tmp_path):
    (tmp_path / "empty-mount-point").mkdir()
    spec = _build({"datasets": ["/nonexistent-hpc-ddp-mount/ds", f"{tmp_path}/empty-mount-point/ds2"]})
    assert [n for n, _ in spec.datasets] == ["ds", "ds2"]


# ---- the command line ----

@pytest.mark.parametrize("case", ["dest is a file", "single file", "name ..", "target is the source"])
def test_stage_command_refusals_are_one_line_exit_2(tmp_path, case):
    src = user_tree(tmp_path / "mnist")
    (tmp_path / "f.bin").write_text("x")
    args = {"dest is a file": [str(src), "--dest", str(tmp_path / "f.bin")],
            "single file": [str(tmp_path / "f.bin"), "--dest", str(tmp_path / "l")],
            "name ..": [str(src), "--dest", str(tmp_path / "l" / "in"), "--name", ".."],
            "target is the source": [str(src), "--dest", str(tmp_path)]}[case]
    before = snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "stage", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "HINT" in done.stderr and "internal error" not in done.stderr
    assert snapshot(tmp_path) == before


# ---- round 3 (issue 30): a marker hpc-ddp did not write, option-like names, FIFOs and devices ----

def test_a_forged_marker_beside_the_users_folder_does_not_make_it_ours(tmp_path):
    """A marker of our exact shape, written (or copied in) beside a folder of the user's: its key matches the
    source, but it vouches for another directory, so the folder is neither reused nor replaced."""
    import json

    src = user_tree(tmp_path / "data")
    dest = tmp_path / "scratch"
    done = stage(src, dest, **QUIET)
    marker = json.loads((dest / "data.complete.json").read_text())
    (dest / "data").rename(tmp_path / "moved")        # the user's own folder takes the staged copy's place
    user_tree(dest / "data", files=5)
    refused(lambda: stage(src, dest, **QUIET), dest / "data", match="was not written by hpc-ddp for data")
    (dest / "data.complete.json").write_text(json.dumps({"key": marker["key"]}))  # an older or forged shape
    refused(lambda: stage(src, dest, **QUIET), dest / "data", match="was not written by hpc-ddp")
    assert done.copied


def test_a_staged_copy_is_still_reused_and_replaced(tmp_path):
    src = user_tree(tmp_path / "data")
    dest = tmp_path / "scratch"
    assert stage(src, dest, **QUIET).copied
    assert not stage(src, dest, **QUIET).copied   # reused: its marker vouches for this very directory
    (src / "new.txt").write_text("more\n")
    assert stage(src, dest, **QUIET).copied       # the source changed: our copy is replaced
    assert (dest / "data" / "new.txt").read_text() == "more\n"


def test_a_source_named_like_an_option_is_copied_not_read_as_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user_tree(tmp_path / "-data")
    result = stage(Path("./-data"), tmp_path / "scratch", name="data", **QUIET)
    assert snapshot(result.path) == snapshot(tmp_path / "-data")


@pytest.mark.parametrize("checksums", [False, True])
@pytest.mark.parametrize("planted", ["fifo", "link-to-dev-zero"])
def test_a_fifo_or_device_inside_the_dataset_is_refused_at_once(tmp_path, planted, checksums):
    src = user_tree(tmp_path / "data")
    if planted == "fifo":
        os.mkfifo(src / "pipe")
    else:
        (src / "zero").symlink_to("/dev/zero")
    dest = tmp_path / "scratch"
    refused(lambda: stage(src, dest, checksums=checksums, **QUIET), src,
            match="FIFO" if planted == "fifo" else "character device")
    assert temps(dest) == []
