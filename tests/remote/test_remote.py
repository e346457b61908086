"""hpc_ddp.remote without a network: hosts, ssh's failures, the site from flag and profile, the command line
rebuilt for the cluster, the manifest that travels (and a hostile one), the registry lookup, and the log
entries that let `logs -f` resume without a duplicate. The real sshd: tests/e2e/test_ssh.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from hpc_ddp.cli.app import cli
from hpc_ddp.common.errors import UserError
from hpc_ddp.remote import forward, ssh
from hpc_ddp.remote.argv import words_of
from hpc_ddp.remote.site import command_words, profile_toml, remote_dir_for, shell_words, site_for
from hpc_ddp.snapshot import shipped, snapshot
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import list_project
from hpc_ddp.spec.config import profile_layer, tomllib
from hpc_ddp.spec.jobspec import JobSpec, Target
from hpc_ddp.watch.status import new_log_entries, new_log_lines


@pytest.mark.parametrize("host", ["cluster", "ada@login.hpc.example.org", "login-01", "10.0.0.7", "[::1]"])
def test_hosts_ssh_takes(host):
    assert ssh.check_host(host) == host


@pytest.mark.parametrize("host", ["", "-oProxyCommand=touch /tmp/x", "a b", "a;b", "a'b", "$(id)", "a\nb", "-p22"])
def test_hosts_that_would_be_options_or_shell_are_refused(host):
    with pytest.raises(UserError):
        ssh.check_host(host)


@pytest.mark.parametrize(("stderr", "said"), [
    ("ssh: Could not resolve hostname nosuch: Name or service not known\r\n", "cannot resolve the host"),
    ("ssh: connect to host 127.0.0.1 port 1: Connection refused\r\n", "refused the connection"),
    ("ssh: connect to host 10.1.1.1 port 22: Connection timed out\r\n", "did not answer"),
    ("hpc@127.0.0.1: Permission denied (publickey).\r\n", "refused the login"),
    ("@@@@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n...\nHost key verification failed.\n",
     "host key of h changed"),
    ("No ED25519 host key is known for [127.0.0.1]:2222 and you have requested strict checking.\n"
     "Host key verification failed.\n", "could not verify the host key"),
    ("kex_exchange_identification: read: Connection reset by peer\n", "reset the connection"),
    ("something new\n", "ssh to h failed: something new"),
])
def test_ssh_failures_are_one_line_with_the_fix(stderr, said):
    err = ssh.classify("h", stderr)
    assert said in err.message and err.hint and "\n" not in str(err)


@pytest.fixture
def short(tmp_path):
    """A folder with a short path (a socket's must fit 104 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="hd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_control_folder_is_private_and_refused_when_not(tmp_path, short):
    path = ssh.control_dir({"HPC_DDP_SSH_CONTROL_DIR": str(short / "ctl")})
    assert (path.stat().st_mode & 0o777) == 0o700
    os.chmod(path, 0o755)
    with pytest.raises(UserError, match="not a private folder"):
        ssh.control_dir({"HPC_DDP_SSH_CONTROL_DIR": str(path)})
    (short / "elsewhere").mkdir(mode=0o700)
    os.symlink(short / "elsewhere", short / "link")
    with pytest.raises(UserError, match="not a private folder"):
        ssh.control_dir({"HPC_DDP_SSH_CONTROL_DIR": str(short / "link")})


def test_a_control_folder_too_long_for_a_socket_is_refused_or_replaced(tmp_path):
    with pytest.raises(UserError, match="too long"):
        ssh.control_dir({"HPC_DDP_SSH_CONTROL_DIR": str(tmp_path / ("x" * 60))})
    runtime = tmp_path / ("r" * 60)
    runtime.mkdir()
    assert ssh.control_dir({"XDG_RUNTIME_DIR": str(runtime)}) == Path(f"/tmp/hpc-ddp-ssh-{os.getuid()}")


def test_every_command_shares_one_connection_and_never_reads_the_host_as_an_option(short):
    conn = ssh.Ssh("cluster", {"HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), "HPC_DDP_SSH_CONFIG": "/x/cfg"})
    argv = conn.argv()
    assert argv[:3] == ["ssh", "-F", "/x/cfg"] and "ControlMaster=auto" in argv and argv[-3:] == ["--", "cluster", "sh -s"]
    assert f"ControlPath={short / 'c'}/%C" in argv and any(a.startswith("ControlPersist=") for a in argv)


# ------------------------------------------------------------------------------------------------ site


def _profiles(tmp_path, text):
    path = tmp_path / "profiles.toml"
    path.write_text(text)
    return {"HPC_DDP_PROFILES": str(path)}


def test_the_site_comes_from_the_flag_or_the_profile(tmp_path):
    env = _profiles(tmp_path, '[c]\nssh = "login"\nremote_dir = "~/w/p"\nremote_hpc_ddp = "/v/bin/hpc-ddp"\n'
                              'partition = "gpu"\n[local]\npartition = "x"\n')
    site = site_for(None, "c", env)
    assert (site.host, site.remote_dir, site.hpc_ddp, site.profile) == ("login", "~/w/p", "/v/bin/hpc-ddp",
                                                                         {"partition": "gpu"})
    assert site_for("other", "c", env).host == "other"   # the flag wins
    assert site_for(None, "local", env) is None and site_for(None, None, env) is None
    # the cluster's own submit reads the same profile without the laptop's keys
    assert profile_layer("c", Path(env["HPC_DDP_PROFILES"])).values == {"partition": "gpu"}


def test_a_profile_only_the_cluster_has_is_left_to_the_cluster(tmp_path):
    env = _profiles(tmp_path, '[other]\npartition = "x"\n')
    site = site_for("login", "theirs", env)
    assert site.profile_name == "theirs" and site.profile is None   # no empty [theirs] shipped over it


def test_a_profile_whose_ssh_is_not_a_host_is_refused(tmp_path):
    with pytest.raises(UserError):
        site_for(None, "c", _profiles(tmp_path, '[c]\nssh = "-oProxyCommand=sh"\n'))
    with pytest.raises(UserError):
        site_for(None, "c", _profiles(tmp_path, '[c]\nssh = 3\n'))


def test_the_remote_folder_is_the_same_path_under_the_remote_home(tmp_path):
    site = site_for("h", None, {})
    assert remote_dir_for(site, tmp_path / "home" / "ada" / "proj", home=tmp_path / "home" / "ada") == "~/proj"
    with pytest.raises(UserError, match="remote_dir"):
        remote_dir_for(site, Path("/opt/proj"), home=tmp_path)
    # remote_dir holds every project, each in a folder of its name
    assert remote_dir_for(site_for("h", None, {}).__class__("h", "~/work/"), Path("/opt/proj")) == "~/work/proj"


def test_the_profile_sent_to_the_cluster_reads_back_the_same():
    table = {"partition": "gpu", "gpus": 4, "env": {"A": "1 \"quoted\"", "B": "ü\n"}, "node_setup": ["a", "b"],
             "snapshot": False, "x.y": 1.5}
    assert tomllib.loads(profile_toml("my cluster", table)) == {"my cluster": table}


# -------------------------------------------------------------------------------------- the command line


def test_submit_s_parameters_become_the_same_command_line():
    command = cli.commands["submit"]
    argv = ["--nodes", "2", "--gpus=4", "--env", "A=1", "--env", "B=2 3", "--no-snapshot", "--dry-run",
            "--sbatch-arg=--exclusive", "-m", "pkg.train", "--", "--lr", "0.1"]
    ctx = command.make_context("submit", list(argv))
    words = words_of(command, ctx.params, drop=("ssh", "shipped"))
    again = command.make_context("submit", list(words))
    assert again.params == ctx.params
    assert words[-3:] == ["--", "--lr", "0.1"] and "--ssh" not in " ".join(words)


def test_status_s_parameters_with_the_remote_run_dir():
    command = cli.commands["logs"]
    ctx = command.make_context("logs", ["--rank", "3", "4711"])
    words = words_of(command, {**ctx.params, "job": "/home/a/runs/x"})
    assert command.make_context("logs", list(words)).params == {**ctx.params, "job": "/home/a/runs/x"}


# --------------------------------------------------------------------------------------------- manifest


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("import pkg\n")
    (root / "pkg" / "__init__.py").write_text("X = 1\n")
    (root / "data").mkdir()
    (root / "data" / "big").write_bytes(b"x" * 100)
    os.symlink("pkg/__init__.py", root / "alias.py")
    return root


def test_the_manifest_lists_the_same_snapshot_on_the_cluster(project, tmp_path):
    listing = list_project(project, git=Git(executable=""))
    snap_id, hashes = snapshot.hashed(listing, None)
    data = json.loads(json.dumps(shipped.manifest(listing, snap_id, hashes)))
    mirror = tmp_path / "mirror"
    (mirror / "pkg").mkdir(parents=True)
    for rel in ("train.py", "pkg/__init__.py"):
        (mirror / rel).write_bytes((project / rel).read_bytes())
    there, expected = shipped.listing(data, mirror)
    assert expected == hashes
    assert [(i.rel, i.kind) for i in there.items] == [(i.rel, i.kind) for i in listing.items]
    assert next(i for i in there.items if i.rel == "data").target == os.path.join(os.path.realpath(mirror), "data")
    assert snapshot.hashed(there, None)[0] == snap_id   # the same content, the same id on both sides


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "", ".", "a//b", "a/./b", "x\0y", 3])
def test_a_manifest_naming_a_path_outside_the_project_is_refused(rel, tmp_path):
    data = {"format": 1, "items": [[rel, "file", 1, False, ""]], "hashes": {str(rel): "0" * 64}}
    with pytest.raises(UserError):
        shipped.listing(data, tmp_path)


def test_a_damaged_or_foreign_manifest_is_one_line(tmp_path):
    for data in ({"format": 2}, {"format": 1}, {"format": 1, "items": [["a", "file"]]}, []):
        with pytest.raises(UserError):
            shipped.listing(data, tmp_path)


def test_a_mirror_file_that_differs_from_the_laptop_s_stops_the_submit(project, tmp_path):
    listing = list_project(project, git=Git(executable=""))
    snap_id, hashes = snapshot.hashed(listing, None)
    data = shipped.manifest(listing, snap_id, hashes)
    mirror = tmp_path / "mirror"
    (mirror / "pkg").mkdir(parents=True)
    (mirror / "train.py").write_text("import pkg\n")
    (mirror / "pkg" / "__init__.py").write_text("X = 2\n")  # an old copy: the transfer was cut short
    spec = JobSpec(Target("script", str(mirror / "train.py")), job_name="t", workdir=str(mirror), python=sys.executable)
    snap = snapshot.plan(spec, str(tmp_path / "run" / "code"), read=False, shipped=shipped.listing(data, mirror))
    with pytest.raises(UserError, match=snapshot.INCOMPLETE):
        snapshot.take(snap)
    assert list((tmp_path / "run" / "code").iterdir()) == []   # nothing left for a job to run
    (mirror / "pkg" / "__init__.py").write_text("X = 1\n")
    assert snapshot.take(snap).id == snap_id


# ---------------------------------------------------------------------------------------------- registry


def test_a_remote_run_is_found_by_job_id_remote_dir_or_host_path_and_a_newer_local_one_wins(tmp_path):
    registry = tmp_path / "runs.jsonl"
    lines = [{"job_id": "7", "run_dir": "/r/a", "host": "c"}, {"job_id": "8", "run_dir": str(tmp_path), "executor": "local"}]
    registry.write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {"HPC_DDP_REGISTRY": str(registry)}
    assert forward.remote_run("7", env)["host"] == "c"
    assert forward.remote_run("/r/a", env)["job_id"] == "7" and forward.remote_run("c:/r/a", env)["job_id"] == "7"
    assert forward.remote_run("8", env) is None and forward.remote_run(None, env) is None
    with registry.open("a") as fh:
        fh.write(json.dumps({"job_id": "7", "run_dir": str(tmp_path), "executor": "local"}) + "\n")
    assert forward.remote_run("7", env) is None   # the newer local job 7


# --------------------------------------------------------------------------------------------- logs -f


def _log(run_dir: Path, text: bytes) -> Path:
    path = run_dir / "logs" / "job-1" / "attempt-0" / "rank-0.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as fh:
        fh.write(text)
    return path


def test_log_entries_say_where_each_line_ends_and_match_the_lines(tmp_path):
    _log(tmp_path, b"one\nprogress 10%\rprogress 50%\rprogress 100%\n\nlast")
    entries = list(new_log_entries(tmp_path, None, {}))
    assert [e.text for e in entries] == list(new_log_lines(tmp_path, None, {}))
    assert [(e.end, e.part, e.parts) for e in entries] == [(4, 0, 1), (44, 0, 3), (44, 1, 3), (44, 2, 3),
                                                           (45, 0, 1), (49, 0, 1)]


def test_resuming_from_any_entry_shows_every_line_once(tmp_path):
    """What `logs -f` does after a dropped connection: start at the last whole line, skip the parts shown."""
    _log(tmp_path, b"a\nb1\rb2\rb3\nc\n")
    every = [e.text for e in new_log_entries(tmp_path, None, {})]
    for cut in range(len(every) + 1):
        shown, cursor = [], forward.LogCursor()
        for n, e in enumerate(new_log_entries(tmp_path, None, {})):
            if n == cut:
                break  # the connection drops here
            if cursor.take(e.path, e.end, e.part, e.parts):
                shown.append(e.text)
        for e in new_log_entries(tmp_path, None, dict(cursor.offsets)):
            if cursor.take(e.path, e.end, e.part, e.parts):
                shown.append(e.text)
        assert shown == every, cut


# ---------------------------------------------------------------------- review: words for the cluster's sh


@pytest.mark.parametrize(("path", "expanded"), [
    ("~/p", "{home}/p"), ("~", "{home}"), ("$TESTVAR/x y", "/scratch/a b/x y"), ("${TESTVAR}/p", "/scratch/a b/p"),
    ("/abs/it's", "/abs/it's"), ("rel/dir", "{home}/rel/dir"), ("~/$(touch /tmp/pwned)", "{home}/$(touch /tmp/pwned)"),
])
def test_remote_folders_expand_as_the_cluster_shell_would_and_nothing_runs(path, expanded, tmp_path):
    import subprocess

    home = str(tmp_path)
    out = subprocess.run(["sh", "-c", f"printf %s {shell_words(path)}"], capture_output=True, text=True,
                         env={"HOME": home, "TESTVAR": "/scratch/a b", "PATH": os.environ["PATH"]}).stdout
    assert out == expanded.format(home=home)
    assert not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("path", ["$(id)/x", "~`id`/x", "${X:-a}/p", "~root;id/x"])
def test_remote_folders_the_shell_would_run_something_in_are_refused(path):
    with pytest.raises(UserError):
        shell_words(path)


def test_remote_hpc_ddp_is_one_word_never_shell_code():
    assert command_words("hpc-ddp") == "hpc-ddp"
    assert command_words("~/venvs/my env/bin/hpc-ddp") == '"$HOME"/\'venvs/my env/bin/hpc-ddp\''
    assert command_words("source env.sh; hpc-ddp") == "'source env.sh; hpc-ddp'"


def test_the_profile_sent_keeps_characters_and_infinities_toml_can_read():
    table = {"rocket": "\U0001F680 launch", "limit": float("inf"), "low": float("-inf")}
    back = tomllib.loads(profile_toml("c", table))["c"]
    assert back["rocket"] == table["rocket"] and back["limit"] == float("inf") and back["low"] == float("-inf")
    assert str(tomllib.loads(profile_toml("c", {"x": float("nan")}))["c"]["x"]) == "nan"


def test_a_relative_template_in_a_profile_for_ssh_is_refused(tmp_path):
    with pytest.raises(UserError, match="relative"):
        site_for(None, "c", _profiles(tmp_path, '[c]\nssh = "h"\ntemplate = "my.sbatch.j2"\n'))


@pytest.mark.parametrize(("line", "ok"), [("rsync  version 3.2.7  protocol version 31", True),
                                          ("rsync  version 2.6.9  protocol version 29", False),
                                          ("openrsync: protocol version 29", False), ("rsync version v3.4.1", True),
                                          (None, False), ("", False)])
def test_only_rsync_3_is_used(line, ok):
    from hpc_ddp.remote.submit import _rsync_3

    assert _rsync_3(line) is ok


@pytest.mark.parametrize("name", ["plain", "with space", "quote's", "new\nline", "dollar$(id)", "\u00e9t\u00e9",
                                  "back\\slash", "x" * 200])
def test_folder_names_reach_the_cluster_shell_byte_for_byte(name):
    import subprocess

    from hpc_ddp.remote.submit import _encoded

    out = subprocess.run(["sh", "-c", f"f=$(printf '%bx' '{_encoded(name)}'); printf '%s' \"${{f%x}}\""],
                         capture_output=True).stdout
    assert out == name.encode()


def test_every_job_queued_is_recorded_a_chain_s_and_a_sweep_s():
    from hpc_ddp.remote.answers import parse_submitted
    from hpc_ddp.remote.submit import _records

    chain = _records(parse_submitted({"executor": "sbatch", "job_id": "5", "job_ids": ["5", "6"],
                                      "run_dir": "/r/train-20261127-010101"}, "h"), "h", "hpc-ddp")
    assert [(r["job_id"], r["run_dir"], r["name"]) for r in chain] == [("5", "/r/train-20261127-010101", "train"),
                                                                       ("6", "/r/train-20261127-010101", "train")]
    sweep = _records(parse_submitted({"executor": "sbatch", "sweep_dir": "/r/sw", "array_job_id": "9",
                                      "tasks": [{"task": 0, "job_id": "9_0", "run_dir": "/r/sw/task-0",
                                                 "values": {"lr": 0.1}},
                                                {"task": 1, "job_id": "9_1", "run_dir": "/r/sw/task-1",
                                                 "values": {"lr": 0.2}}]}, "h"), "h", "hpc-ddp")
    assert [r["job_id"] for r in sweep] == ["9_0", "9_1"] and all(r["sweep"] == "/r/sw" for r in sweep)


def test_a_bare_job_id_on_two_clusters_is_refused_and_host_job_picks(tmp_path):
    registry = tmp_path / "runs.jsonl"
    lines = [{"job_id": "7", "run_dir": "/a/r", "host": "a"}, {"job_id": "7", "run_dir": "/b/r", "host": "b"},
             {"job_id": "9_0", "run_dir": "/b/sw/task-0", "host": "b", "sweep": "/b/sw", "array_job_id": "9"}]
    registry.write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {"HPC_DDP_REGISTRY": str(registry)}
    with pytest.raises(UserError, match="2 clusters"):
        forward.remote_run("7", env)
    assert forward.remote_run("a:7", env)["run_dir"] == "/a/r" and forward.remote_run("b:7", env)["run_dir"] == "/b/r"
    assert forward.remote_run("9", env)["run_dir"] == "/b/sw"          # the array: the sweep
    assert forward.remote_run(None, env)["run_dir"] == "/b/sw"         # the most recent: a task, so its sweep
    assert forward.remote_run("9_0", env)["run_dir"] == "/b/sw/task-0"


@pytest.mark.parametrize("items", [
    [["a", "file", 1, False, ""], ["a", "file", 1, False, ""]],
    [["a", "link", 0, False, "/outside"], ["a/b/c", "file", 1, False, ""]],
    [["a", "file", 1, False, ""], ["a/b", "file", 1, False, ""]],
])
def test_a_manifest_with_a_path_twice_or_inside_a_file_or_link_is_refused(items, tmp_path):
    data = {"format": 1, "items": items, "hashes": {i[0]: "0" * 64 for i in items}}
    with pytest.raises(UserError, match="twice, or inside"):
        shipped.listing(data, tmp_path)


def test_the_profile_is_chosen_as_the_cluster_s_submit_would(tmp_path):
    from hpc_ddp.spec.config import chosen_profile

    (tmp_path / "job.toml").write_text('profile = "fromjob"\nscript = "t.py"\n')
    assert chosen_profile(("job.toml",), None, None, tmp_path, {})[0] == "fromjob"
    assert chosen_profile(("job.toml",), None, "flag", tmp_path, {})[0] == "flag"
    assert chosen_profile(("t.py",), None, None, tmp_path, {"HPC_DDP_PROFILE": "env"}) == ("env", {})


def test_a_run_this_laptop_did_not_submit_is_asked_of_the_cluster_by_host_path_or_host_job(tmp_path):
    """Issue 54: status, logs and cancel of HOST:RUN_DIR for a run started on the cluster itself (or by a
    colleague): the cluster's hpc-ddp is asked, the one the last run submitted there used."""
    registry = tmp_path / "runs.jsonl"
    registry.write_text(json.dumps({"job_id": "7", "run_dir": "/r/a", "host": "c", "remote_hpc_ddp": "~/env/bin/hpc-ddp"}) + "\n")
    env = {"HPC_DDP_REGISTRY": str(registry)}
    made = forward.remote_run("c:/scratch/me/run 2", env)
    assert (made["host"], made["run_dir"], made["remote_hpc_ddp"]) == ("c", "/scratch/me/run 2", "~/env/bin/hpc-ddp")
    assert forward.remote_run("other@login.example.org:/r/b", env)["remote_hpc_ddp"] is None  # hpc-ddp on its PATH
    assert forward.remote_run("c:4242", env)["run_dir"] == "4242" and forward.remote_run("c:99_3", env)["run_dir"] == "99_3"
    assert forward.remote_run("c:/r/a", env)["job_id"] == "7"  # the registry's own record, as before
    with pytest.raises(UserError, match="absolute run dir or its job id"):
        forward.remote_run("c:runs/x", env)
    for not_remote in ("run:x/../y", "-oProxyCommand=x:/y", "a b:/y", "plain", "/abs/path"):
        assert forward.remote_run(not_remote, env) is None, not_remote
    local = tmp_path / "odd:/dir"
    local.mkdir(parents=True)
    assert forward.remote_run(str(local), env) is None  # a path that exists here is a local run dir
    with pytest.raises(UserError, match="control character"):
        forward.remote_run("c:/r/\x1b[31m", env)


def test_a_profile_names_the_cluster_s_hpc_ddp_for_a_run_not_submitted_from_here(tmp_path):
    """HOST:/RUN_DIR with no run of that host in the registry: the profile for that host (by its ssh, or by
    its own name) says where the cluster's hpc-ddp is."""
    (tmp_path / "profiles.toml").write_text('[mycluster]\nssh = "login.example.org"\n'
                                            'remote_hpc_ddp = "~/venv/bin/hpc-ddp"\npartition = "gpu"\n')
    env = {"HPC_DDP_REGISTRY": str(tmp_path / "none.jsonl"), "HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")}
    by_host = forward.remote_run("login.example.org:/scratch/run", env)
    by_name = forward.remote_run("mycluster:/scratch/run", env)
    for found in (by_host, by_name):
        assert (found["host"], found["remote_hpc_ddp"]) == ("login.example.org", "~/venv/bin/hpc-ddp")
    assert forward.remote_run("other:/scratch/run", env)["remote_hpc_ddp"] is None
    (tmp_path / "profiles.toml").write_text("not toml [")
    assert forward.remote_run("mycluster:/x", env)["host"] == "mycluster"  # a damaged profiles file: the host as given
