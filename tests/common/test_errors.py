"""One translation of an error into a line and an exit code, at every process boundary."""

from __future__ import annotations

import pytest

from hpc_ddp.common.errors import HpcDdpError, SpecError, UserError, report


@pytest.mark.parametrize("exc,code,line", [
    (SpecError("--nodes: must be >= 1", hint="pass --nodes 1 or more"), 2,
     "hpc-ddp: error: --nodes: must be >= 1 HINT: pass --nodes 1 or more"),
    (UserError("no runs recorded yet"), 2, "hpc-ddp: error: no runs recorded yet"),
    (HpcDdpError("sbatch could not reach Slurm"), 1, "hpc-ddp: error: sbatch could not reach Slurm"),
    (PermissionError(13, "Permission denied", "/runs/x"), 1,
     "hpc-ddp: error: [Errno 13] Permission denied: '/runs/x'"),
])
def test_ours_and_the_environments_errors_are_one_line(capsys, monkeypatch, exc, code, line):
    monkeypatch.delenv("HPC_DDP_DEBUG", raising=False)
    assert report(exc) == code
    assert capsys.readouterr().err == line + "\n"


def test_a_bug_is_named_as_internal_with_the_traceback_only_where_asked(capsys, monkeypatch):
    monkeypatch.delenv("HPC_DDP_DEBUG", raising=False)
    try:
        raise KeyError("spam")
    except KeyError as exc:
        assert report(exc, "hpc-ddp runner") == 1
        err = capsys.readouterr().err
        assert err == ("hpc-ddp runner: error: internal error: KeyError: 'spam' "
                       "(set HPC_DDP_DEBUG=1 for the traceback)\n")
        assert report(exc, "hpc-ddp train", traceback_for_bugs=True) == 1
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err
        assert err.endswith("hpc-ddp train: error: internal error: KeyError: 'spam'\n")


def test_secrets_in_the_line_are_masked(capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-value-123456")
    report(UserError("bad value s3cr3t-value-123456"))
    assert "s3cr3t" not in capsys.readouterr().err
