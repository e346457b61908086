"""Hardening round 4 (issue 43), submit --ssh and the commands forwarded over it: every call that waits on
the cluster has a bound (ssh.Ssh.bounded / Ssh.stream, HPC_DDP_SSH_TIMEOUT_S), an empty --ssh or a
foreground executor with --ssh is refused before anything runs, a link in the mirror's own folder stops the
submit, and what the other side says reaches the terminal through `printable`. A fake `ssh` on PATH plays
the cluster: no network, and a hang costs the 1 s bound, not minutes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hpc_ddp import __version__
from hpc_ddp.common.errors import UserError
from hpc_ddp.remote import forward, ssh
from hpc_ddp.remote.answers import parse_hello
from hpc_ddp.remote.site import site_for

CLI = [sys.executable, "-m", "hpc_ddp"]


@pytest.fixture
def short():
    import shutil
    path = Path(tempfile.mkdtemp(prefix="hd4-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fake_ssh(folder: Path, hang_at: int | None, hello_extra: str = "", stderr: str = "") -> Path:
    """An `ssh` that answers submit --ssh's calls in turn (1 the hello, 2 mkdir, 3 the tar of the files, 4
    the submit, 5 reading the answer back) and hangs at call `hang_at`."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    hello = (f"version=hpc-ddp {__version__}\nrsync=no\ndir={folder}/mirror\nstate=absent\nfree_kb=100000000\n"
             f"writable=yes\n{hello_extra}")
    script = bin_dir / "ssh"
    script.write_text(f"""#!/bin/sh
n=$(cat {folder}/calls 2>/dev/null || echo 0); n=$((n+1)); echo $n > {folder}/calls
cat > {folder}/stdin-$n
if [ "$n" = "{hang_at}" ]; then exec sleep 60; fi
if [ "$n" = 1 ]; then printf '%s' '{hello}'; fi
if [ "$n" = 4 ]; then printf '%s' '{stderr}' >&2; echo '{{"executor": "sbatch", "job_id": "7", "run_dir": "/r/x"}}'; fi
exit 0
""")
    script.chmod(0o755)
    return bin_dir


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    return project


def _submit(tmp_path: Path, short: Path, bin_dir: Path, *args: str, bound: str = "1", timeout: float = 60):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HPC_DDP_SSH_TIMEOUT_S": bound,
           "HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), "HPC_DDP_REGISTRY": str(tmp_path / "runs.jsonl"),
           "HPC_DDP_PROFILES": str(tmp_path / "none.toml"), "HOME": str(tmp_path)}
    env.pop("HPC_DDP_PROFILE", None)
    start = time.monotonic()
    done = subprocess.run([*CLI, "submit", *args], cwd=tmp_path / "proj", env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - start


# ------------------------------------------------------------------------------------------------ bounds

@pytest.mark.parametrize("hang_at", [1, 2, 3, 4], ids=["hello", "mkdir", "copy", "submit"])
def test_an_ssh_that_stops_answering_at_any_of_submits_calls_is_one_line_within_the_bound(tmp_path, short, hang_at):
    _project(tmp_path)
    bin_dir = _fake_ssh(tmp_path, hang_at)
    done, took = _submit(tmp_path, short, bin_dir, "--ssh", "c", "train.py")
    assert done.returncode == 2, done.stderr
    assert "connection to c was lost: no answer within 1 s" in done.stderr and len(done.stderr.splitlines()) == 1
    assert "Traceback" not in done.stderr and took < 20


def test_a_submit_that_answers_is_recorded_and_its_stderr_is_shown_not_obeyed(tmp_path, short):
    _project(tmp_path)
    bin_dir = _fake_ssh(tmp_path, None, stderr="note \x1b[2J\u202eevil\n")
    # Not a test of the bound: 1 s ran out once for an ssh that answers at once, on a machine starved of CPU
    done, _ = _submit(tmp_path, short, bin_dir, "--ssh", "c", "train.py", bound="30")
    assert done.returncode == 0, done.stderr
    assert "Submitted job 7" in done.stdout
    assert "\x1b" not in done.stderr and "\u202e" not in done.stderr and "\\x1b[2J\\u202eevil" in done.stderr
    assert json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])["job_id"] == "7"


def test_the_bound_is_a_number_of_seconds(tmp_path, short):
    _project(tmp_path)
    done, _ = _submit(tmp_path, short, _fake_ssh(tmp_path, None), "--ssh", "c", "train.py", bound="abc")
    assert done.returncode == 2 and "HPC_DDP_SSH_TIMEOUT_S='abc' is not a number of seconds" in done.stderr


def test_every_call_is_bounded_in_one_place(tmp_path, short, monkeypatch):
    """run, a command through the connection (rsync, tar, -O forward) and a streamed call (status, cancel)."""
    bin_dir = _fake_ssh(tmp_path, 1)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    box = ssh.Ssh("c", {"HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), "HPC_DDP_SSH_TIMEOUT_S": "0.5"})
    assert "ConnectTimeout=30" in box.options() and "ServerAliveCountMax=4" in box.options()
    for call in (lambda: box.run("true\n"), lambda: box.bounded(["sh", "-c", "exec sleep 60"])):
        start = time.monotonic()
        with pytest.raises(UserError, match="was lost: no answer within 0.5 s"):
            call()
        assert time.monotonic() - start < 10
    (tmp_path / "calls").write_text("0")
    start = time.monotonic()
    with pytest.raises(UserError, match="was lost"):
        forward._pass_through(box, "exec hpc-ddp status /r/x\n")
    assert time.monotonic() - start < 10
    box.close()  # bounded too: a master that hangs is left to end by itself


def test_logs_follow_is_not_cut_by_the_bound(tmp_path, short, monkeypatch):
    bin_dir = _fake_ssh(tmp_path, None)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    box = ssh.Ssh("c", {"HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), "HPC_DDP_SSH_TIMEOUT_S": "0.2"})
    proc = box.stream("true\n")
    ssh.unbounded(proc)
    time.sleep(0.4)
    proc.wait()
    ssh.raise_if_lost(proc)  # the bound was lifted: nothing to say


# ------------------------------------------------------------------------------------- refused up front

@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_ssh_host_is_refused_never_submitted_here(host):
    with pytest.raises(UserError, match="empty host") as err:
        site_for(host, None, {})
    assert "\n" not in str(err.value)


def test_an_empty_ssh_on_the_command_line_submits_nothing_here(tmp_path, short):
    _project(tmp_path)
    done, _ = _submit(tmp_path, short, _fake_ssh(tmp_path, None), "--ssh", "", "--executor", "local",
                      "--dry-run", "train.py")
    assert done.returncode == 2 and "--ssh was given an empty host" in done.stderr and not done.stdout
    assert not (tmp_path / "calls").exists()


@pytest.mark.parametrize("executor", ["local", "srun"])
def test_a_foreground_executor_with_ssh_is_refused_before_any_call(tmp_path, short, executor):
    _project(tmp_path)
    done, _ = _submit(tmp_path, short, _fake_ssh(tmp_path, None), "--ssh", "c", "--executor", executor, "train.py")
    assert done.returncode == 2 and f"--executor {executor} with --ssh would run the job on c's login node" \
        in done.stderr and "HINT" in done.stderr
    assert not (tmp_path / "calls").exists()


def test_a_job_files_local_executor_with_ssh_is_refused(tmp_path, short):
    _project(tmp_path)
    (tmp_path / "proj" / "job.toml").write_text('script = "train.py"\nexecutor = "local"\n')
    done, _ = _submit(tmp_path, short, _fake_ssh(tmp_path, None), "--ssh", "c", "job.toml")
    assert done.returncode == 2 and "the job file's executor local with --ssh" in done.stderr


# ---------------------------------------------------------------------------- the mirror's own folder

@pytest.mark.parametrize("said", ["mark=link", "mark=notdir"])
def test_a_link_in_the_mirrors_own_folder_stops_the_submit_before_anything_is_written(tmp_path, short, said):
    _project(tmp_path)
    done, _ = _submit(tmp_path, short, _fake_ssh(tmp_path, None, hello_extra=said + "\n"), "--ssh", "c", "train.py")
    assert done.returncode == 2 and "nothing is written through it" in done.stderr
    assert (tmp_path / "calls").read_text().strip() == "1"


def test_the_cluster_side_writes_no_file_of_the_mirror_through_a_link(tmp_path):
    """The hello's shell code, run here: a link at .hpc-ddp-mirror/shipped (or the folder itself) is said."""
    from hpc_ddp.remote import submit as remote_submit

    class Run:
        host = "c"

        def run(self, script, **kw):
            done = subprocess.run(["sh", "-s"], input=script.encode(), capture_output=True, check=False)
            return ssh.Done(done.returncode, done.stdout, done.stderr)

    mirror = tmp_path / "m"
    (mirror / remote_submit.MARK).mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", mirror / remote_submit.MARK / "shipped")
    from hpc_ddp.remote.site import Site
    from hpc_ddp.snapshot.gitinfo import Git
    from hpc_ddp.snapshot.listing import list_project
    _project(tmp_path)
    listing = list_project(tmp_path / "proj", git=Git(executable=""))
    with pytest.raises(UserError, match="nothing is written through it"):
        remote_submit._hello(Run(), Site("c", str(mirror), str(Path(sys.executable).parent / "hpc-ddp")), str(mirror),
                             listing, "here:/p")
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ------------------------------------------------------------------------------------ shown, not obeyed

class _Proc:
    def __init__(self, out: bytes, err: bytes) -> None:
        self.stdout, self.stderr = io.BytesIO(out), io.BytesIO(err)

    def wait(self, timeout=None):
        return 0


class _Stream:
    host = "c"
    silence_s = ssh.SILENCE_S

    def __init__(self, out: bytes, err: bytes) -> None:
        self.out, self.err = out, err

    def stream(self, script):
        return _Proc(self.out, self.err)


def test_a_forwarded_status_and_its_stderr_are_shown_through_printable(capsys):
    forward._pass_through(_Stream(b"state \x1b]0;title\x07 \xe2\x80\xae\n", b"warn \x1b[31m\n"), "x")
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\u202e" not in out and "\\x1b]0;title\\x07 \\u202e" in out
    assert "warn \\x1b[31m" in err


def test_a_forwarded_log_is_the_ranks_own_output(capsys):
    forward._pass_through(_Stream(b"\x1b[32mgreen\x1b[0m\n", b""), "x", raw=True)
    assert capsys.readouterr().out == "\x1b[32mgreen\x1b[0m\n"


def test_an_rsync_stopped_by_a_login_banner_names_the_shell_start_up_files(tmp_path, short, monkeypatch):
    from hpc_ddp.remote import submit as remote_submit

    class Box:
        host, timeout_s = "c", 5.0

        def run(self, script, **kw):
            return ssh.Done(0, b"", b"")

        def bounded(self, argv, **kw):
            return ssh.Done(2, b"", b"protocol version mismatch -- is your shell clean?\n(see the rsync manpage for "
                                    b"an explanation)\nrsync error: protocol incompatibility (code 2)\n")

        def rsh(self):
            return "ssh"

    monkeypatch.setattr(remote_submit, "_local_rsync", lambda: "rsync  version 3.2.7  protocol version 31")
    _project(tmp_path)
    from hpc_ddp.snapshot.gitinfo import Git
    from hpc_ddp.snapshot.listing import list_project
    listing = list_project(tmp_path / "proj", git=Git(executable=""))
    with pytest.raises(UserError) as err:
        remote_submit._ship(Box(), parse_hello("dir=/m\nrsync=rsync  version 3.2.7\nversion=x\n"), tmp_path / "proj", listing, "o")
    assert "shell start-up files" in str(err.value) and ".bashrc" in err.value.hint and "\n" not in str(err.value)


def test_rsync_is_bounded_by_what_moves_not_by_the_clock(tmp_path, monkeypatch):
    """A first copy of a big project over a slow link may outlast any one call's bound: rsync runs with no
    wall clock and its own --timeout (no data moved for the bound: exit 30, a lost connection)."""
    from hpc_ddp.remote import submit as remote_submit

    calls = []

    class Box:
        host, timeout_s = "c", 7.0

        def run(self, script, **kw):
            return ssh.Done(0, b"", b"")

        def bounded(self, argv, **kw):
            calls.append((argv, kw.get("timeout")))
            return ssh.Done(0, b"", b"")

        def rsh(self):
            return "ssh"

    monkeypatch.setattr(remote_submit, "_local_rsync", lambda: "rsync  version 3.2.7  protocol version 31")
    _project(tmp_path)
    from hpc_ddp.snapshot.gitinfo import Git
    from hpc_ddp.snapshot.listing import list_project
    listing = list_project(tmp_path / "proj", git=Git(executable=""))
    remote_submit._ship(Box(), parse_hello("dir=/m\nrsync=rsync  version 3.2.7\nversion=x\n"), tmp_path / "proj", listing, "o")
    ((argv, timeout),) = calls
    assert argv[0] == "rsync" and "--timeout=7" in argv and timeout == ssh.SELF_BOUNDED
    assert 30 in remote_submit._DROPPED


# ------------------------------------------------------------------------------------ the registry, hostile

DAMAGED = [{"job_id": "8", "run_dir": "/r/b", "host": ["c"]}, {"job_id": "9", "run_dir": {"a": 1}, "host": "c"},
           {"job_id": "10", "run_dir": "/r/c", "host": "c", "remote_hpc_ddp": "~`id`"},
           {"job_id": "11", "run_dir": "/r/d", "executor": None, "name": None, "slurm": "x"}, [1, 2], "text", None,
           {"job_id": True, "run_dir": "/r/e"}, {"job_id": "12", "run_dir": "/r/f", "values": [1], "task": "x"}]


def test_one_damaged_registry_record_never_stops_list(tmp_path, short):
    registry = tmp_path / "runs.jsonl"
    good = {"job_id": "7", "run_dir": "/r/a", "host": "c", "executor": "sbatch", "name": "train"}
    registry.write_text("".join(json.dumps(r) + "\n" for r in [good, *DAMAGED]))
    bin_dir = _fake_ssh(tmp_path, None)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HPC_DDP_REGISTRY": str(registry),
           "HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), "HPC_DDP_SSH_TIMEOUT_S": "2"}
    done = subprocess.run([*CLI, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "c:/r/a" in done.stdout and "damaged line(s) of the run registry left out" in done.stderr
    assert "Traceback" not in done.stderr and "remote_dir" not in done.stderr


def test_a_bad_remote_hpc_ddp_is_named_as_itself(tmp_path):
    path = tmp_path / "profiles.toml"
    path.write_text('[p]\nssh = "c"\nremote_hpc_ddp = "~`id`/hpc-ddp"\n')
    with pytest.raises(UserError) as err:
        site_for(None, "p", {"HPC_DDP_PROFILES": str(path)})
    assert str(err.value).startswith("remote_hpc_ddp ") and "remote_dir" not in str(err.value)


def test_an_ssh_killed_by_a_signal_here_is_one_line_exit_2(tmp_path, short):
    """Round 5's rerun (issue 53, C12): an ssh that dies of SIGKILL (the OOM killer) made `status HOST:/RUN`
    exit 247 with nothing said."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/sh\ncat >/dev/null\nkill -9 $$\n")
    (bin_dir / "ssh").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HPC_DDP_REGISTRY": str(tmp_path / "runs.jsonl"),
           "HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), "HPC_DDP_SSH_TIMEOUT_S": "20"}
    for command in (["status", "clusterx:/r/x"], ["cancel", "clusterx:/r/x"]):
        done = subprocess.run([*CLI, *command], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (command, done.returncode, done.stderr)
        assert "ssh to clusterx was killed by SIGKILL" in done.stderr and "HINT:" in done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
