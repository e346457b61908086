"""docs/frameworks.md's compatibility table (issue 27), checked cell by cell.

Each framework or script shape leaves in its own way when a stop reaches it (the exit code below, as the
e2e runs in tests/e2e/test_frameworks.py recorded it). For every column, that exit code and Slurm's state
at the attempt's end, as measured on Slurm 22.05 (test_attempts.SHOW_JOB), go through the real requeue
policy (`attempts.finish`); the page's symbol must be what it decides. Cells proven end to end on the test
Slurm name their test; the page may not claim an e2e test that does not exist.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_attempts import SHOW_JOB  # tests/job is on sys.path (pytest prepends it)

from hpc_ddp.job import attempts
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "frameworks.md"
MARKER = "<!-- every cell checked by tests/job/test_compat_table.py -->"

# row -> exit code when SIGTERM reaches it at preemption / at the hard limit / at scancel; and at Slurm's
# SIGKILL for one that ignores SIGTERM
EXIT_AT_SIGTERM = {
    "Lightning Trainer (`pytorch_lightning`, `lightning`)": 0,   # "Bypassing SIGTERM", SystemExit with no code
    "Lightning Fabric loop": 143,
    "Hugging Face Trainer": 143,
    "accelerate loop": 143,
    "script that traps SIGTERM, saves, exits 0": 0,
    "script that ignores SIGTERM": 137,                            # Slurm's SIGKILL after the grace time
    "script that does nothing": 143,
    "script that handles the warning itself, saves, exits 0": 143,
}
# rows whose program has a handler of its own for the warning signal: it leaves with exit 0 when warned
HANDLES_WARNING = {"script that handles the warning itself, saves, exits 0"}
COLUMNS = {  # column -> Slurm's state at the attempt's end (None: no decision, the warning is ignored)
    "preempted, GraceTime 0": "preempt_no_grace",
    "preempted, GraceTime > 0": "preempt_grace",
    "time-limit warning": None,
    "hard time limit": "time_limit",
    "scancel": "scancel",
}
SYMBOL = {"requeued": "↻S", "requeue": "↻", "stop:cancelled": "✗", "requeue:time_limit": "↻T"}


def _decide(tmp_path: Path, exit_code: int, state: str, warned: bool = False) -> str:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{exit_code}-{state}-", dir=tmp_path))
    spec = build_spec([Layer("c", {})], target=Target("script", "/t.py"), workdir="/", python="p")
    (run_dir / "spec.json").write_text(json.dumps(spec.to_dict()))
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": "" if state == "preempt_grace" else "TERM"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    if warned:  # what exitsite/hpc_ddp_warned.py appends when the warning reaches the program's handler
        with open(run_dir / "events.jsonl", "a") as fh:
            fh.write(json.dumps({"event": "warned", "signal": "USR2", "rank": "0"}) + "\n")
    slurm = attempts.parse_show_job(SHOW_JOB[state])
    outcome = attempts.finish(run_dir, 0, exit_code, env, ask_slurm=lambda _job: slurm)
    cause = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "attempt_end"][-1]["cause"]
    if outcome.word == "stop":
        return SYMBOL["stop:" + cause]
    if cause == "time_limit":
        return SYMBOL["requeue:time_limit"]
    assert cause == "preempted"
    return SYMBOL[outcome.word]


def _table() -> dict[str, dict[str, str]]:
    text = PAGE.read_text()
    assert MARKER in text, f"docs/frameworks.md has no compatibility table under {MARKER}"
    lines = text.split(MARKER, 1)[1].strip().split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:]))
    return rows


def test_every_cell_is_what_the_policy_decides(tmp_path):
    table = _table()
    assert set(table) == set(EXIT_AT_SIGTERM)
    for row, exit_code in EXIT_AT_SIGTERM.items():
        assert set(table[row]) == set(COLUMNS), row
        for column, state in COLUMNS.items():
            cell = table[row][column]
            if state is None:  # the warning: ignored, or (a handler of its own) exit 0 while Slurm shows nothing
                expected = _decide(tmp_path, 0, "own_crash", warned=True) if row in HANDLES_WARNING else "—"
            else:
                expected = _decide(tmp_path, exit_code, state)
            assert cell.split()[0] == expected, (row, column, cell, expected)


def test_the_e2e_tests_the_table_names_exist():
    section = PAGE.read_text().split(MARKER, 1)[1]
    named = set(re.findall(r"\[(e\d)\]", section.split("\n\n", 1)[0]))
    notes = {key: (path, test) for key, path, test in
             re.findall(r"^\[(e\d)\]: `(tests/e2e/\S+\.py)::(\w+)`", section, re.M)}
    assert named and named <= set(notes), (named, notes)
    for ref in named:
        path, test = notes[ref]
        assert f"def {test}(" in (REPO / path).read_text(), notes[ref]


def test_the_warning_signal_is_ignored_by_a_program_without_a_handler(tmp_path):
    """The time-limit warning column: the runner sets SIGUSR2 (the default --signal) to 'ignore' before it
    execs the program, so a framework that has no handler for it runs on to the hard limit."""
    script = tmp_path / "warned.py"
    script.write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGUSR2)\ntime.sleep(0.2)\n"
                      "print('still running after SIGUSR2', flush=True)\n")
    spec = build_spec([Layer("flags", {})], target=Target("script", str(script), ()), workdir=str(tmp_path),
                      python=sys.executable)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.job.runner", str(tmp_path / "spec.json")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "still running after SIGUSR2" in done.stdout, done.stderr


@pytest.mark.parametrize("state", ["preempt_no_grace", "admin_requeue"])
def test_lightning_auto_requeue_on_usr1_is_one_requeue(tmp_path, state):
    """With --signal USR1, Lightning's own handler saves hpc_ckpt_N.ckpt at the warning and runs
    `scontrol requeue` itself; Slurm shows the job requeued (Restarts + 1) when the batch shell asks, so
    hpc-ddp records it and does not requeue a second time."""
    assert _decide(tmp_path, 0, state) == "↻S"
