"""Imports point down: cli -> launch -> job/trainer/data -> spec/slurm/common. Code that runs on compute
nodes (job, trainer, data) and the layers under it never import the launcher or the CLI, not even inside
a function: a compute node may have only what the ranks need, and the launcher's code is not theirs."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_ddp"
# package -> the packages above it, which it must not import
ABOVE = {
    "common": ("hpc_ddp.launch", "hpc_ddp.cli", "hpc_ddp.remote", "hpc_ddp.job", "hpc_ddp.trainer", "hpc_ddp.data"),
    "slurm": ("hpc_ddp.launch", "hpc_ddp.cli", "hpc_ddp.remote", "hpc_ddp.job", "hpc_ddp.trainer", "hpc_ddp.data"),
    "spec": ("hpc_ddp.launch", "hpc_ddp.cli", "hpc_ddp.remote", "hpc_ddp.job", "hpc_ddp.trainer"),
    "job": ("hpc_ddp.launch", "hpc_ddp.cli", "hpc_ddp.remote"),
    "trainer": ("hpc_ddp.launch", "hpc_ddp.cli", "hpc_ddp.remote"),
    "data": ("hpc_ddp.launch", "hpc_ddp.cli", "hpc_ddp.remote"),
    "launch": ("hpc_ddp.cli", "hpc_ddp.remote"),
    "remote": ("hpc_ddp.cli",),
}


# Known, and left for its own change: building a spec asks whether the ranks' Python has debugpy
# (--debug-rank), through the job side's probe; the probe belongs at the CLI's edge.
KNOWN = {"spec/jobspec.py imports hpc_ddp.job.debugger"}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_imports_point_down():
    offenders = []
    for package, above in ABOVE.items():
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for line, name in _imports(path):
                if name.startswith(above) and f"{path.relative_to(PACKAGE)} imports {name}" not in KNOWN:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert offenders == []
