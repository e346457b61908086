"""Checkpoint fault rows (issue 11, item 4, and their neighbours one step away).

Each row plants one hostile or broken thing in a checkpoint root and checks that resume (`load_latest`),
`save` and `inspect` neither hang, nor follow a link out of the root, nor print what a file holds, nor
crash with a traceback: a damaged checkpoint is skipped with one line naming it, a refusal is one
`CheckpointError` line, and nothing hpc-ddp did not make is deleted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hpc_ddp.common import durable
from hpc_ddp.trainer import checkpoint as ckpt
from hpc_ddp.trainer.checkpoint import CheckpointError, CheckpointManager, inspect_checkpoint, verify

pytestmark = pytest.mark.timeout(60)  # a hang (a FIFO opened for reading) fails the row, not the session

SECRET = "SECRET-TOKEN-d41d8cd9"  # what a file outside the root holds: must never reach a log or an error


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def payloads(step: int) -> dict:
    return {"model.pt": {"w": torch.full((4, 4), float(step))}, "optimizer.pt": {"state": {}, "lr": 0.1},
            "train_state.pt": {"step": step}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Checkpoints at steps 1, 2, 3 (keep=3); weights == step. A private root: no writable-dir warning."""
    os.chmod(tmp_path, 0o700)
    path = tmp_path / "ckpt"
    manager = CheckpointManager(path, keep=3, log=pytest.fail)
    for step in (1, 2, 3):
        manager.save(step, payloads(step), {"epoch": step})
    return path


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET + "\nroot:x:0:0:root:/root:/bin/bash\n")
    return path


def loads(root: Path, **kwargs) -> tuple[ckpt.Loaded | None, list[str]]:
    logs: list[str] = []
    return CheckpointManager(root, keep=3, log=logs.append).load_latest(**kwargs), logs


def assert_one_line(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    assert SECRET not in message and "root:x:0" not in message, message


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".tmp-*"))


def latest_text(root: Path) -> str:
    return (root / "latest").read_text().strip()


def rewrite_manifest(directory: Path, change) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# ------------------------------------------------------------ 1. a non-regular file where a file belongs

def plant(path: Path, kind: str, secret: Path) -> None:
    """Replace the file at `path` by `kind`."""
    data = path.read_bytes() if path.exists() else b""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "symlink to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink to an identical copy":  # same bytes, same hash: only the link is wrong
        copy = secret.parent / f"copy-{path.name}"
        copy.write_bytes(data)
        path.symlink_to(copy)
    elif kind == "symlink to a secret":
        path.symlink_to(secret)
    elif kind == "dangling symlink":
        path.symlink_to(secret.parent / "nowhere")
    else:
        raise AssertionError(kind)


FILE_KINDS = ["fifo", "directory", "socket", "symlink to /dev/zero", "symlink to an identical copy",
              "symlink to a secret", "dangling symlink"]


@pytest.mark.parametrize("kind", FILE_KINDS)
@pytest.mark.parametrize("fname", ["model.pt", "optimizer.pt", "manifest.json"])
def test_non_regular_file_in_a_checkpoint_is_skipped(root: Path, secret: Path, fname: str, kind: str) -> None:
    step3 = root / step_name(3)
    plant(step3 / fname, kind, secret)
    loaded, logs = loads(root, files=("model.pt",))  # optimizer.pt is verified even when not unpickled
    assert loaded is not None and loaded.step == 2
    assert len(logs) == 1 and str(step3) in logs[0] and fname in logs[0] and "previous checkpoint" in logs[0]
    assert_one_line(logs[0])
    with pytest.raises(CheckpointError) as info:
        inspect_checkpoint(step3)
    assert fname in str(info.value)
    assert_one_line(str(info.value))
    assert inspect_checkpoint(root)["step"] == 2
    with pytest.raises(CheckpointError):
        verify(step3)


def test_fifo_model_does_not_hang_the_cli(root: Path) -> None:
    from hpc_ddp.cli import cli

    plant(root / step_name(3) / "model.pt", "fifo", root)
    result = CliRunner().invoke(cli, ["inspect", str(root / step_name(3))])
    assert result.exit_code == 1, result.output
    assert "model.pt" in result.output and "FIFO" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["inspect", "--json", str(root)])
    assert result.exit_code == 0 and json.loads(result.output)["step"] == 2


# ------------------------------------------------------------ 2. `latest` that is not our pointer file

LATEST_KINDS = ["fifo", "socket", "empty directory", "symlink to a secret", "symlink to /dev/zero",
                "symlink to a file naming step 2", "symlink to a checkpoint dir", "huge file",
                "secret and control characters", "hard link to a secret"]


def plant_latest(root: Path, kind: str, secret: Path) -> None:
    latest = root / "latest"
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(latest))
        sock.close()
    elif kind == "empty directory":
        latest.mkdir()
    elif kind == "symlink to a secret":
        latest.symlink_to(secret)
    elif kind == "symlink to /dev/zero":
        latest.symlink_to("/dev/zero")
    elif kind == "symlink to a file naming step 2":
        named = secret.parent / "pointer"
        named.write_text(step_name(2) + "\n")
        latest.symlink_to(named)
    elif kind == "symlink to a checkpoint dir":
        latest.symlink_to(step_name(2))
    elif kind == "huge file":
        latest.write_text((SECRET + " ") * 1_000_000)
    elif kind == "secret and control characters":
        latest.write_text(f"\x1b[2J{SECRET}\nroot:x:0:0:root:/root:/bin/bash\n")
    elif kind == "hard link to a secret":
        os.link(secret, latest)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", LATEST_KINDS)
def test_bad_latest_is_not_followed_and_not_quoted(root: Path, secret: Path, kind: str) -> None:
    plant_latest(root, kind, secret)
    secret_before = secret.read_bytes()
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 3  # the newest checkpoint found, not what a link says
    assert len(logs) == 1 and str(root / "latest") in logs[0], logs
    assert_one_line(logs[0])
    assert inspect_checkpoint(root)["step"] == 3

    # the next save repairs `latest` (it replaces the entry, never writes through a link)
    CheckpointManager(root, keep=3, log=lambda _m: None).save(4, payloads(4), {})
    latest = root / "latest"
    assert stat.S_ISREG(os.lstat(latest).st_mode) and latest_text(root) == step_name(4)
    assert secret.read_bytes() == secret_before
    assert leftovers(root) == []
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 4 and logs == []


def test_latest_a_directory_with_files_fails_once_and_clearly(root: Path) -> None:
    (root / "latest").unlink()
    (root / "latest").mkdir()
    (root / "latest" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointError, match="latest") as info:
        CheckpointManager(root, keep=3, log=pytest.fail).save(4, payloads(4), {})
    assert_one_line(str(info.value))
    assert "HINT" in str(info.value)
    assert (root / "latest" / "notes.txt").read_text() == "mine"  # the user's directory is untouched
    assert sorted(p.name for p in root.iterdir()) == before  # and no checkpoint nothing points at
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 3 and len(logs) == 1


def test_latest_an_empty_directory_is_removed_by_save_and_said(root: Path) -> None:
    (root / "latest").unlink()
    (root / "latest").mkdir()
    said: list[str] = []
    manager = CheckpointManager(root, keep=3, log=said.append)
    manager.save(4, payloads(4), {})
    manager.save(5, payloads(5), {})  # "every later save": the second one too
    assert latest_text(root) == step_name(5)
    assert len(said) == 1 and "empty directory" in said[0] and str(root / "latest") in said[0]


def test_latest_naming_a_valid_name_is_still_quoted(root: Path) -> None:
    (root / "latest").write_text(step_name(99) + "\n")
    _loaded, logs = loads(root)
    assert len(logs) == 1 and step_name(99) in logs[0]


# ------------------------------------------------------------ 3. progress beyond the run's schedule

def plant_far_step(root: Path, step: int = 999_999) -> Path:
    """A checkpoint that verifies, saved by hpc-ddp itself, at a step far beyond any schedule."""
    CheckpointManager(root, keep=10, log=pytest.fail).save(step, payloads(step), {"epoch": 0})
    return root / step_name(step)


def test_checkpoint_beyond_the_schedule_is_refused(root: Path) -> None:
    far = plant_far_step(root)
    with pytest.raises(ckpt.BeyondSchedule) as info:
        loads(root, max_step=100)
    message = str(info.value)
    assert isinstance(info.value, CheckpointError)
    assert str(far) in message and "999999" in message and "100" in message and "HINT" in message
    assert_one_line(message)
    with pytest.raises(ckpt.BeyondSchedule):
        ckpt.load(far, max_step=100)


def test_max_step_at_the_boundary_and_unset(root: Path) -> None:
    plant_far_step(root)
    loaded, logs = loads(root, max_step=999_999)
    assert loaded is not None and loaded.step == 999_999 and logs == []
    loaded, _ = loads(root)  # no max_step: as before
    assert loaded is not None and loaded.step == 999_999


def test_a_damaged_far_checkpoint_just_falls_back(root: Path) -> None:
    far = plant_far_step(root)
    (far / "model.pt").write_bytes(b"garbage")
    loaded, logs = loads(root, max_step=100)
    assert loaded is not None and loaded.step == 3 and len(logs) == 1 and "model.pt" in logs[0]


def test_manifest_step_disagreeing_with_the_dir_name_is_skipped(root: Path) -> None:
    rewrite_manifest(root / step_name(3), lambda m: m.update(step=999_999))
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2
    assert len(logs) == 1 and str(root / step_name(3)) in logs[0] and "999999" in logs[0]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_manifest_with_a_nonsense_step_is_malformed(root: Path, bad) -> None:
    rewrite_manifest(root / step_name(3), lambda m: m.update(step=bad))
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2 and len(logs) == 1 and "malformed" in logs[0]


# ------------------------------------------------------------ 4. disk full during a save

@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A 2 MiB tmpfs of our own (we are root in the test container); unmounted afterwards."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root and mount rights): {result.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def big(step: int, mib: float) -> dict:
    return {"model.pt": {"w": torch.full((int(mib * 262_144),), float(step))}, "train_state.pt": {"step": step}}


def assert_previous_kept(root: Path, step: int) -> None:
    assert leftovers(root) == []
    assert latest_text(root) == step_name(step)
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == step and logs == []
    assert bool((loaded.payloads["model.pt"]["w"] == step).all())


def test_disk_full_on_a_real_filesystem(tiny_fs: Path) -> None:
    root = tiny_fs / "ckpt"
    manager = CheckpointManager(root, keep=2, log=pytest.fail)
    manager.save(1, big(1, 0.25), {})
    with pytest.raises(CheckpointError) as info:
        manager.save(2, big(2, 3), {})
    message = str(info.value)
    assert_one_line(message)
    assert "no space" in message and "free" in message and str(root) in message
    assert step_name(1) in message and "kept" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert_previous_kept(root, 1)
    assert sorted(p.name for p in root.iterdir()) == sorted([step_name(1), "latest"])
    manager.save(3, big(3, 0.25), {})  # the space came back: saving works again
    assert_previous_kept(root, 3)


def fill(fs: Path) -> None:
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # fill the filesystem to the last page
        while os.write(fd, b"x" * 65536):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [16, 3 << 20])  # a small write fails at flush, then again at close
def test_durable_write_on_a_full_disk_raises_one_error(tiny_fs: Path, size: int) -> None:
    fill(tiny_fs)
    with pytest.raises(OSError) as info:
        durable.write_durable(tiny_fs / "f", b"x" * size)
    assert info.value.errno == errno.ENOSPC
    assert info.value.__context__ is None  # not "during handling of the above exception, another..."


def test_disk_full_replacing_latest_leaves_no_temp(tiny_fs: Path) -> None:
    fill(tiny_fs)
    with pytest.raises(OSError):
        durable.replace_durable(tiny_fs / "pointer", b"y" * 8192)
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["filler"]


@pytest.mark.parametrize("fail_on", ["model.pt", "train_state.pt", "manifest.json"])
def test_disk_full_injected_while_writing(root: Path, monkeypatch, fail_on: str) -> None:
    real = ckpt._write_durable, ckpt._stream_durable

    def writer(path: Path, data: bytes) -> None:  # the manifest
        if Path(path).name == fail_on:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real[0](path, data)

    def streamer(path: Path, produce) -> None:  # the payloads: the disk fills after the first 100 bytes
        written: list[int] = []

        def filling(real_write):
            def write(chunk) -> int:
                if Path(path).name == fail_on and sum(written) > 100:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                written.append(real_write(chunk))
                return written[-1]
            return produce(write)
        real[1](path, filling)

    monkeypatch.setattr(ckpt, "_write_durable", writer)
    monkeypatch.setattr(ckpt, "_stream_durable", streamer)
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(root, keep=3, log=pytest.fail).save(4, payloads(4), {})
    assert_one_line(str(info.value))
    assert "no space" in str(info.value) and "free" in str(info.value) and step_name(3) in str(info.value)
    assert f"writing {fail_on}" in str(info.value)
    if fail_on != "manifest.json":
        assert re.search(rf"writing {fail_on} after [\d.]+ (bytes|KiB)", str(info.value)), str(info.value)
    monkeypatch.undo()
    assert_previous_kept(root, 3)
    assert not (root / step_name(4)).exists()


def test_disk_full_injected_while_pointing_latest(root: Path, monkeypatch) -> None:
    def replace(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ckpt, "replace_durable", replace)
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(root, keep=3, log=pytest.fail).save(4, payloads(4), {})
    assert_one_line(str(info.value))
    monkeypatch.undo()
    assert_previous_kept(root, 3)
    assert not (root / step_name(4)).exists()  # not a complete checkpoint that `latest` does not name


def test_quota_exceeded_reads_like_disk_full(root: Path, monkeypatch) -> None:
    def writer(path, data):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))

    monkeypatch.setattr(ckpt, "_write_durable", writer)
    monkeypatch.setattr(ckpt, "_stream_durable", writer)
    with pytest.raises(CheckpointError, match="quota|space") as info:
        CheckpointManager(root, keep=3, log=pytest.fail).save(4, payloads(4), {})
    assert_one_line(str(info.value))
    assert leftovers(root) == []


def test_root_that_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("not a dir")
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path / "ckpt", log=pytest.fail).save(1, payloads(1), {})
    assert_one_line(str(info.value))
    assert str(tmp_path / "ckpt") in str(info.value)
    assert (tmp_path / "ckpt").read_text() == "not a dir"


def test_unserializable_meta_leaves_no_temp(root: Path) -> None:
    with pytest.raises(TypeError):
        CheckpointManager(root, keep=3, log=pytest.fail).save(4, payloads(4), {"bad": object()})
    assert_previous_kept(root, 3)


# ------------------------------------------------------------ 5. neighbours: links and dirs one step away

def test_symlinked_checkpoint_dir_is_not_a_checkpoint(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / step_name(3), elsewhere)
    rewrite_manifest(elsewhere, lambda m: m.update(step=9))
    (root / step_name(9)).symlink_to(elsewhere)
    (root / "latest").write_text(step_name(9) + "\n")
    manager = CheckpointManager(root, keep=3, log=lambda _m: None)
    assert step_name(9) not in [p.name for p in manager.checkpoints()]
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 3 and len(logs) == 1
    assert inspect_checkpoint(root)["step"] == 3
    with pytest.raises(CheckpointError, match="symbolic link"):
        ckpt.load(root / step_name(9))
    # pruning never reaches through the link
    manager = CheckpointManager(root, keep=2, log=lambda _m: None)
    for step in (4, 5, 6):
        manager.save(step, payloads(step), {})
    assert (elsewhere / "model.pt").exists() and (root / step_name(9)).is_symlink()


def test_inspect_follows_only_the_path_the_user_typed(root: Path, tmp_path: Path) -> None:
    link = tmp_path / "my-link"
    link.symlink_to(root / step_name(2))
    assert inspect_checkpoint(link)["step"] == 2
    run_link = tmp_path / "run-link"
    run_link.symlink_to(root)
    assert inspect_checkpoint(run_link)["step"] == 3


def test_a_symlinked_root_still_works(tmp_path: Path) -> None:
    real = tmp_path / "scratch" / "ckpt"
    real.mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(real)
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep=2, log=lambda _m: None)
    for step in (1, 2, 3):
        manager.save(step, payloads(step), {})
    loaded, _ = loads(tmp_path / "run" / "checkpoints")
    assert loaded is not None and loaded.step == 3
    assert inspect_checkpoint(tmp_path / "run")["step"] == 3
    assert sorted(p.name for p in real.iterdir()) == sorted([step_name(2), step_name(3), "latest"])


@pytest.mark.parametrize("kind", ["dangling symlink", "fifo", "regular file"])
def test_a_non_directory_named_like_the_next_checkpoint(root: Path, kind: str, tmp_path: Path) -> None:
    target = root / step_name(4)
    if kind == "dangling symlink":
        target.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("mine")
    path = CheckpointManager(root, keep=3, log=lambda _m: None).save(4, payloads(4), {})
    assert path.name == f"{step_name(4)}-r1"
    assert os.path.lexists(target) and not target.is_dir()  # left alone
    loaded, _ = loads(root)
    assert loaded is not None and loaded.path == path


def test_a_temp_named_symlink_is_removed_not_followed(root: Path, tmp_path: Path) -> None:
    users = tmp_path / "users-data"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    (root / ".tmp-step-000000009-deadbeef").symlink_to(users)
    CheckpointManager(root, keep=3, log=lambda _m: None).save(4, payloads(4), {})
    assert (users / "thesis.tex").read_text() == "years of work"
    assert leftovers(root) == []


def test_prune_deletes_only_checkpoints_it_made(root: Path) -> None:
    mine = root / step_name(0)
    mine.mkdir()
    (mine / "notes.txt").write_text("not a checkpoint")
    manager = CheckpointManager(root, keep=2, log=lambda _m: None)
    manager.save(4, payloads(4), {})
    assert (mine / "notes.txt").read_text() == "not a checkpoint"
    assert [p.name for p in manager.checkpoints()][-2:] == [step_name(3), step_name(4)]
    assert not (root / step_name(1)).exists() and not (root / step_name(2)).exists()
    assert leftovers(root) == []


# ------------------------------------------------------------ 6. neighbours: a manifest that lies

def test_huge_manifest_is_refused_without_reading_it(root: Path) -> None:
    path = root / step_name(3) / "manifest.json"
    manifest = json.loads(path.read_text())
    with open(path, "w") as fh:
        fh.write(json.dumps(manifest)[:-1] + " " * (64 << 20) + "}")
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2
    assert len(logs) == 1 and "manifest.json" in logs[0] and "bytes" in logs[0]


@pytest.mark.parametrize("depth", [100_000])
def test_deeply_nested_manifest_is_malformed_not_a_crash(root: Path, depth: int) -> None:
    (root / step_name(3) / "manifest.json").write_text("[" * depth + "]" * depth)
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2 and len(logs) == 1 and "manifest.json" in logs[0]
    with pytest.raises(CheckpointError):
        inspect_checkpoint(root / step_name(3))


def _entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


ESCAPES = ["../" + step_name(2) + "/model.pt", "ABSOLUTE", "sub/model.pt", "", ".", "..", "model.pt\x00x",
           "manifest.json"]


@pytest.mark.parametrize("bad", ESCAPES, ids=[repr(e) for e in ESCAPES])
def test_manifest_naming_a_file_outside_the_checkpoint(root: Path, tmp_path: Path, bad: str) -> None:
    """A manifest whose hashes match a file outside the dir: only the name is wrong, and that is enough."""
    step3 = root / step_name(3)
    data = (root / step_name(2) / "model.pt").read_bytes()
    if bad == "ABSOLUTE":
        outside = tmp_path / "copy.pt"
        outside.write_bytes(data)
        bad = str(outside)
    elif bad == "sub/model.pt":
        (step3 / "sub").mkdir()
        (step3 / "sub" / "model.pt").write_bytes(data)

    def change(m: dict) -> None:
        m["files"].pop("model.pt")
        m["files"][bad] = _entry(data)

    rewrite_manifest(step3, change)
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2
    assert len(logs) == 1 and str(step3) in logs[0] and "previous checkpoint" in logs[0]
    with pytest.raises(CheckpointError, match="name"):
        inspect_checkpoint(step3)
    with pytest.raises(CheckpointError):
        verify(step3)


@pytest.mark.parametrize("entry", [{"size": -1, "sha256": "0" * 64}, {"size": True, "sha256": "0" * 64},
                                   {"size": 10, "sha256": "not hex"}, {"size": 10}, [], "x"])
def test_manifest_with_a_nonsense_file_entry(root: Path, entry) -> None:
    rewrite_manifest(root / step_name(3), lambda m: m["files"].update({"model.pt": entry}))
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2 and len(logs) == 1 and "malformed" in logs[0]


def test_size_mismatch_is_found_without_reading_the_file(root: Path, monkeypatch) -> None:
    model = root / step_name(3) / "model.pt"
    with open(model, "r+b") as fh:
        fh.truncate(8 << 30)  # a sparse 8 GiB file: reading it to compare sizes would take minutes
    started = time.monotonic()
    loaded, logs = loads(root)
    assert loaded is not None and loaded.step == 2 and "damaged" in logs[0] and str(model) in logs[0]
    assert time.monotonic() - started < 20


# ------------------------------------------------------------ 7. neighbours: names handed to save

@pytest.mark.parametrize("bad", ["../escape.pt", "sub/model.pt", "/abs.pt", "", ".", "..", "manifest.json",
                                 "nul\x00.pt"])
def test_save_refuses_a_file_name_that_is_not_one_plain_name(root: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="file name"):
        CheckpointManager(root, keep=3, log=pytest.fail).save(4, {bad: {"x": 1}, "model.pt": {}}, {})
    assert not (root / "escape.pt").exists() and not Path("/abs.pt").exists()
    assert_previous_kept(root, 3)


@pytest.mark.parametrize("bad", [-1, True, 2.0, "5"])
def test_save_refuses_a_nonsense_step(root: Path, bad) -> None:
    with pytest.raises(ValueError, match="step"):
        CheckpointManager(root, keep=3, log=pytest.fail).save(bad, payloads(4), {})
    assert_previous_kept(root, 3)
