"""Commands on a run submitted from this laptop over ssh: `status`, `logs`, `cancel`, `preempt` and
`timeline` find it in the registry (host, remote run dir), the cluster's hpc-ddp runs them over the shared
connection, and the answer is printed here as the local command prints it (its exit code too).

`logs -f` survives a dropped connection: the cluster says where each line ends in its log file, and a
reconnect asks for what follows, so no line is printed twice and none is missed. `timeline` draws on the
cluster and fetches the picture.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.registryfile import registry_path
from hpc_ddp.common.terminal import printable
from hpc_ddp.launch.shellwords import bash_word
from hpc_ddp.remote.answers import parse_debug_target, parse_log_entry, parse_run_states, parse_wrote
from hpc_ddp.remote.argv import words_of
from hpc_ddp.remote.site import command_words
from hpc_ddp.remote.ssh import DRAIN_S, SSH_FAILED, Ssh, check_host, classify, killed, raise_if_lost, unbounded
from hpc_ddp.spec.config import profiles_path, read_toml

__all__ = ["remote_run", "forward", "with_remote_accounting", "RECONNECTS"]

_JOB_ID = re.compile(r"\d+(_\d+)?")  # HOST:JOB of a run not submitted from here
RECONNECTS = 30        # logs -f: tries to reconnect before giving up (a few seconds apart)
_RECONNECT_S = 2.0


def remote_run(ref: str | None, env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The registry's record of a run submitted over ssh that `ref` names (a job id, a sweep's array job
    id, the remote run dir, HOST:RUN_DIR; None: the most recent run, if that one is remote); None where
    `ref` names no such run, or a local run names it more recently. A bare job id that runs of two hosts
    have is refused: HOST:JOB says which. HOST:/RUN_DIR and HOST:JOB of a run not submitted from here stand
    for themselves (`_elsewhere`)."""
    records = [r for r in read_jsonl(registry_path(env)) if isinstance(r, dict) and r.get("run_dir")]
    if ref is None:
        last = records[-1] if records else {}
        return _checked(_as_run(last, last.get("sweep"))) if last.get("host") else None  # a sweep's task: the sweep
    found: list[dict[str, Any]] = []
    for record in reversed(records):
        names = {str(record.get("job_id")), str(record.get("run_dir")), str(record.get("array_job_id")),
                 str(record.get("sweep"))} - {"None"}
        host = record.get("host")
        if not host:
            if ref in names:
                if not found:
                    return None  # a local run of that name, more recent
                break
            continue
        if ref in names and not (ref == record.get("run_dir") and os.path.isdir(ref)):
            found.append(record)
        elif isinstance(host, str) and ref.startswith(host + ":") and ref[len(host) + 1:] in names:
            # HOST:JOB, HOST the record's own (an [IPv6] host and a run dir may hold colons too)
            return _checked(_as_run(record, ref[len(host) + 1:]))
    hosts = sorted({str(r["host"]) for r in found})
    if len(hosts) > 1:
        raise UserError(f"{ref} names runs on {len(hosts)} clusters ({', '.join(hosts)})",
                        hint=f"say which: {hosts[0]}:{ref}")
    return _checked(_as_run(found[0], ref)) if found else _elsewhere(ref, records, env)


def _elsewhere(ref: str, records: list[dict[str, Any]], env: Mapping[str, str]) -> dict[str, Any] | None:
    """HOST:/RUN_DIR or HOST:JOB of a run this laptop did not submit (started on the cluster, or by a
    colleague whose run dir one can read): the cluster's hpc-ddp is asked, as for a run from here. HOST is
    what ssh takes, or the name of a profile with `ssh = ...`; the cluster's hpc-ddp is the one the last run
    submitted there used, else a profile's `remote_hpc_ddp` for that host, else `hpc-ddp` on its PATH. None
    for anything else, and for a path that exists here (a local run dir named with a colon)."""
    host, colon, where = ref.partition(":/") if ":/" in ref else ref.rpartition(":")
    if not colon or not host or os.path.exists(ref):
        return None
    host, profiled = _profile_for(host, env)
    try:
        check_host(host)
    except UserError:
        return None  # not a host: the local commands say what they make of it
    if colon == ":/":
        where = "/" + where
    elif not _JOB_ID.fullmatch(where):
        if not any(r.get("host") == host for r in records):
            return None  # a local name with a colon, most likely
        raise UserError(f"{ref}: a run on {host} is named by its absolute run dir or its job id",
                        hint=f"{host}:/path/to/run (the run dir as the cluster shows it: realpath RUN_DIR there), "
                             f"or {host}:JOB_ID")
    if not where.isprintable():
        raise UserError(f"{ref!r} holds a control character", hint="give the run dir as `ls` on the cluster shows it")
    known = [r.get("remote_hpc_ddp") for r in records if r.get("host") == host and r.get("remote_hpc_ddp")]
    record = {"host": host, "run_dir": where, "job_id": None, "remote_hpc_ddp": known[-1] if known else profiled}
    return _checked(record)  # a job id goes as it is: the cluster's own registry or queue knows it


def _profile_for(host: str, env: Mapping[str, str]) -> tuple[str, str | None]:
    """(the ssh host, its remote_hpc_ddp) that the profiles file gives for HOST: the profile named HOST, or
    one whose `ssh` is HOST; (HOST, None) where none does, or the file cannot be read."""
    try:
        path = profiles_path(env)
        tables = read_toml(path, "profiles file") if path.is_file() else {}
    except (UserError, OSError):
        return host, None
    tables = {k: v for k, v in tables.items() if isinstance(v, dict)}
    named = tables.get(host, {})
    if isinstance(named.get("ssh"), str):
        hpc_ddp = named.get("remote_hpc_ddp")
        return named["ssh"], hpc_ddp if isinstance(hpc_ddp, str) else None
    for table in tables.values():
        if table.get("ssh") == host and isinstance(table.get("remote_hpc_ddp"), str):
            return host, table["remote_hpc_ddp"]
    return host, None


def _checked(record: dict[str, Any]) -> dict[str, Any]:
    """A remote run's record as the commands forwarded for it use it: its host one ssh takes, its run dir
    absolute and printable (the cluster's hpc-ddp gets it as an argument: one that began with '-' would be an
    option there; or HOST:JOB's job id), remote_hpc_ddp a string. A damaged registry line is one line here,
    never a traceback."""
    check_host(record.get("host"))
    run_dir, hpc_ddp = record.get("run_dir"), record.get("remote_hpc_ddp")
    if not (isinstance(run_dir, str) and (run_dir.startswith("/") or _JOB_ID.fullmatch(run_dir))
            and run_dir.isprintable()) or not (
            hpc_ddp is None or (isinstance(hpc_ddp, str) and hpc_ddp.isprintable())):
        raise UserError(f"the registry's record of job {record.get('job_id')!r} on {record.get('host')} is damaged "
                        f"(run dir {run_dir!r}, remote_hpc_ddp {hpc_ddp!r})",
                        hint="remove that line from the registry (hpc-ddp list shows where it is)")
    return record


def _as_run(record: dict[str, Any], ref: str | None) -> dict[str, Any]:
    """A sweep's record named by its array job id or sweep dir stands for the sweep (its dir)."""
    if ref is not None and record.get("sweep") and ref in (str(record.get("array_job_id")), record["sweep"]):
        return {**record, "run_dir": record["sweep"], "job_id": record.get("array_job_id")}
    return record


def forward(command: click.Command, params: dict[str, Any], record: dict[str, Any], job_param: str,
            how: str = "plain", env: Mapping[str, str] = os.environ) -> int:
    """Run `command` with `params` on the record's host, for its remote run dir; its exit code. `how`:
    "plain", "follow" (a log that reconnects while --follow) or "picture" (drawn there, fetched here)."""
    ssh = Ssh(record["host"], env)
    hpc_ddp = command_words(str(record.get("remote_hpc_ddp") or "hpc-ddp"))
    if how == "follow" and params.get("follow"):
        return _follow_logs(ssh, hpc_ddp, command, params, record)
    if how == "picture":
        return _picture(ssh, hpc_ddp, command, params, record, job_param)
    if params.get("tunnel"):
        return _tunnel(ssh, hpc_ddp, record)
    words = words_of(command, {**params, job_param: record["run_dir"]})
    return _pass_through(ssh, f"exec {hpc_ddp} {command.name} {shlex.join(words)}\n", raw=how == "follow")


def _pass_through(ssh: Ssh, script: str, raw: bool = False) -> int:
    """Run the script there, its output shown here as it comes; ssh's own failure is one line. What the
    other side says is shown through `printable`, but for `raw` (logs: the ranks' own output, as a local
    `logs` passes it on)."""
    proc = ssh.stream(script)
    said = _Tee(proc.stderr)
    shown = _Tee(proc.stdout, sys.stdout, keep=False, clean=None if raw else printable)
    try:
        while True:  # ended at the call's bound (Ssh.stream), or after its silence: never a wait on a pipe
            try:
                code = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - max(shown.last, said.last) > ssh.silence_s:
                    proc.kill()
                    proc.wait()
                    unbounded(proc)
                    raise ssh.lost(ssh.silence_s, silent=True) from None
    except KeyboardInterrupt:
        proc.terminate()
        raise
    deadline = time.monotonic() + DRAIN_S  # what is still in the pipes; one a child left behind holds is left to it
    for tee in (shown, said):
        tee.join(max(0.0, deadline - time.monotonic()))
    raise_if_lost(proc)
    if code == SSH_FAILED:  # hpc-ddp never exits 255: ssh could not connect, or the connection dropped
        raise classify(ssh.host, said.text())
    if code < 0:
        raise killed(ssh.host, code)
    return code


class _Tee(threading.Thread):
    """A remote stream shown here as it comes: stderr (the default) kept too, since ssh's own words among
    it tell why it failed, and shown without them; stdout passed on through `clean` (None: as it is)."""

    def __init__(self, stream, to=None, keep: bool = True, clean=printable) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines, self.to, self.keep, self.clean = stream, [], to, keep, clean
        self.last = time.monotonic()  # when the last line came
        self.start()

    def run(self) -> None:
        to = self.to or sys.stderr
        try:
            for raw in self.stream:
                self.last = time.monotonic()
                line = raw.decode(errors="replace")
                if self.keep:
                    self.lines.append(line)
                if self.to is None and _is_ssh_noise(line):
                    continue
                to.write(self.clean(line) if self.clean else line)
                to.flush()
        except (OSError, ValueError):
            pass  # the pipe closed under us: the call is over

    def text(self) -> str:
        return "".join(self.lines)


def _is_ssh_noise(line: str) -> bool:
    """ssh's own messages (kept for `classify`, not shown): a dropped connection is said in our words."""
    return line.startswith(("ssh: ", "Connection to ", "client_loop: ", "Timeout, server ", "mux_client_",
                            "ControlSocket ", "kex_exchange_identification", "Warning: Permanently added"))


class LogCursor:
    """Where `logs -f` is in each log file: `offsets` (the end of the last line shown whole) is what a
    reconnect asks to start from; `take` says whether an entry is new (a line shown in part before the
    drop comes again whole: its parts already shown are skipped)."""

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self._parts: dict[str, int] = {}   # a line shown in part: how many of its parts were shown

    def take(self, path: str, end: int, part: int, parts: int) -> bool:
        new = part >= self._parts.get(path, 0)
        if part + 1 == parts:
            self.offsets[path], self._parts[path] = end, 0
        elif new:
            self._parts[path] = part + 1
        return new


def _follow_logs(ssh: Ssh, hpc_ddp: str, command: click.Command, params: dict[str, Any], record: dict[str, Any]) -> int:
    """logs -f, reconnecting where the connection drops, from where each file was read to."""
    cursor = LogCursor()
    words = [str(command.name), "-f", record["run_dir"]] + (["--rank", str(params["rank"])] if params.get("rank") is not None else [])
    tries = 0
    while True:
        script = f"exec {hpc_ddp} {shlex.join(words)} --from {shlex.quote(json.dumps(cursor.offsets))}\n"
        proc = ssh.stream(script)
        unbounded(proc)  # follows as long as asked; the keep-alives notice a dead link
        said = _Tee(proc.stderr)
        assert proc.stdout is not None
        try:
            for raw in proc.stdout:
                entry = parse_log_entry(raw)
                if entry is None:
                    continue  # not what the cluster's logs --from writes: never a traceback here
                if not cursor.take(entry.path, entry.end, entry.part, entry.parts):
                    continue  # shown before the connection dropped
                shown = entry.line if entry.attempt is None else \
                    f"[attempt {entry.attempt} rank {entry.rank}] {entry.line}"
                click.echo(json.dumps({"attempt": entry.attempt, "rank": entry.rank, "line": entry.line})
                           if params.get("as_json") else shown)
                tries = 0
        except KeyboardInterrupt:
            proc.terminate()
            raise
        code = proc.wait()
        said.join()
        if code < 0:
            raise killed(ssh.host, code)
        if code != SSH_FAILED:
            return code
        tries += 1
        if tries > RECONNECTS:
            raise classify(ssh.host, said.text())
        click.echo(f"hpc-ddp: the connection to {ssh.host} dropped; reconnecting ({tries}/{RECONNECTS})", err=True)
        time.sleep(_RECONNECT_S)


def _picture(ssh: Ssh, hpc_ddp: str, command: click.Command, params: dict[str, Any], record: dict[str, Any],
             job_param: str) -> int:
    """Draw on the cluster (into the run dir), fetch the picture here: -o, or ./COMMAND-JOB.png."""
    out = Path(params.get("output") or f"{command.name}-{record.get('job_id') or 'run'}.png")
    words = words_of(command, {**params, job_param: record["run_dir"], "output": None})
    done = ssh.run(f"exec {hpc_ddp} {command.name} {shlex.join(words)}\n", check=False)
    sys.stderr.write(printable(done.stderr.decode(errors="replace")))
    if done.returncode != 0:
        return done.returncode
    drawn, lines = parse_wrote(done.text)
    if drawn is None:
        raise UserError(f"the cluster's timeline wrote no picture: {done.text.strip()[:200]!r}")
    picture = ssh.run(f"exec cat {shlex.quote(drawn)}\n")
    try:
        out.write_bytes(picture.stdout)
    except OSError as exc:
        raise UserError(f"cannot write {str(out)!r}: {exc.strerror or exc}", hint="give -o PNG") from None
    for line in lines:
        click.echo(printable(line))
    click.echo(printable(f"Wrote {out} (drawn on {ssh.host}: {drawn})"))
    return 0


def _tunnel(ssh: Ssh, hpc_ddp: str, record: dict[str, Any]) -> int:
    """Open localhost:PORT -> the debug rank, for its owner alone, through the shared connection: the
    cluster's `hpc-ddp attach` (started there in the background; it ends when the rank no longer waits)
    serves a Unix socket of the user's on the login node and relays through srun to the rank's node; `ssh -O
    forward` (no new login) forwards the port here to that socket. Another port here where PORT is taken."""
    done = ssh.run(f"exec {hpc_ddp} status --json {shlex.quote(record['run_dir'])}\n")
    target = parse_debug_target(done.stdout)
    if target is None:
        raise UserError(f"no rank of job {record.get('job_id')} on {ssh.host} waits for a debugger now",
                        hint="submit with --debug-rank R; `hpc-ddp status` shows the rank once it waits")
    quoted = shlex.quote(target.login_socket)
    # One attach per rank: a second one started here finds the socket served and ends at once.
    started = ssh.run(f"setsid {hpc_ddp} attach {shlex.quote(record['run_dir'])} </dev/null >/dev/null 2>&1 &\n"
                      f"i=0; while [ ! -S {quoted} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done\n"
                      f"[ -S {quoted} ]\n", check=False)
    if started.returncode != 0:
        raise UserError(f"`hpc-ddp attach` did not start on {ssh.host} within 10 s",
                        hint=f"run it there to see why: ssh {ssh.host} {hpc_ddp} attach {record.get('job_id')}")
    local = _free(target.port) or _free(0)
    opened = ssh.bounded(["ssh", *ssh.options(), "-O", "forward", "-L", f"127.0.0.1:{local}:{target.login_socket}",
                          "--", ssh.host])
    if opened.returncode != 0:
        raise UserError(f"could not open the tunnel to {target.login_socket} on {ssh.host}: "
                        f"{opened.stderr.decode(errors='replace').strip() or opened.returncode}",
                        hint=f"run `hpc-ddp attach {bash_word(str(record.get('job_id')))}` on {ssh.host}, then: "
                             f"ssh -N -L {local}:{bash_word(target.login_socket)} {ssh.host}")
    click.echo(f"tunnel open: localhost:{local} -> {target.node}: rank {target.rank} waits there, reached through "
               f"`hpc-ddp attach` on {ssh.host}, for you alone; attach VS Code or PyCharm to localhost:{local}; "
               "your project's paths are mapped to the run's copy")
    return 0


def _free(port: int) -> int:
    """`port` where nothing here listens on it (0: any free port), else 0."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return 0
        return probe.getsockname()[1]


def with_remote_accounting(records: list[dict[str, Any]], env: Mapping[str, str] = os.environ) -> list[dict[str, Any]]:
    """`list`: the state of each run submitted over ssh, from its cluster's `hpc-ddp list` (one call per
    host); a host that cannot be reached leaves its runs' state unknown, with a warning."""
    hosts: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("host"):  # a damaged record's host (a list, a number) is still one host of the list
            hosts.setdefault(str(record["host"]), []).append(record)
    for host, mine in hosts.items():
        try:
            hpc_ddp = command_words(str(mine[-1].get("remote_hpc_ddp") or "hpc-ddp"))
            done = Ssh(host, env).run(f"exec {hpc_ddp} list --json -n 1000\n", timeout=60)
            theirs = parse_run_states(done.stdout)
        except (UserError, ValueError) as exc:
            click.echo(printable(f"warning: the state of the runs on {host} is not known: {exc}"), err=True)
            continue
        except Exception as exc:  # noqa: BLE001 - one host's failure never hides the list
            click.echo(printable(f"warning: the state of the runs on {host} is not known: {exc}"), err=True)
            continue
        for record in mine:
            found = theirs.get(str(record.get("job_id")))
            if found is not None:
                record["slurm"] = dict(found)
    return records
