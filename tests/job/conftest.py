"""The policy's unit tests never ask a real Slurm: with the test Slurm up (make test), `sacct -j 7` could
answer for one of its own jobs, and `scontrol --version` would say which test Slurm is up. A test that wants
an answer patches `accounted_end` or `slurm_requeues_after_grace` itself."""

import pytest

from hpc_ddp.job import attempts


@pytest.fixture(autouse=True)
def _no_accounting(monkeypatch):
    monkeypatch.setattr(attempts, "accounted_end", lambda job_id, commands=None: None)
    # As Slurm 22.05 to 23.11 do: a job preempted in its GraceTime is not requeued by Slurm (hpc-ddp does it).
    monkeypatch.setattr(attempts, "slurm_requeues_after_grace", lambda job, attempt, env: False)
    monkeypatch.setattr(attempts, "slurm_job", lambda job_id, run=None: None)  # what resubmit asks by default
