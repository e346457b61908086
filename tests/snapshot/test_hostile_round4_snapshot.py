"""Hardening round 4 (issue 43), the snapshot's git: a file git opens that is a FIFO and that no check could
name beforehand (a file an include.path names, a .gitignore in an untracked folder) ends git at once and
refuses the submit in one line; any other git is bounded by HPC_DDP_GIT_TIMEOUT_S. Neither falls back to a
walk that would copy what git ignores."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.snapshot import gitinfo
from hpc_ddp.snapshot.gitinfo import Git


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def _repo(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text("print(1)\n")
    (root / ".gitignore").write_text("secret.txt\n")
    (root / "secret.txt").write_text("ignored\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "init")
    return root


def _submit(root: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--dry-run", "--executor", "local", "train.py"],
                          cwd=root, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("where", ["include.path", "includeIf.gitdir"])
def test_an_include_path_that_names_a_fifo_is_one_line_at_once(tmp_path, where):
    root = _repo(tmp_path / "proj")
    os.mkfifo(tmp_path / "inc")
    key = "include.path" if where == "include.path" else f"includeIf.gitdir:{root}/.git.path"
    _git(root, "config", key, str(tmp_path / "inc"))
    started = time.monotonic()
    done = _submit(root)
    assert time.monotonic() - started < 30
    assert done.returncode == 2, done.stderr
    assert f"{tmp_path / 'inc'}, a FIFO where git reads its rules or configuration" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_git_that_does_not_finish_within_its_bound_is_one_line(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "git"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HPC_DDP_GIT_TIMEOUT_S", "0.5")
    started = time.monotonic()
    with pytest.raises(gitinfo.GitWaits, match="did not finish within 0.5 s"):
        Git(executable=str(fake)).toplevel(tmp_path)
    assert time.monotonic() - started < 10


def test_the_git_bound_is_a_number(monkeypatch, tmp_path):
    monkeypatch.setenv("HPC_DDP_GIT_TIMEOUT_S", "soon")
    with pytest.raises(gitinfo.UserError, match="HPC_DDP_GIT_TIMEOUT_S='soon'"):
        Git().toplevel(tmp_path)


def test_a_git_that_answers_is_not_slowed(tmp_path):
    root = _repo(tmp_path / "proj")
    started = time.monotonic()
    for _ in range(10):
        assert Git().toplevel(root) == root
    assert time.monotonic() - started < 10
