"""Hardening round 3 (issue 30), submit --ssh and the commands forwarded over it (hpc_ddp.remote): hostile
values in the profile and on the command line, and hostile answers from the remote side, through fakes of
the one edge (Ssh.run / Ssh.stream), no network. Each row: refused in one line (a UserError, exit 2), or
handled as it should be, with nothing executed and nothing written outside. tests/remote/test_remote.py
holds the earlier cases."""

from __future__ import annotations

import datetime
import io
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from hpc_ddp.cli.app import cli
from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.remote import forward, ssh, submit
from hpc_ddp.remote.argv import words_of
from hpc_ddp.remote.site import Site, command_words, remote_dir_for, shell_words, site_for
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import list_project

# ------------------------------------------------------------------------------------------------ hosts

HOSTS_TAKEN = ["login1", "ada@login.example.org", "login_2", "x.y-z", "[fe80::1%eth0]", "ada@[::1]", "a" * 200,
               "user.name+tag@host", "10.0.0.1"]
HOSTS_REFUSED = ["a:b", "::1", "host:", "x::mod", "-", "--", "-F/tmp/cfg", "a\tb", "a\rb", "a\x00b", "h\u00f6st",
                 "@host", "a/b", "a,b", "~host", "*", "host?", "[::1", "::1]", "a" * 300, "host\n", " host", "a b",
                 "a|b", "a&b", "$HOME", "`id`", "a@b@c", "h%", "+host", 5, None, ["h"]]


@pytest.mark.parametrize("host", HOSTS_TAKEN)
def test_hosts_ssh_and_rsync_both_read_as_one_host_are_taken(host):
    assert ssh.check_host(host) == host


@pytest.mark.parametrize("host", HOSTS_REFUSED, ids=[ascii(h)[:20] for h in HOSTS_REFUSED])
def test_hosts_that_are_options_shell_or_not_one_host_to_rsync_are_refused_in_one_line(host):
    with pytest.raises(UserError) as err:
        ssh.check_host(host)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- profiles

def _env(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "profiles.toml"
    path.write_text(text)
    return {"HPC_DDP_PROFILES": str(path)}


PROFILES = {
    # the profile's lines -> "refused", or what remote_dir the site holds
    "ssh-proxycommand": ('ssh = "-oProxyCommand=touch /tmp/pwned"', "refused"),
    "ssh-a-number": ("ssh = 5", "refused"),
    "ssh-a-list": ('ssh = ["a"]', "refused"),
    "ssh-a-table": ("ssh = {host = 'a'}", "refused"),
    "ssh-with-space": ('ssh = "login cluster"', "refused"),
    "ssh-with-newline": ('ssh = "login\\nProxyCommand x"', "refused"),
    "ssh-leading-dash": ('ssh = "-login"', "refused"),
    "ssh-host-colon-path": ('ssh = "login:/tmp"', "refused"),
    "remote-dir-a-number": ('ssh = "c"\nremote_dir = 5', "refused"),
    "remote-dir-newline": ('ssh = "c"\nremote_dir = "~/a\\nb"', "refused"),
    "remote-dir-escape": ('ssh = "c"\nremote_dir = "~/a\\u001b[2Jb"', "refused"),
    "remote-dir-nul": ('ssh = "c"\nremote_dir = "~/a\\u0000b"', "refused"),
    "remote-dir-command-substitution": ('ssh = "c"\nremote_dir = "$(touch pwned)/x"', "refused"),
    "remote-dir-backticks-head": ('ssh = "c"\nremote_dir = "~`id`"', "refused"),
    "remote-dir-var-default": ('ssh = "c"\nremote_dir = "${X:-/tmp}/x"', "refused"),
    "remote-dir-tilde-user": ('ssh = "c"\nremote_dir = "~ada/projects"', "~ada/projects"),
    "remote-dir-dotdot": ('ssh = "c"\nremote_dir = "~/../shared"', "~/../shared"),
    "remote-dir-var": ('ssh = "c"\nremote_dir = "$SCRATCH/p"', "$SCRATCH/p"),
    "remote-dir-long": ('ssh = "c"\nremote_dir = "~/' + "d" * 3000 + '"', "~/" + "d" * 3000),
    "remote-dir-leading-dash": ('ssh = "c"\nremote_dir = "-rf"', "-rf"),
    "remote-dir-empty": ('ssh = "c"\nremote_dir = ""', None),
    "remote-hpc-ddp-newline": ('ssh = "c"\nremote_hpc_ddp = "hpc-ddp\\nid"', "refused"),
    "remote-hpc-ddp-blank": ('ssh = "c"\nremote_hpc_ddp = "   "', "refused"),
    "remote-hpc-ddp-a-list": ('ssh = "c"\nremote_hpc_ddp = ["hpc-ddp"]', "refused"),
    "remote-hpc-ddp-escape": ('ssh = "c"\nremote_hpc_ddp = "hpc\\u001b]0;x\\u0007"', "refused"),
    "remote-hpc-ddp-tab": ('ssh = "c"\nremote_hpc_ddp = "hpc\\tddp"', "refused"),
}


@pytest.mark.parametrize("case", sorted(PROFILES))
def test_hostile_profile_values_are_refused_before_anything_runs(tmp_path, case):
    lines, expected = PROFILES[case]
    env = _env(tmp_path, f"[c]\n{lines}\n")
    if expected == "refused":
        with pytest.raises(UserError) as err:
            site_for(None, "c", env)
        assert "\n" not in str(err.value)
    else:
        assert site_for(None, "c", env).remote_dir == expected


# words of the cluster's sh: (remote_dir, what the shell makes of it with HOME=H; None: refused)
FOLDERS = [
    ("~/a b", "H/a b"), ("~/it's", "H/it's"), ("~/$(touch PWNED)", "H/$(touch PWNED)"),
    ("/abs/`touch PWNED`", "/abs/`touch PWNED`"), ("$HOME/x;touch PWNED", "H/x;touch PWNED"),
    ("~/-rf", "H/-rf"), ("-rf", "H/-rf"), ("../x", "H/../x"), ("~", "H"), ("~/", "H"), ("/", "/"),
    ("~/*", "H/*"), ("~/a\\b", "H/a\\b"), ("~/\u00e9t\u00e9", "H/\u00e9t\u00e9"), ("${HOME}/p", "H/p"),
    ("~/a\nb", None), ("~/a\rb", None), ("~/\x1b[2J", None), ("$(id)", None), ("~$(id)", None),
]


@pytest.mark.parametrize(("folder", "expanded"), FOLDERS, ids=[ascii(f)[:24] for f, _ in FOLDERS])
def test_remote_folders_become_words_that_run_nothing(tmp_path, folder, expanded):
    if expanded is None:
        with pytest.raises(UserError):
            _site_with_dir(folder)
        return
    words = shell_words(folder)
    done = subprocess.run(["sh", "-c", f"printf '%s' {words}"], cwd=tmp_path, capture_output=True,
                          env={"HOME": str(tmp_path / "H"), "PATH": os.environ["PATH"]})
    assert done.stdout.decode() == expanded.replace("H", str(tmp_path / "H"), 1) if expanded.startswith("H") \
        else done.stdout.decode() == expanded
    assert not list(tmp_path.rglob("PWNED"))


def _site_with_dir(folder: str) -> Site:
    with tempfile.TemporaryDirectory() as tmp:
        env = _env(Path(tmp), f"[c]\nssh = \"c\"\nremote_dir = {json.dumps(folder)}\n")
        return site_for(None, "c", env)


PROJECT_NAMES = [("proj", True), ("my project", True), ("-rf", True), ("\u00e9t\u00e9", True), ("a\nb", False),
                 ("a\x1bb", False), ("a\rb", False), ("tab\tx", False)]


@pytest.mark.parametrize(("name", "ok"), PROJECT_NAMES, ids=[ascii(n) for n, _ in PROJECT_NAMES])
def test_a_project_whose_name_cannot_come_back_in_one_line_has_no_mirror(tmp_path, name, ok):
    site = Site("c", "~/p")
    if ok:
        assert remote_dir_for(site, tmp_path / name) == f"~/p/{name}"
        assert remote_dir_for(Site("c", None), tmp_path / name, home=tmp_path) == f"~/{name}"
    else:
        for s, home in ((site, None), (Site("c", None), tmp_path)):
            with pytest.raises(UserError) as err:
                remote_dir_for(s, tmp_path / name, home=home)
            assert "\n" not in str(err.value)


COMMANDS = [("hpc-ddp", "hpc-ddp"), ("hpc-ddp; touch PWNED", "hpc-ddp; touch PWNED"),
            ("~/venv/bin/hpc-ddp", "H/venv/bin/hpc-ddp"), ("$(touch PWNED)", None), ("-rf", "-rf"),
            ("/opt/hpc ddp/bin/hpc-ddp", "/opt/hpc ddp/bin/hpc-ddp")]


@pytest.mark.parametrize(("command", "word"), COMMANDS, ids=[c for c, _ in COMMANDS])
def test_remote_hpc_ddp_is_one_word_of_the_cluster_s_shell(tmp_path, command, word):
    try:
        words = command_words(command)
    except UserError:
        assert word is None
        return
    done = subprocess.run(["sh", "-c", f"printf '%s' {words}"], capture_output=True, cwd=tmp_path,
                          env={"HOME": str(tmp_path / "H"), "PATH": os.environ["PATH"]})
    assert done.stdout.decode() == word.replace("H", str(tmp_path / "H"), 1) if word.startswith("H") else \
        done.stdout.decode() == word
    assert not list(tmp_path.rglob("PWNED"))


# ------------------------------------------------------------------------- the cluster's hello, hostile

class FakeSsh:
    """Ssh's edge: each run() answers the next text (bytes for stdout); records the scripts. Other commands
    (ssh -O forward) go through the real bounded runner."""

    timeout_s = 5.0
    bounded = ssh.Ssh.bounded
    lost = ssh.Ssh.lost

    def __init__(self, *answers, host: str = "c") -> None:
        self.host, self.answers, self.scripts = host, list(answers), []

    def run(self, script: str, *, check: bool = True, timeout=None):
        self.scripts.append(script)
        answer = self.answers.pop(0) if self.answers else b""
        if isinstance(answer, BaseException):
            raise answer
        out = answer if isinstance(answer, bytes) else answer.encode()
        return ssh.Done(0, out, b"")


@pytest.fixture(scope="module")
def listing(tmp_path_factory):
    root = tmp_path_factory.mktemp("laptop") / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("x\n")
    (root / "pkg" / "m.py").write_text("m\n")
    return list_project(root, git=Git(executable=""))


def _hello(**said) -> str:
    from hpc_ddp import __version__
    base = {"version": f"hpc-ddp {__version__}", "rsync": "rsync  version 3.2.7", "dir": "/home/a/proj",
            "state": "absent", "free_kb": "100000000", "writable": "yes"}
    base.update(said)
    return "".join(f"{k}={v}\n" for k, v in base.items() if v is not None)


HELLOS = {
    # what the cluster said -> "ok" or a part of the one-line refusal
    "all-well": (_hello(), "ok"),
    "no-hpc-ddp": (_hello(version="missing"), "no hpc-ddp"),
    "another-version": (_hello(version="hpc-ddp 0.0.1"), "must be the same"),
    "version-with-escape": (_hello(version="hpc-ddp 0.0.1\x1b[2J"), "must be the same"),
    "dir-relative": (_hello(dir="proj"), "absolute"),
    "dir-missing": (_hello(dir=None), "absolute"),
    "dir-with-escape": (_hello(dir="/home/a/\x1b[2Jproj"), "absolute"),
    "state-link": (_hello(state="link"), "not a folder hpc-ddp made"),
    "state-foreign": (_hello(state="foreign"), "not a folder hpc-ddp made"),
    "state-unknown-word": (_hello(state="weird"), "ok"),
    "another-project": (_hello(state="ours", origin=json.dumps("other:/p")), "another project"),
    "origin-garbage": (_hello(state="ours", origin="\x1b[2J{{not json"), "another project"),
    "blocked-unknown": (_hello(blocked="\\0101"), "is a link or a file"),
    "unwritable": (_hello(writable="no", unwritable="/home/a"), "not a folder you can write"),
    "free-not-a-number": (_hello(free_kb="lots"), "ok"),
    "free-negative": (_hello(free_kb="-5"), "ok"),
    "free-zero": (_hello(free_kb="0"), "free"),
    "free-huge": (_hello(free_kb="9" * 400), "ok"),
    "empty-answer": ("", "no hpc-ddp"),
    "binary-answer": (bytes(range(256)) * 10, "no hpc-ddp"),
    "lines-without-equals": ("garbage\n" * 1000 + _hello(), "ok"),
    "repeated-keys-last-wins": (_hello() + "state=link\n", "not a folder hpc-ddp made"),
}


@pytest.mark.parametrize("case", sorted(HELLOS))
def test_hostile_hellos_are_refused_in_one_line_or_read(listing, case):
    text, expected = HELLOS[case]
    fake = FakeSsh(text)
    site = Site("c", "~/x")
    if expected == "ok":
        said = submit._hello(fake, site, "~/x/proj", listing, "laptop:/p")
        assert said.dir.startswith("/")
        return
    with pytest.raises(HpcDdpError) as err:
        submit._hello(fake, site, "~/x/proj", listing, "laptop:/p")
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).isprintable()


# --------------------------------------------------------------------- the cluster's submit answer, hostile

ANSWERS = {
    # the JSON the cluster's submit answered -> "ok" (printed and recorded) or "refused"
    "plain": ({"executor": "sbatch", "job_id": "12", "run_dir": "/home/a/runs/x-20260101-000000"}, "ok"),
    "a-chain": ({"executor": "sbatch", "job_ids": ["12", "13"], "run_dir": "/r/x"}, "ok"),
    "a-sweep": ({"executor": "sbatch", "sweep_dir": "/r/s", "array_job_id": "40",
                 "tasks": [{"task": 0, "job_id": "40_0", "run_dir": "/r/s/0", "values": {"lr": 0.1}}]}, "ok"),
    "a-list": ([1, 2], "refused"),
    "a-string": ("hello", "refused"),
    "a-number": (5, "refused"),
    "tasks-a-number": ({"tasks": 5, "sweep_dir": "/r/s"}, "refused"),
    "task-a-number": ({"tasks": [5], "sweep_dir": "/r/s"}, "refused"),
    "task-job-id-a-list": ({"tasks": [{"task": 0, "job_id": [1], "run_dir": "/r/s/0"}], "sweep_dir": "/r/s"},
                           "refused"),
    "task-values-a-list": ({"tasks": [{"task": 0, "job_id": "1", "run_dir": "/r/s/0", "values": [1]}],
                            "sweep_dir": "/r/s"}, "refused"),
    "job-ids-a-number": ({"job_ids": 5, "run_dir": "/r/x"}, "refused"),
    "job-ids-a-string": ({"job_ids": "123", "run_dir": "/r/x"}, "refused"),
    "job-id-a-table": ({"job_id": {"a": 1}, "run_dir": "/r/x"}, "refused"),
    "job-id-with-newline": ({"job_id": "1\n2", "run_dir": "/r/x"}, "refused"),
    "job-id-like-a-flag": ({"job_id": "--all", "run_dir": "/r/x"}, "refused"),
    "run-dir-a-number": ({"job_id": "1", "run_dir": 5}, "refused"),
    "run-dir-relative": ({"job_id": "1", "run_dir": "runs/x"}, "refused"),
    "run-dir-like-a-flag": ({"job_id": "1", "run_dir": "--json"}, "refused"),
    "run-dir-with-escape": ({"job_id": "1", "run_dir": "/r/\x1b[2Jx"}, "refused"),
    "run-dir-with-newline": ({"job_id": "1", "run_dir": "/r/x\n/r/y"}, "refused"),
    "executor-with-escape": ({"executor": "\x1b]0;pwn\x07", "job_id": "1", "run_dir": "/r/x"}, "refused"),
    "sweep-dir-a-list": ({"tasks": [], "sweep_dir": ["/r"]}, "refused"),
    "array-id-a-table": ({"tasks": [], "sweep_dir": "/r/s", "array_job_id": {"x": 1}}, "refused"),
    "no-job-at-all": ({"executor": "sbatch"}, "ok"),
    "huge-but-fine": ({"executor": "sbatch", "job_id": "1", "run_dir": "/r/x", "script": "#" * 2_000_000}, "ok"),
}


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_hostile_submit_answers_are_refused_in_one_line_and_never_recorded(tmp_path, capsys, case):
    answer, expected = ANSWERS[case]
    registry = tmp_path / "runs.jsonl"
    env = {"HPC_DDP_REGISTRY": str(registry)}
    site = Site("c", "~/x")
    try:
        submit._report(site, answer, {}, env)
    except UserError as exc:
        assert expected == "refused" and "\n" not in str(exc) and str(exc).isprintable()
        assert not registry.exists() or registry.read_text() == ""
        return
    except Exception as exc:  # noqa: BLE001 - a crash is the failure this row looks for
        pytest.fail(f"{type(exc).__name__}: {exc}")
    assert expected == "ok", "a hostile answer was accepted"
    out = capsys.readouterr()
    assert all(line.isprintable() for line in (out.out + out.err).splitlines())
    for line in (registry.read_text().splitlines() if registry.exists() else []):
        record = json.loads(line)
        assert isinstance(record["job_id"], str) and record["run_dir"].startswith("/")


# ----------------------------------------------------------------------------- the registry, hostile

RECORDS = {
    # a hostile record, the ref asked -> None (not found), "c" (the host found), or "refused"
    "host-a-number": ({"job_id": "7", "run_dir": "/r/a", "host": 5}, "7", "refused"),
    "host-a-list": ({"job_id": "7", "run_dir": "/r/a", "host": ["c"]}, "7", "refused"),
    "host-like-an-option": ({"job_id": "7", "run_dir": "/r/a", "host": "-oProxyCommand=x"}, "7", "refused"),
    "job-id-a-list": ({"job_id": [7], "run_dir": "/r/a", "host": "c"}, "7", None),
    "run-dir-a-number": ({"job_id": "7", "run_dir": 5, "host": "c"}, "7", "refused"),
    "run-dir-like-a-flag": ({"job_id": "7", "run_dir": "--json", "host": "c"}, "7", "refused"),
    "ipv6-host-by-host-job": ({"job_id": "7", "run_dir": "/r/a", "host": "[::1]"}, "[::1]:7", "[::1]"),
    "user-at-host-by-host-job": ({"job_id": "7", "run_dir": "/r/a", "host": "ada@c"}, "ada@c:7", "ada@c"),
    "run-dir-with-colon-by-host": ({"job_id": "7", "run_dir": "/r/a:b", "host": "c"}, "c:/r/a:b", "c"),
    "ref-empty-host": ({"job_id": "7", "run_dir": "/r/a", "host": "c"}, ":7", None),
    "ref-only-colon": ({"job_id": "7", "run_dir": "/r/a", "host": "c"}, ":", None),
    "ref-other-host": ({"job_id": "7", "run_dir": "/r/a", "host": "c"}, "d:7", "d"),  # job 7 of d, asked of d
    "not-a-table": ([1, 2], "7", None),
    "remote-hpc-ddp-a-list": ({"job_id": "7", "run_dir": "/r/a", "host": "c", "remote_hpc_ddp": ["x"]}, "7", "refused"),
}


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_hostile_registry_records_are_found_or_refused_in_one_line_never_a_crash(tmp_path, case, short):
    record, ref, expected = RECORDS[case]
    registry = tmp_path / "runs.jsonl"
    registry.write_text(json.dumps(record) + "\n")
    env = {"HPC_DDP_REGISTRY": str(registry), "HPC_DDP_SSH_CONTROL_DIR": str(short / "c")}
    try:
        found = forward.remote_run(ref, env)
        if found is not None:
            ssh.Ssh(found["host"], env)
            getattr(forward, "_checked", lambda r: r)(found)
    except UserError as exc:
        assert expected == "refused" and "\n" not in str(exc)
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__}: {exc}")
    assert (found["host"] if found else None) == expected


@pytest.fixture
def short():
    path = Path(tempfile.mkdtemp(prefix="hd-", dir="/tmp"))
    yield path
    import shutil
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------- commands forwarded: what they say

class FakeProc:
    def __init__(self, out: bytes, code: int = 0) -> None:
        self.stdout, self.stderr, self.code = io.BytesIO(out), io.BytesIO(b""), code

    def wait(self):
        return self.code

    def terminate(self):
        pass


class StreamSsh:
    def __init__(self, out: bytes = b"") -> None:
        self.host, self.out, self.scripts = "c", out, []

    def stream(self, script: str):
        self.scripts.append(script)
        return FakeProc(self.out)


RUN_DIRS = ["/r/x", "-rf", "--json", "--all", "-", "/r/a b", "/r/$(touch PWNED)", "/r/\u00e9"]


@pytest.mark.parametrize("command", ["status", "cancel", "preempt", "logs"])
@pytest.mark.parametrize("run_dir", RUN_DIRS, ids=[ascii(r) for r in RUN_DIRS])
def test_a_run_dir_is_always_an_argument_of_the_remote_command_never_an_option(command, run_dir):
    cmd = cli.commands[command]
    words = words_of(cmd, {"job": run_dir})
    # the cluster's hpc-ddp parses the words: the run dir comes back as the job argument
    ctx = cmd.make_context(command, list(words), resilient_parsing=True)
    assert ctx.params["job"] == run_dir, words


LOG_LINES = {
    # what the cluster's logs -f sent (one line) -> shown lines
    "good": (json.dumps({"path": "p", "end": 4, "part": 0, "parts": 1, "line": "hi", "attempt": 0, "rank": 0}), ["hi"]),
    "a-number": ("5", []),
    "a-list": ("[1, 2]", []),
    "a-string": ('"hi"', []),
    "missing-keys": (json.dumps({"line": "x"}), []),
    "end-a-string": (json.dumps({"path": "p", "end": "4", "part": 0, "parts": 1, "line": "x"}), []),
    "part-a-list": (json.dumps({"path": "p", "end": 4, "part": [0], "parts": 1, "line": "x"}), []),
    "path-a-table": (json.dumps({"path": {"a": 1}, "end": 4, "part": 0, "parts": 1, "line": "x"}), []),
    "line-a-number": (json.dumps({"path": "p", "end": 4, "part": 0, "parts": 1, "line": 5}), []),
    "not-json": ("garbage {", []),
    "nan": ('{"path": "p", "end": NaN, "part": 0, "parts": 1, "line": "x"}', []),
}


@pytest.mark.parametrize("case", sorted(LOG_LINES))
def test_hostile_log_entries_from_the_cluster_are_skipped_never_a_crash(capsys, case):
    line, shown = LOG_LINES[case]
    fake = StreamSsh((line + "\n").encode())
    try:
        code = forward._follow_logs(fake, "hpc-ddp", cli.commands["logs"], {"follow": True}, {"run_dir": "/r/x"})
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__}: {exc}")
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert [o.split("] ", 1)[-1] for o in out] == shown


def _debugger(**values):
    base = {"node": "hpcn1", "port": 5678, "rank": 0, "login_socket": "/run/user/0/hpc-ddp/dbg.sock",
            "owner_only": True}
    base.update(values)
    return {"debugger": {k: v for k, v in base.items() if v is not None}}


TUNNELS = {
    # status --json's answer -> "refused", or the socket the -L forwards to
    "good": (_debugger(), "/run/user/0/hpc-ddp/dbg.sock"),
    "a-list": ([1], "refused"),
    "debugger-a-number": ({"debugger": 5}, "refused"),
    "not-json": ("nope", "refused"),
    "port-a-bool": (_debugger(port=True), "refused"),
    "port-too-big": (_debugger(port=99999), "refused"),
    "port-negative": (_debugger(port=-1), "refused"),
    "port-zero": (_debugger(port=0), "refused"),
    "port-a-string": (_debugger(port="5678"), "refused"),
    "node-with-escape": (_debugger(node="n\x1b[2J"), "refused"),
    "node-a-number": (_debugger(node=5), "refused"),
    "socket-relative": (_debugger(login_socket="dbg.sock"), "refused"),
    "socket-like-an-option": (_debugger(login_socket="-oProxyCommand=x"), "refused"),
    "socket-with-newline": (_debugger(login_socket="/run/a\nb"), "refused"),
    "socket-a-list": (_debugger(login_socket=["/run/a"]), "refused"),
    "owner-only-missing": (_debugger(owner_only=None), "refused"),
    "owner-only-a-string": (_debugger(owner_only="yes"), "refused"),
}


@pytest.mark.parametrize("case", sorted(TUNNELS))
def test_hostile_debugger_answers_open_no_tunnel_and_are_one_line(monkeypatch, case):
    answer, expected = TUNNELS[case]
    fake = FakeSsh(answer if isinstance(answer, str) else json.dumps(answer))
    fake.options = lambda: []
    opened = []
    fake.bounded = lambda argv, **kw: opened.append(argv) or ssh.Done(0, b"", b"")  # ssh -O forward
    try:
        forward._tunnel(fake, "hpc-ddp", {"run_dir": "/r/x", "job_id": "1"})
    except UserError as exc:
        assert expected == "refused" and "\n" not in str(exc) and not opened
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__}: {exc}")
    assert expected != "refused", opened
    assert len(opened) == 1 and opened[0][opened[0].index("-L") + 1].endswith(f":{expected}")
    assert opened[0][-2:] == ["--", "c"]


LIST_ANSWERS = [b"[]", b"{}", b"5", b'[1, "x", null]', b'[{"job_id": "1", "slurm": 5}]', b"not json",
                b'[{"job_id": ["1"], "slurm": {"state": "RUNNING"}}]', b'[{"job_id": "1", "slurm": "RUNNING"}]',
                bytes(range(256))]


@pytest.mark.parametrize("answer", LIST_ANSWERS, ids=[ascii(a)[:20] for a in LIST_ANSWERS])
def test_hostile_list_answers_leave_the_state_unknown_never_a_crash(monkeypatch, answer, capsys):
    monkeypatch.setattr(forward, "Ssh", lambda host, env: FakeSsh(answer))
    records = forward.with_remote_accounting([{"job_id": "1", "host": "c", "run_dir": "/r/x"}], {})
    assert records[0].get("slurm") is None or isinstance(records[0]["slurm"], dict)


# ------------------------------------------------------------------- the profile sent, as the cluster reads it

PROFILE_VALUES = {
    "quotes-and-backslashes": 'a "b" \\c \'d\'',
    "triple-quotes": '"""x"""',
    "newline-and-escape": "a\nb\x1b[2J\x07",
    "nul": "a\x00b",
    "unicode": "\u00e9\U0001F680\u202e",
    "key-like-a-table": {"a.b": 1, "[x]": 2, "": 3},
    "nested-arrays": [[1, 2], ["a", [True, False]]],
    "huge-int": 2 ** 62,
    "negative-zero": -0.0,
    "tiny-float": 5e-324,
    "empty-array": [],
    "array-of-tables": [{"a": 1}, {"b": "x"}],
}


@pytest.mark.parametrize("case", sorted(PROFILE_VALUES))
def test_profile_values_reach_the_cluster_as_they_were(case):
    from hpc_ddp.remote.site import profile_toml
    from hpc_ddp.spec.config import tomllib

    table = {"value": PROFILE_VALUES[case]}
    assert tomllib.loads(profile_toml("c", table)) == {"c": table}


@pytest.mark.parametrize("value", [datetime.date(2026, 1, 1), datetime.time(12, 0), object()],
                         ids=["a-toml-date", "a-toml-time", "an-object"])
def test_profile_values_toml_cannot_hold_are_refused_in_one_line(value):
    from hpc_ddp.remote.site import profile_toml

    with pytest.raises(UserError) as err:
        profile_toml("c", {"value": value})
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ the CLI: --ssh HOST

SSH_FLAGS = ["-oProxyCommand=touch PWNED", "login:/tmp", "a b", "::1", "a\nb", "-F/tmp/cfg", "h\u00f6st",
             "host;touch PWNED", "$(touch PWNED)", "x::module"]


@pytest.mark.parametrize("value", SSH_FLAGS, ids=[ascii(v)[:24] for v in SSH_FLAGS])
def test_cli_a_hostile_ssh_host_is_refused_before_anything_is_listed_or_run(tmp_path, monkeypatch, short, value):
    from click.testing import CliRunner

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ssh", "rsync"):
        (bin_dir / name).write_text(f"#!/bin/sh\ntouch '{tmp_path}/RAN-{name}'\n")
        (bin_dir / name).chmod(0o755)
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text("print(1)\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(tmp_path / "runs.jsonl"))
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    monkeypatch.setenv("HOME", str(tmp_path))  # the project has its place under the cluster's home
    monkeypatch.setenv("HPC_DDP_SSH_CONTROL_DIR", str(short / "c"))
    monkeypatch.chdir(project)
    result = CliRunner().invoke(cli, ["submit", "--ssh", value, "train.py"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("hpc-ddp: error:")]
    assert len(errors) == 1 and "is not a host name" in errors[0], result.output
    assert not list(tmp_path.rglob("RAN-*")) and not list(tmp_path.rglob("PWNED"))
    assert not (tmp_path / "runs.jsonl").exists() and not (project / "runs").exists()
