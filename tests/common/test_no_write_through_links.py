"""hpc-ddp never writes through a link (issue 30, data loss): every file it keeps in a run dir is written by
`durable.write_file` (a new file renamed over the path: a planted link is replaced, its target untouched) or
`durable.append` (O_NOFOLLOW: a link, FIFO or folder at the path is refused, its target untouched)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from hpc_ddp.common.durable import NotRegularFile, append, write_file
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import JsonLines


@pytest.fixture
def outside(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's own file\n")
    return precious


def test_write_file_replaces_a_planted_link_and_leaves_its_target(tmp_path, outside):
    path = tmp_path / "spec.json"
    path.symlink_to(outside)
    write_file(path, "{}\n", 0o600)
    assert outside.read_text() == "the user's own file\n"
    assert not path.is_symlink() and path.read_text() == "{}\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt", "spec.json"]  # no temp file left


def test_write_file_gives_the_mode_asked_for_despite_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_file(tmp_path / "job.sbatch", "#!/bin/bash\n", 0o700)
        write_file(tmp_path / "x.png", b"\x89PNG")
    finally:
        os.umask(old)
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "x.png").stat().st_mode & 0o777 == 0o644


def test_write_file_refuses_a_folder_and_leaves_no_temp_file(tmp_path):
    (tmp_path / "job.sbatch").mkdir()
    with pytest.raises(OSError):
        write_file(tmp_path / "job.sbatch", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["job.sbatch"]


def test_append_refuses_a_link_and_writes_nothing_through_it(tmp_path, outside):
    path = tmp_path / "events.jsonl"
    path.symlink_to(outside)
    with pytest.raises(NotRegularFile, match="symbolic link"):
        append(path, "{}\n")
    assert outside.read_text() == "the user's own file\n"


def test_append_refuses_a_dangling_link_without_creating_its_target(tmp_path):
    path = tmp_path / "submissions.jsonl"
    path.symlink_to(tmp_path / "made-through-the-link")
    with pytest.raises(NotRegularFile):
        append(path, "{}\n")
    assert not (tmp_path / "made-through-the-link").exists()


def test_append_to_a_fifo_is_refused_at_once_with_or_without_a_reader(tmp_path):
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFile, match="FIFO"):  # nobody reads it: would block forever
        append(fifo, "{}\n")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(NotRegularFile, match="FIFO"):
            append(fifo, "{}\n")
    finally:
        os.close(reader)


def test_append_creates_and_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, "a\n")
    append(path, b"b\n", durable=True)
    assert path.read_text() == "a\nb\n"


def test_records_are_not_written_through_a_link(tmp_path, outside):
    path = tmp_path / "events.jsonl"
    path.symlink_to(outside)
    with pytest.raises(UserError, match="symbolic link"):
        JsonLines(path).write({"event": "x"})
    assert outside.read_text() == "the user's own file\n"


def test_appends_from_threads_are_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = JsonLines(path)
    workers = [threading.Thread(target=lambda i=i: [lines.write({"w": i, "n": n}) for n in range(50)]) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    import json
    assert len([json.loads(line) for line in path.read_text().splitlines()]) == 200


def _cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "hpc_ddp", *args], cwd=cwd, capture_output=True, text=True,
                           timeout=180)


def test_the_cli_writes_no_output_through_links_planted_in_a_run_dir(tmp_path, outside):
    """A run dir of ours, with links planted at its default output paths (job.sbatch, submissions, events,
    the pictures), pointing at a file of the user's outside it: render, a local run and the pictures
    replace or refuse them; the user's file keeps its content."""
    (tmp_path / "train.py").write_text("print('trained')\n")
    assert _cli(tmp_path, "render", "--executor", "sbatch", "--run-dir", "run", "train.py").returncode == 0
    run = tmp_path / "run"
    (run / "job.sbatch").unlink()
    (run / "job.sbatch").symlink_to(outside)
    done = _cli(tmp_path, "render", "--executor", "sbatch", "--run-dir", "run", "train.py")
    assert done.returncode == 0, done.stderr
    assert not (run / "job.sbatch").is_symlink() and "#!/bin/bash" in (run / "job.sbatch").read_text()

    local = tmp_path / "local"
    done = _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "local", "train.py")
    assert done.returncode == 0, done.stderr
    for name in ("timeline.png", "training.png"):
        (local / name).symlink_to(outside)
    _cli(tmp_path, "timeline", "local")
    assert not (local / "timeline.png").is_symlink()
    for name in ("events.jsonl", "submissions.jsonl"):
        (local / name).unlink()
        (local / name).symlink_to(outside)
        done = _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "local", "train.py")
        assert done.returncode != 0 and "symbolic link" in done.stderr, done.stderr
        (local / name).unlink()
    assert outside.read_text() == "the user's own file\n"


def test_a_sweep_replaces_a_link_planted_at_sweep_json_and_its_fixed_temp_name(tmp_path, outside):
    (tmp_path / "t.py").write_text("print(1)\n")
    sweep = tmp_path / "sw"
    sweep.mkdir()
    (sweep / ".sweep.json.tmp").symlink_to(outside)   # the temp name it used to write through
    done = _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "sw", "--sweep", "args.x=1,2", "t.py")
    assert done.returncode == 2  # a folder holding a file of someone else's is not a sweep dir hpc-ddp made
    (sweep / ".sweep.json.tmp").unlink()
    assert _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "sw", "--sweep", "args.x=1,2",
                "t.py").returncode == 0
    (sweep / "sweep.json").rename(sweep / "real.json")
    (sweep / "sweep.json").symlink_to(outside)
    _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "sw", "--sweep", "args.x=1,2", "t.py")
    assert outside.read_text() == "the user's own file\n"


def test_a_local_run_replaces_a_link_planted_at_its_pid_file(tmp_path, outside):
    (tmp_path / "t.py").write_text("print('trained')\n")
    assert _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "run", "t.py").returncode == 0
    (tmp_path / "run" / "local.pid").symlink_to(outside)   # a stale name someone planted
    done = _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "run", "t.py")
    assert done.returncode == 0, done.stderr
    assert outside.read_text() == "the user's own file\n" and not (tmp_path / "run" / "local.pid").exists()


def test_rank_logs_are_checked_before_ranks_start_and_drained_if_swapped_later(tmp_path, outside):
    import subprocess as sp

    from hpc_ddp.common import secrets
    from hpc_ddp.launch.executors import local

    (tmp_path / "rank-1.log").symlink_to(outside)
    with pytest.raises(UserError, match="rank-1.log is a symbolic link"):
        local._check_logs(tmp_path, 2)
    proc = sp.Popen([sys.executable, "-c", "print('x' * 100000)"], stdout=sp.PIPE)
    local._pump(proc, tmp_path / "rank-1.log", "", False, secrets.current())  # reads to the end: no blocked rank
    assert proc.wait(timeout=30) == 0 and outside.read_text() == "the user's own file\n"
