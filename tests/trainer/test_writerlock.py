"""One rank 0 per run dir on a host (issue 53): mp.spawn children that each call hpc_ddp.start() under one
task all became "rank 0 of 1" and wrote one run dir together (step-4, step-4-r1, two finish records)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from hpc_ddp.trainer.writerlock import WriterLock, lock_path


def _hold_then_report(run_dir: str, folder: str, ready, done) -> None:
    lock = WriterLock(run_dir, folder)
    assert lock.acquire() is None
    ready.set()
    done.wait(30)
    lock.release()


def test_a_second_process_is_refused_with_the_holder_s_pid_and_gets_it_once_released(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_then_report, args=(str(tmp_path / "run"), str(tmp_path), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        assert WriterLock(str(tmp_path / "run"), str(tmp_path)).acquire() == holder.pid
        assert WriterLock(str(tmp_path / "other-run"), str(tmp_path)).acquire() is None  # another run dir
    finally:
        done.set()
        holder.join(30)
    mine = WriterLock(str(tmp_path / "run"), str(tmp_path))
    assert mine.acquire() is None
    mine.release()
    assert not os.path.exists(mine.path)  # removed: the file it made and held


def test_the_same_process_may_start_again_and_a_killed_holder_leaves_no_lock(tmp_path):
    first = WriterLock(str(tmp_path / "run"), str(tmp_path))
    assert first.acquire() is None
    assert WriterLock(str(tmp_path / "run"), str(tmp_path)).acquire() is None  # a notebook's second start()
    first.release()
    code = ("import os, signal, sys\nfrom hpc_ddp.trainer.writerlock import WriterLock\n"
            f"assert WriterLock({str(tmp_path / 'run')!r}, {str(tmp_path)!r}).acquire() is None\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", code], check=False)
    assert WriterLock(str(tmp_path / "run"), str(tmp_path)).acquire() is None  # the kernel let it go


def test_a_lock_file_that_is_not_ours_or_a_link_is_never_a_refusal(tmp_path):
    path = lock_path(str(tmp_path / "run"), str(tmp_path))
    os.symlink(tmp_path / "elsewhere", path)
    assert WriterLock(str(tmp_path / "run"), str(tmp_path)).acquire() is None
    assert not (tmp_path / "elsewhere").exists()  # never followed, nothing written through it


MP_SPAWN_SCRIPT = """
import sys, time
import torch.multiprocessing as mp
import hpc_ddp

def child(i):
    run = hpc_ddp.start(sys.argv[1])
    time.sleep(5)  # training: both children at once
    run.finish()

if __name__ == "__main__":
    mp.spawn(child, nprocs=2)
"""


@pytest.mark.timeout(240)
def test_two_mp_spawn_children_that_each_start_a_session_are_refused_not_written_twice(tmp_path):
    """What the mp.spawn refusal suggests under --tasks-per-node 1, each child calling start(): one becomes
    rank 0 and the other is refused in one line; the run dir gets one finish record."""
    (tmp_path / "spawned.py").write_text(MP_SPAWN_SCRIPT)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    done = subprocess.run([sys.executable, "spawned.py", str(run)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200)
    said = done.stdout + done.stderr
    assert "is rank 0 of the run in" in said and "two writers would interleave" in said, said[-3000:]
    finishes = [line for line in (run / "events.jsonl").read_text().splitlines() if '"finish"' in line]
    assert len(finishes) <= 1, finishes


def test_a_child_left_holding_the_lock_after_its_writer_died_is_no_writer(tmp_path):
    """rank 0 killed while a DataLoader worker it forked lives on: the worker shares the lock, but the pid in
    the file is gone, so the next attempt's rank 0 on this node is not refused."""
    code = ("import os, signal, time\nfrom hpc_ddp.trainer.writerlock import WriterLock\n"
            f"assert WriterLock({str(tmp_path / 'run')!r}, {str(tmp_path)!r}).acquire() is None\n"
            "if os.fork() == 0:\n    time.sleep(5)\n    os._exit(0)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert WriterLock(str(tmp_path / "run"), str(tmp_path)).acquire() is None
