"""A library's trace after hpc-ddp's own line stays in the rank log, out of the terminal (issue 42, item 13)."""

import os
import subprocess
import sys

from hpc_ddp.launch.tracefilter import Stop, TerminalFilter

TRACE = ["[W1127 16:00:00.123456 4242 torch/csrc/distributed/c10d/TCPStore.cpp:122] [c10d] recvValue failed on "
         "SocketImpl(fd=5): Connection reset by peer\n",
         "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:670 (most recent call "
         "first):\n",
         *[f"frame #{i}: <unknown function> + 0x{i:x} (0x7f in /lib/libtorch_cpu.so)\n" for i in range(28)],
         "\n"]


def _shown(lines):
    shown = TerminalFilter("/r/logs/rank-1.log")
    out = [x for line in lines for x in shown.feed(line)]
    return out + list(shown.close())


def test_a_trace_after_our_stop_line_is_one_note():
    out = _shown(["step 10\n", "hpc-ddp: stop requested (SIGUSR2, preempted); checkpointing at step 31\n", *TRACE,
                  "bye\n"])
    assert out[:2] == ["step 10\n", "hpc-ddp: stop requested (SIGUSR2, preempted); checkpointing at step 31\n"]
    assert out[2].startswith("hpc-ddp: 31 lines of a library's trace after the stop") and "rank-1.log" in out[2]
    assert out[3:] == ["bye\n"]


def test_torchs_other_log_line_forms_are_the_trace_too():
    lines = ["[rank1]:[W1127 16:00:00.123456789 TCPStore.cpp:122] [c10d] recvValue failed: Connection reset by peer\n",
             "[W1127 16:00:00.123456789 ProcessGroupNCCL.cpp:1500] Failed to check the \"should dump\" flag\n"]
    out = _shown(["hpc-ddp: stop requested\n", *lines])
    assert len(out) == 2 and "2 lines of a library's trace" in out[1]


def test_a_trace_at_the_end_of_the_output_is_one_note():
    out = _shown(["hpc-ddp: checkpointed\n", *TRACE])
    assert len(out) == 2 and "left out here" in out[1]


def test_a_trace_before_any_stop_line_is_the_failure_and_shown_whole():
    assert _shown(TRACE) == TRACE
    resumed = ["hpc-ddp: resumed from /r/checkpoints/step-000000031 (step 31)\n", *TRACE]
    assert _shown(resumed) == resumed  # a crash after the resume line is no stop
    py = ["hpc-ddp: stop requested\n", "Traceback (most recent call last):\n", '  File "t.py", line 1\n', "E: x\n"]
    assert _shown(py) == py  # a Python traceback is the program's


def test_rank_0s_stop_line_counts_for_the_trace_of_rank_1():
    stop = Stop()
    rank0, rank1 = TerminalFilter("/r/rank-0.log", stop), TerminalFilter("/r/rank-1.log", stop)
    assert list(rank0.feed("hpc-ddp: stop requested (SIGUSR2, preempted); checkpointing at step 31\n"))
    out = [x for line in TRACE for x in rank1.feed(line)] + list(rank1.close())
    assert len(out) == 1 and "rank-1.log" in out[0]


def test_the_local_executor_keeps_the_trace_in_the_log_only(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import sys\nprint('hpc-ddp: stop requested (SIGUSR2, preempted); checkpointing at step 3')\n"
                      f"sys.stdout.write({''.join(TRACE)!r})\nprint('done')\n")
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--run-dir", "run",
                           "t.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HPC_DDP_PROFILES": str(tmp_path / "p.toml")})
    assert done.returncode == 0, done.stderr
    assert "frame #" not in done.stdout and "recvValue" not in done.stdout
    assert "[rank 0] hpc-ddp: 31 lines of a library's trace after the stop, left out here:" in done.stdout
    assert "[rank 0] done" in done.stdout
    (log,) = (tmp_path / "run" / "logs").rglob("rank-0.log")
    assert "frame #27:" in log.read_text() and "recvValue" in log.read_text()
