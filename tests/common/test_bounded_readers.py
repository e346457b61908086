"""Records and rank logs are read only from regular files, and in bounded amounts (issue 30's hangs and
MemoryError): a FIFO, a device or a giant file in their place is refused or skipped at once, never waited
on, never read into memory whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.watch import status


def test_records_through_a_link_to_a_regular_file_are_read(tmp_path):
    (tmp_path / "real.jsonl").write_text('{"a": 1}\n{"torn": \n{"b": 2}\n')
    os.symlink(tmp_path / "real.jsonl", tmp_path / "link.jsonl")
    assert read_jsonl(tmp_path / "link.jsonl") == [{"a": 1}, {"b": 2}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


@pytest.mark.parametrize("make", ["fifo", "zero", "dir"])
def test_a_fifo_a_device_or_a_folder_in_place_of_records_is_refused_at_once(tmp_path, make):
    path = tmp_path / "events.jsonl"
    if make == "fifo":
        os.mkfifo(path)
    elif make == "zero":
        os.symlink("/dev/zero", path)
    else:
        path.mkdir()
    with pytest.raises((UserError, IsADirectoryError)) as err:
        read_jsonl(path)
    if make != "dir":
        assert "not a file of records" in str(err.value)


def test_records_bigger_than_the_limit_are_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' * 100)
    with pytest.raises(UserError, match="more than the 100 hpc-ddp reads"):
        read_jsonl(path, limit=100)


def _log(run_dir, text: bytes, rank: int = 0):
    path = run_dir / "logs" / "job-1" / "attempt-0" / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return path


def test_a_log_is_read_in_bounded_chunks_and_gives_the_same_lines(tmp_path, monkeypatch):
    text = b"".join(f"line {n} ".encode() + b"x" * (n % 37) + b"\n" for n in range(300)) + b"tail without newline"
    _log(tmp_path, text)
    whole = list(status.new_log_entries(tmp_path, None, {}))
    monkeypatch.setattr(status, "_LOG_CHUNK", 64)
    offsets: dict[str, int] = {}
    chunked = list(status.new_log_entries(tmp_path, None, offsets))
    assert [e.text for e in chunked] == [e.text for e in whole] and len(whole) == 301
    assert [e.end for e in chunked] == [e.end for e in whole] and list(offsets.values()) == [len(text)]
    long = b"y" * 200 + b"\n"   # a line longer than a chunk comes in pieces, none lost
    _log(tmp_path, long, rank=1)
    pieces = [e.text for e in status.new_log_entries(tmp_path, 1, {})]
    assert "".join(p.removeprefix("[attempt 0 rank 1] ") for p in pieces) == "y" * 200


def test_a_fifo_for_a_rank_log_is_skipped_not_waited_on(tmp_path):
    _log(tmp_path, b"first\n", rank=0)
    fifo = tmp_path / "logs" / "job-1" / "attempt-0" / "rank-1.log"
    os.mkfifo(fifo)
    assert [e.text for e in status.new_log_entries(tmp_path, None, {})] == ["[attempt 0 rank 0] first"]


def test_status_of_a_run_dir_with_a_fifo_for_its_events_is_one_line_not_a_hang(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps({}))
    (run / "submissions.jsonl").write_text(json.dumps({"job_id": "1", "executor": "local"}) + "\n")
    os.mkfifo(run / "events.jsonl")
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "status", str(run)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "events.jsonl is a FIFO, not a file of records" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def _dry_run(cwd, *args, env=None):
    return subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--dry-run", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_a_fifo_for_the_job_file_is_one_line_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "job.toml")
    done = _dry_run(tmp_path, "job.toml")
    assert done.returncode == 2 and "is a FIFO, not a regular file" in done.stderr, done.stderr


def test_a_fifo_for_the_profiles_file_is_one_line_not_a_hang(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    os.mkfifo(tmp_path / "profiles.toml")
    done = _dry_run(tmp_path, "--profile", "gpu", "t.py", env={"HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")})
    assert done.returncode == 2 and "profiles file" in done.stderr and "FIFO" in done.stderr, done.stderr


def test_a_job_file_of_more_than_16_mb_is_refused_unread(tmp_path):
    with open(tmp_path / "job.toml", "w") as fh:
        fh.write('script = "t.py"\n')
        fh.write("# padding\n" * (2 << 20))
    done = _dry_run(tmp_path, "job.toml")
    assert done.returncode == 2 and "more than the 16,777,216 it can be" in done.stderr, done.stderr


def test_a_job_file_through_a_link_is_read(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    (tmp_path / "real.toml").write_text('script = "t.py"\n')
    (tmp_path / "job.toml").symlink_to(tmp_path / "real.toml")   # a dotfile manager's link is followed
    assert _dry_run(tmp_path, "--executor", "local", "job.toml").returncode == 0
