"""The CLI stays light: importing it and every command's --help load neither torch, torchvision,
matplotlib nor submitit (they cost seconds on a login node, and matplotlib is an extra). Run in a fresh
interpreter, since this test process may have imported them already."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "torchvision", "matplotlib", "submitit")

CHECK = """
import json, sys
from hpc_ddp.cli import cli
loaded = {"import": [m for m in HEAVY if m in sys.modules]}
for command in COMMANDS:
    try:
        cli.main([*command.split(), "--help"], prog_name="hpc-ddp")
    except SystemExit as exc:
        assert exc.code == 0, (command, exc.code)
    loaded[command] = [m for m in HEAVY if m in sys.modules]
print(json.dumps(loaded), file=sys.stderr)
"""


def test_the_cli_and_its_help_import_nothing_heavy(tmp_path):
    from hpc_ddp.cli import cli

    commands = ["", *sorted(cli.commands), "completion bash"]
    code = f"HEAVY = {HEAVY!r}\nCOMMANDS = {commands!r}\n{CHECK}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stderr.strip().splitlines()[-1])
    assert {k: v for k, v in loaded.items() if v} == {}
    assert {"import", "", "submit", "status", "list", "logs", "cancel", "preempt"} <= set(loaded)


def test_list_and_status_of_nothing_import_nothing_heavy(tmp_path):
    code = (f"import sys\nfrom hpc_ddp.cli import cli\nfor args in (['list'], ['list', '--json'], ['status']):\n"
            f"    try:\n        cli.main(args, prog_name='hpc-ddp')\n    except SystemExit:\n        pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"HPC_DDP_REGISTRY": str(tmp_path / "none.jsonl"), "PATH": "/usr/bin:/bin"})
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr
