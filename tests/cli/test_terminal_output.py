"""What hpc-ddp prints for people is shown, never obeyed (issue 30): control characters from a hostile
sweep.json, events.jsonl or a name reach the terminal as visible escapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc_ddp.common.terminal import printable


@pytest.mark.parametrize("raw, shown", [
    ("\x1b[2J", "\\x1b[2J"), ("a\rb", "a\\x0db"), ("\x9b31m", "\\x9b31m"), ("\x07\x00\x7f", "\\x07\\x00\\x7f"),
    ("evil\u202etxt.py", "evil\\u202etxt.py"), ("tab\tand\nnewline", "tab\tand\nnewline"), ("ünïcode ✓", "ünïcode ✓"),
])
def test_printable_escapes_controls_and_keeps_text(raw, shown):
    assert printable(raw) == shown


def _cli(cwd, *args):
    return subprocess.run([sys.executable, "-m", "hpc_ddp", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180)


def test_status_of_a_sweep_and_a_run_shows_control_characters_escaped(tmp_path):
    (tmp_path / "t.py").write_text("print('hi')\n")
    assert _cli(tmp_path, "submit", "--executor", "local", "--run-dir", "sw", "--sweep", "args.name=a,b",
                "t.py").returncode == 0
    path = tmp_path / "sw" / "sweep.json"
    sweep = json.loads(path.read_text())
    sweep["tasks"][0]["values"] = {"args.name": "\x1b[2J\x1b]0;pwned\x07"}
    path.write_text(json.dumps(sweep))
    with open(tmp_path / "sw" / "task-1" / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "attempt_end", "attempt": 0, "reason": "\x1b[31mred\r", "time": 1}) + "\n")
    for target in ("sw", "sw/task-1"):
        done = _cli(tmp_path, "status", target)
        assert done.returncode == 0, done.stderr
        assert "\x1b" not in done.stdout and "\r" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b[2J" in _cli(tmp_path, "status", "sw").stdout


def test_an_error_quoting_a_hostile_name_is_one_line_without_controls(tmp_path):
    done = _cli(tmp_path, "status", "no\x1b[2Jsuch\nrun")
    assert done.returncode == 2
    assert "\x1b" not in done.stderr and done.stderr.count("\n") == 1
