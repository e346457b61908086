"""exitsite/hpc_ddp_warned.py: a time-limit warning that reaches a handler of the program's own is recorded,
so the requeue policy knows that an exit 0 after it was a stop (issue 27)."""

import json
import os
import subprocess
import sys

from hpc_ddp.job.runner import with_exit_guard

PROGRAM = """
import os, signal, sys, time
got = []
mine = lambda s, f: got.append(s)
if sys.argv[1] == "handler":
    previous = signal.signal(signal.SIGUSR2, mine)
    assert previous == signal.SIG_IGN, previous          # what the runner left, as without hpc-ddp
    assert signal.getsignal(signal.SIGUSR2) is mine       # the program sees its own handler
else:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, mine)                       # another signal: untouched
os.kill(os.getpid(), signal.SIGUSR2)
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.2)
print("handled", len(got), flush=True)
"""


def run(tmp_path, mode, **env):
    if not (tmp_path / "events.jsonl").is_symlink():
        (tmp_path / "events.jsonl").write_text("")
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HPC_DDP_EXIT_GUARD")}
    environ.update({"PYTHONPATH": with_exit_guard(None), "HPC_DDP_WARNING_SIGNAL": "USR2",
                    "HPC_DDP_EVENTS_FILE": str(tmp_path / "events.jsonl"), "RANK": "3", "HPC_DDP_JOB_ID": "41"}, **env)
    done = subprocess.run([sys.executable, "-c", "import signal; signal.signal(signal.SIGUSR2, signal.SIG_IGN); "
                           f"import os; os.execv({sys.executable!r}, [{sys.executable!r}, {str(script)!r}, {mode!r}])"],
                          env=environ, capture_output=True, text=True, timeout=60)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return done, events


def test_a_handler_of_the_programs_own_records_the_warning_once(tmp_path):
    done, events = run(tmp_path, "handler")
    assert done.returncode == 0, done.stderr
    assert "handled 2" in done.stdout  # the program's handler ran for both
    assert [(e["event"], e["signal"], e["rank"], e["job_id"]) for e in events] == [("warned", "USR2", "3", "41")]


def test_an_ignored_warning_is_not_recorded(tmp_path):
    done, events = run(tmp_path, "ignore")
    assert done.returncode == 0 and "handled 0" in done.stdout, done.stderr
    assert events == []


def test_a_link_in_place_of_the_events_file_is_not_written_through(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    (tmp_path / "events.jsonl").symlink_to(target)
    done, _ = run(tmp_path, "handler")
    assert done.returncode == 0 and "handled 2" in done.stdout, done.stderr  # the program is not disturbed
    assert target.read_text() == ""
