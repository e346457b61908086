"""A script that makes its own process group before hpc_ddp.start() (issue 53) was told `MASTER_PORT ... is
already in use HINT: --master-port N`: the port was the script's own group's. It is told what it did."""

from __future__ import annotations

import pytest

from .helpers import hpc_ddp

pytestmark = pytest.mark.e2e

OWN_GROUP = """
import torch.distributed as dist
import hpc_ddp

dist.init_process_group("gloo")
run = hpc_ddp.start()
run.finish()
"""


def test_a_process_group_made_before_start_is_one_line_that_names_it(tmp_path):
    (tmp_path / "own_group.py").write_text(OWN_GROUP)
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--run-dir", "run", "own_group.py",
                   cwd=tmp_path, timeout=180)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-3000:]
    assert "made its own process group (dist.init_process_group) before hpc_ddp.start()" in said, said[-3000:]
    assert "remove the script's own init_process_group" in said and "already in use" not in said
    assert "Traceback" not in said, said[-3000:]
