"""The policy's unit tests never ask a real Slurm: with the test Slurm up (make test), `sacct -j 7` could
answer for one of its own jobs. A test that wants an answer patches `accounted_end` itself."""

import pytest

from hpc_ddp.job import attempts


@pytest.fixture(autouse=True)
def _no_accounting(monkeypatch):
    monkeypatch.setattr(attempts, "accounted_end", lambda job_id, commands=None: None)
