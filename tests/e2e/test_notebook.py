"""examples/notebook_ddp.ipynb executed headless in a real Jupyter kernel (nbclient): a tiny model trained by
DDP on 2 local ranks (gloo), rank 0's result printed in the notebook, a failing rank caught by name; and, on
the test Slurm, the same function submitted through submitit with its result back in the notebook. Also
`notebook.submit` straight from Python, with a rank that fails on Slurm."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpc_ddp import notebook
from hpc_ddp.common.errors import UserError

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "notebook_ddp.ipynb"


def run_notebook(env: dict[str, str]) -> str:
    """Execute the notebook in a fresh kernel; every code cell's text output, in order."""
    nbformat = pytest.importorskip("nbformat", reason="the notebook test needs hpc-ddp's [test] extra (nbclient)")
    nbclient = pytest.importorskip("nbclient", reason="the notebook test needs hpc-ddp's [test] extra (nbclient)")
    pytest.importorskip("ipykernel", reason="the notebook test needs hpc-ddp's [test] extra (ipykernel)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return "".join(out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.get("outputs", []))


TRAINED = "{'rank': 0, 'world_size': 2, 'w': 3.0, 'b': 1.0}"


@pytest.mark.e2e
def test_the_notebook_trains_on_two_local_ranks_in_a_real_kernel():
    start = time.monotonic()
    text = run_notebook({"HPC_DDP_NOTEBOOK_SLURM": "0"})
    assert f"rank 0 returned: {TRAINED}" in text, text  # y = 3x + 1 learned, rank 0's value back in the notebook
    assert "[rank 0] step 100: loss 0.0000" in text
    assert "caught RankError from rank 1: rank 1 of 2 raised ValueError: rank 1 gave up at step 7" in text
    assert "no Slurm here: skipped" in text
    assert time.monotonic() - start < 60


@pytest.mark.e2e
@pytest.mark.slurm
def test_the_notebook_submits_the_same_function_to_slurm(slurm_conf, tmp_path):
    text = run_notebook({"HPC_DDP_NOTEBOOK_SLURM": "1", "HPC_DDP_NOTEBOOK_RUN_DIR": str(tmp_path / "run")})
    assert f"rank 0 on Slurm returned: {TRAINED}" in text, text
    rank0_log = next((tmp_path / "run" / "submitit").glob("*/*_0_log.out"))  # submitit's, of task 0
    assert "step 100: loss 0.0000" in rank0_log.read_text()


def crash_on_rank_1():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1":
        time.sleep(1)
        raise ValueError("rank 1 gave up on Slurm")
    dist.barrier()  # rank 0 waits for rank 1 in a collective, and loses it
    return "unreachable"


@pytest.mark.e2e
@pytest.mark.slurm
def test_submit_names_the_rank_that_failed_on_slurm(slurm_conf, tmp_path):
    job = notebook.submit(crash_on_rank_1, nodes=2, tasks_per_node=1, partition="debug", time=5,
                          run_dir=tmp_path / "run")
    with pytest.raises(notebook.RankError) as caught:
        job.result(timeout=120)
    assert caught.value.rank == 1 and caught.value.type == "ValueError"
    assert str(caught.value).splitlines()[0] == "rank 1 of 2 raised ValueError: rank 1 gave up on Slurm"
    assert "in crash_on_rank_1" in caught.value.traceback
    assert job.state() == "FAILED"
    assert "Connection closed by peer" in str(caught.value)  # rank 0, named after it, as the peer that lost it
    with pytest.raises(UserError, match="already holds a call"):
        notebook.submit(crash_on_rank_1, partition="debug", run_dir=tmp_path / "run")
