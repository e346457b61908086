"""docs/cli.md's table of bounds says the code's numbers: each row names its constant, and the bound it
states is that constant's value (issue 53: every wait has a bound, in one table)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
MARK = "<!-- each row's constant checked by tests/test_bounds_table.py -->"


def _rows() -> list[tuple[str, str]]:
    text = DOC.read_text()
    lines = text[text.index(MARK):].splitlines()[3:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[1], cells[3].strip("`")))
    return rows


def _value(dotted: str) -> float:
    module, _, name = dotted.rpartition(".")
    return float(getattr(importlib.import_module(module), name))


def test_every_bound_in_the_table_is_the_constant_it_names():
    rows = _rows()
    assert len(rows) >= 15
    for bound, constant in rows:
        stated = float(re.match(r"([\d.]+)", bound).group(1))
        assert stated == _value(constant), (bound, constant)


def test_the_ssh_keep_alives_the_docs_state_are_the_ones_given_to_ssh():
    import tempfile

    from hpc_ddp.remote.ssh import Ssh

    with tempfile.TemporaryDirectory(prefix="hb-", dir="/tmp") as short:  # a socket's path must be short
        options = " ".join(Ssh("c", {"HPC_DDP_SSH_CONTROL_DIR": f"{short}/c"}).options())
    assert "ServerAliveInterval=15" in options and "ServerAliveCountMax=4" in options
    assert "(every 15 s, 4 missed)" in " ".join(DOC.read_text().split())
