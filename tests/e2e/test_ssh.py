"""From a laptop, over a real sshd (tests/cluster/sshd-up.sh: Debian's sshd on 127.0.0.1:2222, the Unix user
`hpcremote` as the cluster account, key auth) to the test Slurm: submit ships the project and queues the
job as the cluster account, it survives a real preemption, and status, logs (-f across a killed
connection), timeline, list and cancel work from the laptop; one ssh login for all of it, counted in the
sshd's log. Then every way it can fail: one line, exit 2, nothing submitted, nothing half-done."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.data.datagen import write_mnist
from hpc_ddp.snapshot import snapshot
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import list_project

from .helpers import SLOW_MODEL, hpc_ddp, job_field, last_step, release_when_requeued, wait_until
from .test_frameworks import _preempt_all, _wait_done

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main"]

# torchrun-style: records what ran, goes on from its progress file, saves and leaves at SIGTERM/SIGUSR2.
TRAIN = """
import json, os, signal, sys, time
import torch, torch.distributed as dist
import consts

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
progress = os.path.join(out, "progress.json")
dist.init_process_group("gloo")
start = json.load(open(progress))["step"] if os.path.exists(progress) else 0
if dist.get_rank() == 0:
    print(f"start at step {start} value {consts.VALUE}", flush=True)
    with open(os.path.join(out, "records.jsonl"), "a") as fh:
        fh.write(json.dumps({"value": consts.VALUE, "start": start, "file": __file__}) + "\\n")
stop = []
for sig in (signal.SIGTERM, signal.SIGUSR2):
    signal.signal(sig, lambda *_: stop.append(1))
for step in range(start, 40):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.25)
    if dist.get_rank() == 0:
        with open(progress + ".tmp", "w") as fh:
            json.dump({"step": step + 1}, fh)
        os.replace(progress + ".tmp", progress)
    flag = torch.tensor([float(bool(stop))])
    dist.all_reduce(flag)
    if flag.item():
        sys.exit(0)
dist.destroy_process_group()
"""

COUNT = """
import os, time
for n in range(50):
    print(f"n {n}", flush=True)
    time.sleep(0.2)
time.sleep(float(os.environ.get("SLEEP", "0")))
"""


def _git(root: Path, *args: str) -> None:
    subprocess.run([*GIT, *args], cwd=root, check=True, capture_output=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The sshd and the cluster account; the laptop's environment for hpc-ddp (its own ssh_config, control
    folder, profiles and registry); the cluster side's test folder, removed afterwards."""
    conf = os.environ.get("SLURM_CONF")
    if not conf or not Path(conf).exists() or not shutil.which("sbatch"):
        pytest.skip("the test Slurm is not up here (run `make slurm-up` or `make test`)")
    if os.geteuid() != 0:
        pytest.skip("the sshd and its second Unix user are set up as root (make test runs as root in CI)")
    up = subprocess.run(["bash", str(REPO / "tests/cluster/sshd-up.sh")], capture_output=True, text=True,
                        env={**os.environ, "HPC_DDP_REMOTE_PYTHON": sys.executable}, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    said = dict(word.split("=", 1) for word in up.stdout.strip().splitlines()[-1].removeprefix("export ").split())
    root = Path(said["HPC_DDP_SSHD_ROOT"])
    user = said["HPC_DDP_REMOTE_USER"]
    home = Path(os.path.expanduser(f"~{user}"))
    tag = f"hpcddp-tests/{uuid.uuid4().hex[:8]}"
    laptop = tmp_path_factory.mktemp("laptop")
    control = Path(f"/tmp/hpcddp-ctl-{uuid.uuid4().hex[:8]}")   # a short path: a socket's must fit 104 bytes
    control.mkdir(mode=0o700)
    profiles = laptop / "profiles.toml"
    hpc = f"{sys.prefix}/bin/hpc-ddp"
    profiles.write_text(f'[cluster]\nssh = "cluster"\nremote_hpc_ddp = "{hpc}"\nremote_dir = "~/{tag}"\n'
                        f'partition = "grace"\n')
    env = {"HPC_DDP_SSH_CONFIG": said["HPC_DDP_SSH_CONFIG"], "HPC_DDP_SSH_CONTROL_DIR": str(control),
           "HPC_DDP_PROFILES": str(profiles), "HPC_DDP_REGISTRY": str(laptop / "runs.jsonl")}
    yield {"env": env, "root": root, "user": user, "home": home, "tag": tag, "laptop": laptop, "hpc": hpc,
           "mirror": home / tag / "proj", "profiles": profiles}
    subprocess.run(["ssh", "-F", env["HPC_DDP_SSH_CONFIG"], "-o", f"ControlPath={control}/%C", "-O", "exit",
                    "cluster"], capture_output=True)
    subprocess.run(["scancel", "-u", user], capture_output=True)
    shutil.rmtree(home / tag.split("/")[0] / tag.split("/")[1], ignore_errors=True)
    shutil.rmtree(control, ignore_errors=True)


def _logins(cluster) -> int:
    log = cluster["root"] / "sshd.log"
    return log.read_text(errors="replace").count(f"Accepted publickey for {cluster['user']}") if log.exists() else 0


def _project(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "first")
    return root


def _laptop(cluster, *args: str, cwd: Path, env: dict | None = None, timeout: float = 300):
    return hpc_ddp(*args, cwd=cwd, env={**cluster["env"], **(env or {})}, timeout=timeout)


def _their_jobs(cluster) -> list[str]:
    return subprocess.run(["squeue", "-h", "-u", cluster["user"], "-o", "%i"], capture_output=True,
                          text=True).stdout.split()


@pytest.mark.slurm_core
def test_submit_from_the_laptop_survives_a_real_preemption_and_is_watched_from_there(cluster):
    project = _project(cluster["laptop"] / "proj", {"train.py": TRAIN, "consts.py": "VALUE = 1\n",
                                                    ".gitignore": "runs/\nout/\n"})
    (project / "consts.py").write_text("VALUE = 2\n")   # uncommitted: what is submitted is the working tree
    logins = _logins(cluster)
    done = _laptop(cluster, "submit", "--profile", "cluster", "--nodes", "2", "--json", "train.py", "out",
                   cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    job, run_dir = answer["job_id"], answer["run_dir"]
    assert answer["host"] == "cluster" and run_dir.startswith(str(cluster["mirror"]))
    assert job_field(job, "UserId").startswith(cluster["user"])    # queued as the cluster account
    out = cluster["mirror"] / "out"
    wait_until(lambda: (out / "progress.json").exists() and json.loads((out / "progress.json").read_text())["step"] >= 8,
               240, "the job to train a few steps")
    _preempt_all([job])
    assert _wait_done(job) == "COMPLETED"

    status = _laptop(cluster, "status", "--json", job, cwd=project)
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    assert info["state"] == "COMPLETED" and info["restarts"] >= 1, info
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) >= 2 and {r["value"] for r in records} == {2} and records[-1]["start"] > 0
    assert all(r["file"].startswith(f"{run_dir}/code/") for r in records)   # the snapshot, not the mirror
    listing = list_project(project, git=Git())
    assert info["attempts"][0]["code"] == snapshot.hashed(listing, None)[0]   # the laptop's content, exactly

    logs = _laptop(cluster, "logs", job, cwd=project)
    assert "[attempt 0 rank 0] start at step 0 value 2" in logs.stdout and "[attempt 1 rank 0] start at step" in logs.stdout
    picture = cluster["laptop"] / "tl.png"
    drawn = _laptop(cluster, "timeline", job, "-o", str(picture), cwd=project)
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"Wrote {picture}" in drawn.stdout
    listed = _laptop(cluster, "list", cwd=cluster["laptop"])
    assert f"cluster:{run_dir}" in listed.stdout and "COMPLETED" in listed.stdout, listed.stdout
    assert _logins(cluster) == logins + 1, "one ssh login for the whole session"

    # another laptop, or the same after its registry is gone, which never submitted it: HOST:RUN_DIR (issue 54)
    # (a bare job id would be asked of this machine's Slurm, which here is the cluster's too)
    elsewhere = {"HPC_DDP_REGISTRY": str(cluster["laptop"] / "another-laptop.jsonl")}
    status = _laptop(cluster, "status", "--json", f"cluster:{run_dir}", cwd=project, env=elsewhere)
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["state"] == "COMPLETED"
    logs = _laptop(cluster, "logs", f"cluster:{run_dir}", cwd=project, env=elsewhere)
    assert "[attempt 1 rank 0] start at step" in logs.stdout, logs.stdout + logs.stderr


def test_logs_follow_across_a_killed_connection_then_cancel(cluster):
    project = _project(cluster["laptop"] / "count", {"count.py": COUNT})
    done = _laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "--json", "count.py", cwd=project)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["job_id"]
    follow = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "logs", "-f", job], cwd=project, text=True,
                              env={**os.environ, **cluster["env"]}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = []
    assert follow.stdout is not None
    for line in follow.stdout:
        seen.append(line.rstrip("\n"))
        if line.rstrip().endswith("n 10"):
            # the connection dies under it: every sshd process of the cluster account, the shared one too
            subprocess.run(["pkill", "-KILL", "-u", cluster["user"], "-x", "sshd"], check=False)
            break
    seen += [line.rstrip("\n") for line in follow.stdout]
    assert follow.wait(timeout=120) == 0, follow.stderr.read()
    assert "reconnecting" in follow.stderr.read()
    assert [s for s in seen if " n " in s] == [f"[attempt 0 rank 0] n {n}" for n in range(50)], seen

    long_job = json.loads(_laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "--json",
                                  "--env", "SLEEP=600", "count.py", cwd=project).stdout)["job_id"]
    wait_until(lambda: job_field(long_job, "JobState") == "RUNNING", 60, "the job to start")
    cancelled = _laptop(cluster, "cancel", long_job, cwd=cluster["laptop"])
    assert cancelled.returncode == 0 and f"Cancelled job {long_job}" in cancelled.stdout, cancelled.stderr
    assert wait_until(lambda: job_field(long_job, "JobState") in ("CANCELLED", None), 60, "the cancel")


TRAINER_JOB = """
nodes = 1
gpus = 2
[train]
dataset = "mnist"
data_dir = "{data}"
model = "slowmodel:make"
epochs = 2
batch_size = 16
lr = 0.05
num_workers = 0
log_every = 1
checkpoint_every_steps = 4
"""
TRAINER_STEPS = 2 * 512 // 2 // 16


@pytest.mark.extended
def test_the_trainer_preempted_from_the_laptop_then_inspected_and_plotted_there(cluster):
    """The built-in trainer on data that lives on the cluster: `preempt` from the laptop (its warning
    signal: checkpoint, requeue, resume), then `inspect` and `plot` of the remote run from the laptop."""
    data = cluster["home"] / cluster["tag"] / "mnist-data"
    write_mnist(data, train=512, test=64)
    subprocess.run(["chown", "-R", cluster["user"], str(cluster["home"] / cluster["tag"].split("/")[0])], check=True)
    project = _project(cluster["laptop"] / "trainer", {"job.toml": TRAINER_JOB.format(data=data),
                                                       "slowmodel.py": SLOW_MODEL})
    done = _laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "--json", "job.toml", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    job, run_dir = answer["job_id"], Path(answer["run_dir"])
    wait_until(lambda: last_step(run_dir) >= 8, 180, "step 8")
    sent = _laptop(cluster, "preempt", job, cwd=project)
    assert sent.returncode == 0 and "Sent SIGUSR2" in sent.stdout, sent.stdout + sent.stderr
    release_when_requeued(job)
    assert _wait_done(job, 240) == "COMPLETED"
    inspected = _laptop(cluster, "inspect", "--json", job, cwd=project)
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["step"] == TRAINER_STEPS
    status = json.loads(_laptop(cluster, "status", "--json", job, cwd=project).stdout)
    assert status["restarts"] == 1 and status["resumes"], status
    plotted = _laptop(cluster, "plot", job, "-o", str(cluster["laptop"] / "training.png"), cwd=project)
    assert plotted.returncode == 0, plotted.stderr
    assert (cluster["laptop"] / "training.png").read_bytes()[:4] == b"\x89PNG"


DEBUGGED = """\
import os
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ["HPC_DDP_COLLECTIVE_TIMEOUT"])))
secret = dist.get_rank() * 7 + 1
total = torch.tensor([float(secret)])
dist.all_reduce(total)  # BREAK
print(f"total={total.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_debug_a_rank_from_the_laptop_through_the_shared_connection(cluster):
    """--debug-rank over ssh: `status --tunnel` forwards a port through the connection already open, and a
    debugger on the laptop sets its breakpoint in the laptop's file, which the rank runs a copy of."""
    pytest.importorskip("debugpy")
    from .dap import DapClient

    project = _project(cluster["laptop"] / "dbg", {"job.py": DEBUGGED})
    line = next(i for i, x in enumerate(DEBUGGED.splitlines(), 1) if "# BREAK" in x)
    done = _laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "--nodes", "2", "--gpus", "1",
                   "--debug-rank", "1", "--json", "job.py", cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    job, run_dir = answer["job_id"], Path(answer["run_dir"])
    assert f"hpc-ddp status --tunnel {job}" in done.stderr
    wait_until(lambda: any(e.get("event") == "debugger" for e in read_jsonl(run_dir / "events.jsonl")), 120,
               "the debug rank to wait")
    logins = _logins(cluster)
    opened = _laptop(cluster, "status", "--tunnel", job, cwd=project)
    assert opened.returncode == 0, opened.stderr
    port = int(re.search(r"tunnel open: localhost:(\d+) -> hpcn2:", opened.stdout).group(1))

    def connect():
        try:
            return DapClient("127.0.0.1", port)
        except OSError:
            return None

    def attached():
        # the tunnel accepts at once; the rank's debugpy may not listen yet: then the connection closes
        client = connect()
        if client is None:
            return None
        try:
            return client, client.attach_and_break(str(project / "job.py"), line)   # the laptop's own path
        except (ConnectionError, OSError):
            client.close()
            return None

    client, stopped = wait_until(attached, 60, "a debugger attached through the tunnel", interval=1)
    try:
        assert client.local_variable(stopped["body"]["threadId"], "secret") == "8"   # rank 1
        client.request("continue", threadId=stopped["body"]["threadId"])
    finally:
        client.close()
    assert _wait_done(job, 120) == "COMPLETED"
    assert _logins(cluster) == logins   # the tunnel went through the connection already open


# ------------------------------------------------------------------------------------------ failures


@pytest.fixture(scope="module")
def hostile(cluster):
    """An ssh_config with hosts that fail each way, and a profile per failure of the cluster's side."""
    root = cluster["laptop"] / "hostile"
    root.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "other_key")], check=True)
    other_host = root / "other_host"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_host)], check=True)
    port = (cluster["root"] / "sshd_config").read_text().split("Port ", 1)[1].split()[0]
    (root / "known_hosts_changed").write_text(f"[127.0.0.1]:{port} {' '.join(Path(f'{other_host}.pub').read_text().split()[:2])}\n")
    base = Path(cluster["env"]["HPC_DDP_SSH_CONFIG"]).read_text()
    laptop_key = cluster["root"] / "laptop_ed25519"
    (root / "ssh_config").write_text(f"""
Host closed
    HostName 127.0.0.1
    Port 1
Host wrongkey
    HostName 127.0.0.1
    Port {port}
    User {cluster['user']}
    IdentityFile {root / 'other_key'}
    IdentitiesOnly yes
Host changedkey
    HostName 127.0.0.1
    Port {port}
    User {cluster['user']}
    IdentityFile {laptop_key}
    IdentitiesOnly yes
    UserKnownHostsFile {root / 'known_hosts_changed'}
""" + base)
    fake = cluster["root"] / "hpc-ddp-9.9.9"
    fake.write_text("#!/bin/sh\necho 'hpc-ddp, version 9.9.9'\n")
    fake.chmod(0o755)
    foreign = cluster["home"] / cluster["tag"] / "foreign" / "proj"   # where the project "proj" would go
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine\n")
    profiles = cluster["profiles"].read_text() + f"""
[nohpc]
ssh = "cluster"
remote_hpc_ddp = "/nonexistent/bin/hpc-ddp"
remote_dir = "~/{cluster['tag']}/nohpc"
[otherversion]
ssh = "cluster"
remote_hpc_ddp = "{fake}"
remote_dir = "~/{cluster['tag']}/other"
[readonly]
ssh = "cluster"
remote_hpc_ddp = "{cluster['hpc']}"
remote_dir = "/usr/share"
[foreign]
ssh = "cluster"
remote_hpc_ddp = "{cluster['hpc']}"
remote_dir = "~/{cluster['tag']}/foreign"
"""
    subprocess.run(["chown", "-R", cluster["user"], str(cluster["home"] / cluster["tag"].split("/")[0])], check=True)
    (root / "profiles.toml").write_text(profiles)
    project = _project(root / "proj", {"train.py": "print('hi')\n"})
    # its own connection: one shared with the tests above would hide a refused login (a short path: a socket's)
    control = Path(f"/tmp/hpcddp-ctl-{uuid.uuid4().hex[:8]}")
    control.mkdir(mode=0o700)
    yield {"env": {"HPC_DDP_SSH_CONFIG": str(root / "ssh_config"), "HPC_DDP_PROFILES": str(root / "profiles.toml"),
                   "HPC_DDP_SSH_CONTROL_DIR": str(control)},
           "project": project, "foreign": foreign}
    for host in ("cluster", "wrongkey", "changedkey"):   # its shared connections end with it
        subprocess.run(["ssh", "-F", str(root / "ssh_config"), "-o", f"ControlPath={control}/%C", "-O", "exit", host],
                       capture_output=True)
    shutil.rmtree(control, ignore_errors=True)


@pytest.mark.parametrize(("how", "said"), [
    (["--ssh", "nosuch.invalid", "--profile", "cluster"], "cannot resolve the host nosuch.invalid"),
    (["--ssh", "closed", "--profile", "cluster"], "closed refused the connection"),
    (["--ssh", "wrongkey", "--profile", "cluster"], "wrongkey refused the login"),
    (["--ssh", "changedkey", "--profile", "cluster"], "the host key of changedkey changed"),
    (["--profile", "nohpc"], "there is no hpc-ddp on cluster"),
    (["--profile", "otherversion"], "cluster has hpc-ddp 9.9.9, this laptop"),
    (["--profile", "foreign"], "exists and is not a folder hpc-ddp made"),
    (["--profile", "readonly"], "cluster:/usr/share is not a folder you can write to"),
])
def test_each_failure_is_one_line_with_exit_2_and_nothing_submitted(cluster, hostile, how, said):
    before = _their_jobs(cluster)
    done = _laptop(cluster, "submit", *how, "train.py", cwd=hostile["project"], env=hostile["env"], timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "HINT:" in lines[0], done.stderr
    assert _their_jobs(cluster) == before
    assert sorted(p.name for p in hostile["foreign"].iterdir()) == ["notes.txt"]   # not touched


def test_a_full_remote_disk_is_refused_before_anything_is_copied(cluster, hostile):
    tiny = cluster["home"] / cluster["tag"] / "tiny"
    tiny.mkdir()
    shutil.chown(tiny, cluster["user"])
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=1m,uid={cluster['user']}", "tmpfs", str(tiny)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        project = _project(cluster["laptop"] / "big", {"train.py": "print('hi')\n"})
        (project / "weights.bin").write_bytes(os.urandom(3 * 2**20))
        _git(project, "add", ".")
        _git(project, "commit", "-qm", "weights")
        profiles = Path(hostile["env"]["HPC_DDP_PROFILES"])
        profiles.write_text(profiles.read_text() + f'[tiny]\nssh = "cluster"\nremote_hpc_ddp = "{cluster["hpc"]}"\n'
                                                   f'remote_dir = "~/{cluster["tag"]}/tiny"\n')
        done = _laptop(cluster, "submit", "--profile", "tiny", "train.py", cwd=project, env=hostile["env"])
        assert done.returncode == 2 and "free where the project goes" in done.stderr, done.stderr
        assert not (tiny / "big").exists()
    finally:
        subprocess.run(["umount", str(tiny)], capture_output=True)


def _fake_rsync(folder: Path, body: str) -> dict:
    folder.mkdir(exist_ok=True)
    fake = folder / "rsync"
    real = shutil.which("rsync")
    fake.write_text(f"#!/bin/bash\n[ \"$1\" = --version ] && exec {real} --version\n" + body)
    fake.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def test_a_copy_cut_short_is_finished_by_the_next_submit_and_never_run(cluster):
    project = _project(cluster["laptop"] / "cut", {"train.py": "print('ran', flush=True)\n"})
    for n in range(40):
        (project / "assets" / f"blob{n}.bin").parent.mkdir(exist_ok=True)
        (project / "assets" / f"blob{n}.bin").write_bytes(os.urandom(256 * 1024))
    _git(project, "add", ".")
    _git(project, "commit", "-qm", "assets")
    before = _their_jobs(cluster)
    # the transfer dies after a second, as a dropped connection would end it (10 MB at 1 MB/s)
    cut = _fake_rsync(cluster["laptop"] / "cutbin", f"exec 3<&0\n{shutil.which('rsync')} --bwlimit=1000 \"$@\" <&3 & p=$!\n"
                                                     "sleep 1; kill -9 $p; wait $p; kill -9 $$\n")
    done = _laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "train.py", cwd=project, env=cut)
    assert done.returncode == 2 and "dropped while the project was copied" in done.stderr, done.stdout + done.stderr
    assert _their_jobs(cluster) == before
    mirror = cluster["mirror"].parent / "cut"
    shipped_before = sorted(p.name for p in (mirror / "assets").iterdir()) if (mirror / "assets").is_dir() else []
    assert 0 < len(shipped_before) < 40, shipped_before   # a part of it
    # a copy that silently misses files (rsync says it succeeded): the cluster refuses to submit it
    partial = _fake_rsync(cluster["laptop"] / "partialbin",
                          f"grep -zv blob3 | {shutil.which('rsync')} \"$@\"\n")   # all but blob30-39
    (project / "train.py").write_text("print('ran the new one', flush=True)\n")
    done = _laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "train.py", cwd=project,
                   env=partial)
    assert done.returncode == 2 and snapshot.INCOMPLETE in done.stderr, done.stdout + done.stderr
    assert _their_jobs(cluster) == before
    done = _laptop(cluster, "submit", "--profile", "cluster", "--partition", "debug", "--json", "train.py", cwd=project)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["job_id"]
    assert _wait_done(job, 120) == "COMPLETED"
    assert "ran the new one" in _laptop(cluster, "logs", job, cwd=project).stdout
    assert (mirror / "assets" / "blob39.bin").read_bytes() == (project / "assets" / "blob39.bin").read_bytes()


def test_where_the_cluster_has_no_rsync_a_tar_over_ssh_ships_the_same_files(cluster):
    from hpc_ddp.remote.answers import parse_hello
    from hpc_ddp.remote.ssh import Ssh
    from hpc_ddp.remote.submit import _ship

    project = _project(cluster["laptop"] / "tarred", {"train.py": "x = 1\n", "pkg/mod.py": "y = 2\n",
                                                      "with space/it's.py": "z = 3\n"})
    os.symlink("pkg/mod.py", project / "alias.py")
    listing = list_project(project, git=Git())
    mirror = cluster["mirror"].parent / "tarred"
    env = {**os.environ, **cluster["env"]}
    _ship(Ssh("cluster", env), parse_hello(f"rsync=no\ndir={mirror}\n"), project, listing, "laptop:tarred")
    assert (mirror / "with space" / "it's.py").read_text() == "z = 3\n" and (mirror / "pkg" / "mod.py").read_text() == "y = 2\n"
    assert os.readlink(mirror / "alias.py") == "pkg/mod.py" and (mirror / ".hpc-ddp-mirror").is_dir()
    assert mirror.stat().st_uid == (mirror / "train.py").stat().st_uid != 0   # written by the cluster account


def test_a_link_of_the_user_s_in_the_mirror_or_another_project_there_stops_the_submit(cluster, hostile):
    """The cluster's side of the mirror is the user's too: a link there is never written through nor
    replaced, and a folder holding another laptop project is not shipped over."""
    env = {**hostile["env"], "HPC_DDP_PROFILE": "cluster"}   # the profile chosen by the variable, as locally
    project = _project(cluster["laptop"] / "linked", {"train.py": "print('hi')\n", "data/prep.py": "x = 1\n"})
    done = _laptop(cluster, "submit", "--dry-run", "train.py", cwd=project, env=env)
    assert done.returncode == 0, done.stderr
    mirror = cluster["mirror"].parent / "linked"
    outside = cluster["home"] / cluster["tag"] / "shared-data"
    outside.mkdir()
    (outside / "prep.py").write_text("theirs\n")
    shutil.rmtree(mirror / "data")
    os.symlink(outside, mirror / "data")
    subprocess.run(["chown", "-h", cluster["user"], str(mirror / "data")], check=True)
    (project / "data" / "prep.py").write_text("x = 2\n")
    done = _laptop(cluster, "submit", "train.py", cwd=project, env=env)
    assert done.returncode == 2 and "linked/data is a link or a file on the cluster" in done.stderr, done.stderr
    assert (outside / "prep.py").read_text() == "theirs\n" and (mirror / "data").is_symlink()

    other = _project(cluster["laptop"] / "elsewhere" / "linked", {"train.py": "print('other')\n"})
    done = _laptop(cluster, "submit", "train.py", cwd=other, env=env)
    assert done.returncode == 2 and "holds another project, shipped from" in done.stderr, done.stderr
    assert (mirror / "train.py").read_text() == "print('hi')\n"
