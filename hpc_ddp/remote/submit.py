"""`submit --ssh HOST` (or a profile with ssh = "HOST"), from the laptop:

1. list and hash the project here, as a snapshot would (snapshot.listing; the same rules and limits, the
   job file's and profile's snapshot settings included);
2. one ssh call asks the cluster for its hpc-ddp's version, rsync, the mirror folder's state (whose
   project it holds, whether a folder the files go into is a link or a file there), that it is writable,
   and its free space; what would fail later is refused in one line (no hpc-ddp or another version, a
   folder hpc-ddp did not make or made for another project, a link in the way, a disk too full);
3. the project's files go into the mirror with rsync (what changed since the last submit to that host; a
   tar over ssh where either side has no rsync 3), over the same shared connection;
4. the cluster's hpc-ddp submits, from the mirror, with the manifest: it checks every file against the
   laptop's size and hash before it copies them into the run dir (a copy a dropped connection left
   half-done never runs); its answer is also kept there, so a connection lost meanwhile loses no job;
5. its answer is printed as a local submit prints it, and every job recorded here (host, remote run dir).

The mirror is hpc-ddp's (a `.hpc-ddp-mirror` folder marks it, naming the laptop project it holds):
shipping writes the project's files there and nothing else; the cluster's own data/ and runs/ beside them
are never touched, and a link of the user's in the way stops the submit instead of being written through.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from hpc_ddp import __version__
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.registryfile import register
from hpc_ddp.common.terminal import printable
from hpc_ddp.common.units import MB, human_bytes
from hpc_ddp.launch.shellwords import bash_word
from hpc_ddp.remote.answers import Hello, Submitted, parse_hello, parse_submitted
from hpc_ddp.remote.site import Site, command_words, profile_toml, remote_dir_for, shell_words
from hpc_ddp.remote.ssh import SELF_BOUNDED, SSH_FAILED, SUBMIT_SILENCE_S, Ssh, classify
from hpc_ddp.snapshot import shipped, snapshot
from hpc_ddp.snapshot.gitinfo import Git
from hpc_ddp.snapshot.listing import Listing, check_limits, list_project, parents, project_root
from hpc_ddp.spec.code import DEFAULT_MAX_MB, parse_excludes
from hpc_ddp.spec.config import resolve_target
from hpc_ddp.spec.jobspec import JobSpec
from hpc_ddp.spec.sweep import describe

__all__ = ["submit_over_ssh", "MARK"]

MARK = ".hpc-ddp-mirror"      # the folder that marks a mirror as hpc-ddp's (and holds its manifests)
_ROOM = 1.2                   # the mirror needs this much free space for what it ships (+ 10 MB)


def submit_over_ssh(site: Site, params: dict[str, Any], argv: list[str], job: dict[str, Any],
                    env=os.environ) -> int:
    """Ship and submit; the exit code (the cluster's submit's). `job`: the job file's values, if any."""
    cwd = Path(os.path.realpath(os.getcwd()))
    project, script_rel = _project(params, cwd)
    excludes, max_mb = _snapshot_settings(params, site, job)
    listing, snap_id, hashes = _list(project, excludes, max_mb)
    remote = remote_dir_for(site, project)
    origin = f"{socket.gethostname()}:{project}"
    ssh = Ssh(site.host, env)
    hello = _hello(ssh, site, remote, listing, origin)
    mirror = hello.dir
    where = cwd.relative_to(project).as_posix() if cwd.is_relative_to(project) else None
    if script_rel is not None and where is None:  # the shell is outside the project: run from the script's folder
        where = os.path.dirname(script_rel)
    args = _rewrite_target(argv, params, cwd, project, where)
    answer_name = f"answer-{secrets.token_hex(8)}.json"
    for checksum in (False, True):
        _ship(ssh, hello, project, listing, origin, checksum=checksum)
        manifest = shipped.manifest(listing, snap_id, hashes)
        done = _submit(ssh, site, mirror, where or "", manifest, args, answer_name)
        if checksum or done.returncode != 2 or snapshot.INCOMPLETE.encode() not in done.stderr:
            break
        # rsync's quick check (size and time) took a changed file for unchanged, or a file changed here
        # while it was shipped: list and hash again, and compare contents this time
        listing, snap_id, hashes = _list(project, excludes, max_mb)
    sys.stderr.write(printable(done.stderr.decode(errors="replace")))  # the cluster's words: shown, not obeyed
    try:
        answer = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        raise UserError(f"the answer of {site.host}'s hpc-ddp is not JSON: {done.text.strip()[:200]!r}",
                        hint=f"the job may be queued there: look with `ssh {bash_word(site.host)} hpc-ddp list`; check "
                             f"that `ssh {bash_word(site.host)} echo hi` prints only hi (a shell start-up file that prints is the usual "
                             "cause)") from None
    if answer is None:
        return done.returncode
    _report(site, answer, params, env)
    return done.returncode


# ------------------------------------------------------------------------------------------------ here


def _project(params: dict[str, Any], cwd: Path) -> tuple[Path, str | None]:
    """The project's root here (the git repo's, else the script's folder, else the working directory for
    -m) and the script or job file in it."""
    argv = list(params.get("argv") or ())
    module = params.get("module")
    target = resolve_target(None if module else (argv[0] if argv else None), module, tuple(argv[1:]), cwd)
    spec = JobSpec(target, job_name="ship", workdir=str(cwd), python=sys.executable)
    found = project_root(spec, Git())
    if found is None:  # -m of a module not in this folder
        raise UserError(f"-m {module}: the module is not in this folder, so there is no project to ship",
                        hint="run the command in the project's folder (where the module's package is)")
    root, script = found
    if root == Path(root.anchor):
        raise UserError(f"the project would be the whole filesystem ({root})",
                        hint="move the script into a project folder")
    return root, script


def _snapshot_settings(params: dict[str, Any], site: Site, job: dict[str, Any]) -> tuple[list[str], int]:
    """The snapshot's excludes and size limit, from the flags, the job file and the profile (all of them
    add excludes; the first that sets the limit wins). With snapshot off the files are shipped all the same
    (the cluster must have the code), within the same limit."""
    profile = site.profile or {}
    excludes: list[str] = []
    for origin, raw in (("the profile", profile.get("snapshot_exclude")), ("the job file", job.get("snapshot_exclude")),
                        ("--snapshot-exclude", list(params.get("snapshot_exclude") or ()) or None)):
        if raw is None:
            continue
        try:
            excludes += parse_excludes(raw)
        except ValueError as exc:
            raise UserError(f"{origin}: snapshot_exclude: {exc}") from None
    limit = params.get("snapshot_max_mb") or job.get("snapshot_max_mb") or profile.get("snapshot_max_mb") or DEFAULT_MAX_MB
    try:
        max_mb = int(limit)
        if max_mb < 1:
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"snapshot_max_mb {limit!r} is not a positive number of MB") from None
    return excludes, max_mb


def _list(project: Path, excludes: list[str], max_mb: int) -> tuple[Listing, str, dict[str, str]]:
    listing = list_project(project, excludes, Git(), max_bytes=max_mb * MB)
    check_limits(listing, max_mb)
    snapshot_id, hashes = snapshot.hashed(listing, max_mb * MB)
    return listing, snapshot_id, hashes


def _rewrite_target(argv: list[str], params: dict[str, Any], cwd: Path, project: Path, where: str | None) -> list[str]:
    """The command line for the cluster: the script (or job file) as a path from the folder it runs in."""
    words = list(params.get("argv") or ())
    if not words or params.get("module"):
        return argv
    local = Path(os.path.realpath(cwd / words[0]))
    relative = os.path.relpath(local, project / (where or ""))
    cut = len(argv) - len(words)
    return [*argv[:cut], relative, *argv[cut + 1:]]


def _report(site: Site, answer: dict[str, Any], params: dict[str, Any], env) -> None:
    """Print the cluster's answer as a local submit prints its own; record every job it queued."""
    host = site.host
    submitted = parse_submitted(answer, host)
    if params.get("as_json"):
        click.echo(printable(json.dumps({**submitted.raw, "host": host}, indent=2)))
    if params.get("dry_run"):
        if not params.get("as_json"):
            raw = submitted.raw
            click.echo(printable(str(raw.get("script") or raw.get("plan") or json.dumps(raw, indent=2))), nl=False)
        return
    records = _records(submitted, host, site.hpc_ddp)
    for record in records:
        try:
            register(record, env)
        except OSError as exc:
            click.echo(f"warning: could not record the run in the registry: {exc}", err=True)
            break
    if not params.get("as_json"):
        _say(submitted, host)
    if params.get("debug_rank") is not None and records:
        click.echo(f"hpc-ddp: rank {params['debug_rank']} will wait for a debugger once the job runs: "
                   f"`hpc-ddp status --tunnel {records[0]['job_id']}` then opens the tunnel from here", err=True)


def _records(answer: Submitted, host: str, hpc_ddp: str) -> list[dict[str, Any]]:
    """A registry record per job the cluster queued: each job of a chain, each task of a sweep."""
    common = {"executor": answer.executor, "host": host, "remote_hpc_ddp": hpc_ddp}
    if answer.tasks is not None:
        sweep = answer.sweep_dir
        return [{**common, "job_id": t.job_id, "run_dir": t.run_dir, "sweep": sweep, "task": t.task,
                 "values": dict(t.values), **({"array_job_id": answer.array_job_id} if answer.array_job_id else {}),
                 "name": Path(sweep or "sweep").name} for t in answer.tasks if t.job_id]
    run_dir = answer.run_dir
    name = re.sub(r"-\d{8}-\d{6}$", "", Path(run_dir).name) if run_dir else "run"
    return [{**common, "job_id": job_id, "run_dir": run_dir, "name": name} for job_id in answer.job_ids if run_dir]


def _say(answer: Submitted, host: str) -> None:
    if answer.tasks is not None:
        tasks = answer.tasks
        head = f"array job {answer.array_job_id}" if answer.array_job_id else "a sweep"
        click.echo(printable(f"Submitted {head} ({answer.executor} on {host}): {len(tasks)} task"
                             f"{'s' if len(tasks) != 1 else ''}, sweep dir {host}:{answer.sweep_dir}"))
        for t in tasks:
            click.echo(printable(f"  task {t.task}: job {t.job_id}  {describe(dict(t.values))}"))
        return
    ids = answer.job_ids or (None,)
    if len(ids) > 1:
        click.echo(printable(f"Submitted jobs {', '.join(map(str, ids))} ({answer.executor} on {host}; a chain); "
                             f"run dir {host}:{answer.run_dir}"))
    else:
        click.echo(printable(f"Submitted job {ids[0]} ({answer.executor} on {host}); run dir {host}:{answer.run_dir}"))


# ------------------------------------------------------------------------------------------ the cluster


def _encoded(text: str) -> str:
    """`text` as an argument of printf %b that makes it back byte for byte (octal escapes only: nothing
    in it the shell could read as code, a newline in a name included)."""
    return "".join(f"\\0{b:03o}" for b in text.encode(errors="surrogateescape"))


def _hello(ssh: Ssh, site: Site, remote: str, listing: Listing, origin: str) -> Hello:
    """One call: the cluster's hpc-ddp version, rsync, the mirror's folder (absolute), its state and the
    project it holds, the first folder to ship into that is a link or a file there, write access, free KB."""
    folders = sorted({p for item in listing.items if item.kind != "live"
                      for p in parents(item.rel.rpartition("/")[0]) if p})
    encoded = {_encoded(f): f for f in folders}
    end = f"HPC_DDP_{secrets.token_hex(8)}"
    script = f"""
D={shell_words(remote)}
V=$({command_words(site.hpc_ddp)} --version 2>/dev/null) || V=missing
printf 'version=%s\\n' "$V"
if command -v rsync >/dev/null 2>&1; then printf 'rsync=%s\\n' "$(rsync --version 2>/dev/null | head -n 1)"; else echo rsync=no; fi
printf 'dir=%s\\n' "$D"
if [ -L "$D" ]; then echo state=link
elif [ -d "$D/{MARK}" ] && [ ! -L "$D/{MARK}" ] && [ -O "$D/{MARK}" ]; then echo state=ours
elif [ -d "$D" ] && [ -z "$(ls -A "$D" 2>/dev/null)" ]; then echo state=empty
elif [ -e "$D" ]; then echo state=foreign
else echo state=absent; fi
if [ -f "$D/{MARK}/origin" ]; then printf 'origin=%s\\n' "$(head -n 1 "$D/{MARK}/origin")"; fi
for m in "$D/{MARK}" "$D/{MARK}/shipped" "$D/{MARK}/origin" "$D/{MARK}/profiles.toml"; do
    if [ -L "$m" ]; then echo mark=link; break; fi
done
if [ -e "$D/{MARK}/shipped" ] && [ ! -d "$D/{MARK}/shipped" ]; then echo mark=notdir; fi
if [ -d "$D" ] && [ ! -L "$D" ]; then
    while IFS= read -r enc; do
        f=$(printf '%bx' "$enc"); f=${{f%x}}
        if [ -L "$D/$f" ] || {{ [ -e "$D/$f" ] && [ ! -d "$D/$f" ]; }}; then printf 'blocked=%s\\n' "$enc"; break; fi
    done <<'{end}'
{chr(10).join(encoded)}
{end}
fi
P=$D; while [ ! -e "$P" ]; do P=$(dirname "$P"); done
printf 'free_kb=%s\\n' "$(df -Pk "$P" 2>/dev/null | awk 'NR==2 {{print $4}}')"
if [ -d "$P" ] && [ -w "$P" ] && [ -x "$P" ]; then echo writable=yes; else printf 'writable=no\\nunwritable=%s\\n' "$P"; fi
"""
    said = parse_hello(ssh.run(script).text)
    if said.version is None:
        raise UserError(f"there is no hpc-ddp on {ssh.host} (tried {site.hpc_ddp!r})",
                        hint=f"install hpc-ddp {__version__} there (pip install of a clone, or the wheel make dist builds), or name it with "
                             "remote_hpc_ddp = \"/path/to/venv/bin/hpc-ddp\" in the profile")
    theirs = said.version.rsplit(" ", 1)[-1]
    if theirs != __version__:
        raise UserError(f"{ssh.host} has hpc-ddp {_said(theirs)}, this laptop {__version__}: the two must be the same",
                        hint=f"install hpc-ddp=={__version__} on {ssh.host} (or this laptop's version there)")
    mirror = said.dir
    if mirror is None:
        raise UserError(f"{ssh.host} gave no absolute folder for {remote!r}: its answer is damaged",
                        hint=f"check that `ssh {bash_word(ssh.host)} echo hi` prints only hi (a shell start-up file that prints "
                             "is the usual cause), and that remote_dir in the profile names a folder")
    if said.state in ("foreign", "link"):
        raise UserError(f"{ssh.host}:{mirror} exists and is not a folder hpc-ddp made (no {MARK} in it): "
                        "the project is not shipped over it", hint="set remote_dir = \"~/another/folder\" in the "
                        "profile, or move that folder away on the cluster")
    if said.state == "ours" and said.origin and said.origin != json.dumps(origin):
        theirs_origin = _said(_decoded_origin(said.origin))
        raise UserError(f"{ssh.host}:{mirror} holds another project, shipped from {theirs_origin}",
                        hint="set remote_dir in the profile to give this project a folder of its own (or remove "
                             "that folder on the cluster if its project is gone)")
    if said.mark:
        raise UserError(f"{ssh.host}:{mirror}/{MARK} (hpc-ddp's own folder there) holds a link or a file where "
                        "hpc-ddp writes its manifests and answers: nothing is written through it",
                        hint=f"remove {mirror}/{MARK} on the cluster (hpc-ddp makes it again), or set remote_dir in "
                             "the profile")
    if said.blocked:
        rel = encoded.get(said.blocked, said.blocked)
        raise UserError(f"{ssh.host}:{mirror}/{_said(rel)} is a link or a file on the cluster, where this project has "
                        "a folder: nothing is shipped through it", hint="move it away on the cluster (the project's "
                        "folders are hpc-ddp's there), or leave that folder out (--snapshot-exclude)")
    if not said.writable:
        raise UserError(f"{ssh.host}:{said.unwritable or mirror} is not a folder you can write to, so the "
                        f"project cannot go to {mirror}", hint="set remote_dir = \"~/projects\" (a folder of yours "
                                                                "on the cluster) in the profile")
    size = listing.size
    if said.free_kb is not None and said.free_kb * 1024 < size * _ROOM + 10 * MB:
        raise UserError(f"{ssh.host} has {human_bytes(said.free_kb * 1024)} free where the project goes ({mirror}); "
                        f"it needs {human_bytes(int(size * _ROOM + 10 * MB))}",
                        hint="free space there (or set remote_dir to a filesystem with room)")
    return said


def _said(text: str) -> str:
    """What the cluster said, as one line of this terminal can show it: quoted where it holds a control
    character (an escape sequence would clear the screen)."""
    return text if text.isprintable() else repr(text)


def _decoded_origin(text: str) -> str:
    try:
        value = json.loads(text)
        return value if isinstance(value, str) else text
    except ValueError:
        return text


RSYNC_GRACE_S = 30  # an rsync silent this much longer than its own --timeout is ended


def _rsync_3(version_line: str | None, minor: int = 0) -> bool:
    """rsync 3 (3.`minor`) or later (not macOS's 2.6.9, nor openrsync): what -s and --from0 need (and
    --info=progress2, 3.1)."""
    found = re.match(r"rsync\s+version\s+v?(\d+)\.(\d+)", version_line or "")
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= (3, minor) \
        and "openrsync" not in (version_line or "")


def _local_rsync() -> str | None:
    if not shutil.which("rsync"):
        return None
    done = subprocess.run(["rsync", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else None


def _ship(ssh: Ssh, hello: Hello, project: Path, listing: Listing, origin: str,
          checksum: bool = False) -> None:
    """The project's files and links into the mirror: rsync sends only what changed (tar all, where
    either side has no rsync 3). A transfer cut short leaves the mirror partly updated; the next submit
    finishes it, and the cluster's submit checks every file against the manifest before a job may run."""
    mirror = shlex.quote(hello.dir)
    ssh.run(f"mkdir -p {mirror}/{MARK}/shipped && chmod 700 {mirror}/{MARK}\n"
            f"[ -f {mirror}/{MARK}/origin ] || printf '%s\\n' {shlex.quote(json.dumps(origin))} > {mirror}/{MARK}/origin\n")
    names = b"".join(i.rel.encode(errors="surrogateescape") + b"\0" for i in listing.items if i.kind != "live")
    if _rsync_3(hello.rsync) and _rsync_3(_local_rsync()):
        # Bounded by what moves, not by the clock: a big first copy over a slow link may take longer than
        # any one call should, while an rsync that moves nothing for the bound is a lost connection (30).
        # rsync 3.1 on both sides prints its progress as data moves: an rsync silent for well past its own
        # --timeout waits on its remote shell, and is ended (Ssh.bounded's silence).
        progress = _rsync_3(hello.rsync, minor=1) and _rsync_3(_local_rsync(), minor=1)
        argv = ["rsync", "-a", "-s", *(["--checksum"] if checksum else []), "--from0", "--files-from=-",
                *(["--info=progress2"] if progress else []),
                f"--timeout={max(1, int(ssh.timeout_s))}", "-e", ssh.rsh(), f"{project}/", f"{ssh.host}:{hello.dir}/"]
        done = ssh.bounded(argv, input=names, timeout=SELF_BOUNDED,
                           silence=max(1, int(ssh.timeout_s)) + RSYNC_GRACE_S if progress else None)
    else:
        tar = subprocess.Popen(["tar", "-C", str(project), "--null", "--no-recursion", "-T", "-", "-cf", "-"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert tar.stdin is not None and tar.stdout is not None
        tar.stdin.write(names)
        tar.stdin.close()
        try:
            done = ssh.bounded(ssh.argv(f"tar -xf - -C {mirror}"), stdin=tar.stdout)
        finally:
            tar.kill()  # done, or the other side hung: it never waits on a pipe nobody reads
            tar.wait()
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace")
        if "is your shell clean" in said or "protocol version mismatch" in said:
            raise UserError(f"rsync could not talk to {ssh.host}: the cluster's shell start-up files print something "
                            "on a login that is not interactive (a banner, a module list), and rsync reads it as "
                            "its protocol; nothing was submitted", hint=f"make ~/.bashrc (or ~/.cshrc, ~/.profile) on "
                            f"{ssh.host} print only in an interactive shell: put `case $- in *i*) ;; *) return;; esac` "
                            "before what prints (`ssh HOST true` must print nothing)")
        if done.returncode == SSH_FAILED and "connection unexpectedly closed" not in said:
            raise classify(ssh.host, said)
        if done.returncode in _DROPPED or done.returncode < 0 or "connection unexpectedly closed" in said \
                or "Broken pipe" in said:
            raise UserError(f"the connection to {ssh.host} dropped while the project was copied; nothing was "
                            "submitted", hint="submit again: the copy continues where it stopped")
        if "No space left" in said or "Disk quota exceeded" in said:
            raise UserError(f"{ssh.host} ran out of space (or quota) while the project was copied to {hello.dir}; "
                            "nothing was submitted", hint="free space there, or set remote_dir to another filesystem")
        lines = [ln for ln in said.strip().splitlines() if ln.strip() and not ln.startswith("rsync error:")]
        raise UserError(f"copying the project to {ssh.host} failed: {'; '.join(lines[-3:]) or done.returncode}",
                        hint=f"fix what it names in {hello.dir} on the cluster, then submit again")


# rsync's exit codes for a transfer cut short: the connection (12: protocol data stream, 255: ssh), a signal
# (20), a timeout (30, 35); a negative code: rsync itself was killed.
_DROPPED = (12, 20, 30, 35, 255)


def _submit(ssh: Ssh, site: Site, mirror: str, where: str, manifest: dict[str, Any], args: list[str],
            answer_name: str):
    """The cluster's side of submit: the manifest and profile written beside the mirror, then its submit,
    whose answer is kept in a file there too. A connection lost meanwhile is asked again for that answer:
    a job queued is never lost to the laptop, and never queued twice."""
    mark = f"{shlex.quote(mirror)}/{MARK}"
    path = f"{mark}/shipped/{manifest['id']}.json"
    answer = f"{mark}/shipped/{answer_name}"
    end = f"HPC_DDP_{secrets.token_hex(8)}"
    # each file written new (rm -f first: a link planted in its place is removed, never written through)
    lines = ["set -e", f"rm -f {path}.tmp", f"cat > {path}.tmp <<'{end}'", json.dumps(manifest), end,
             f"mv -f {path}.tmp {path}"]
    if site.profile_name and site.profile is not None:
        lines += [f"rm -f {mark}/profiles.toml.tmp", f"cat > {mark}/profiles.toml.tmp <<'{end}'",
                  profile_toml(site.profile_name, site.profile).rstrip("\n"), end,
                  f"mv -f {mark}/profiles.toml.tmp {mark}/profiles.toml", f"export HPC_DDP_PROFILES={mark}/profiles.toml"]
    folder = f"{shlex.quote(mirror)}/{shlex.quote(where)}" if where else shlex.quote(mirror)
    lines += [f"mkdir -p {folder}", f"cd {folder}", "set +e",
              f"rm -f {answer}.tmp",
              f"{command_words(site.hpc_ddp)} submit --json --shipped {path} {shlex.join(args)} > {answer}.tmp",
              "rc=$?", f"mv -f {answer}.tmp {answer}", f"cat {answer}", "exit $rc"]
    try:
        return ssh.run("\n".join(lines) + "\n", check=False, silence=max(ssh.silence_s, SUBMIT_SILENCE_S))
    except UserError:
        # the connection dropped: the job may be queued all the same; its answer says
        done = ssh.run(f"cat {answer} 2>/dev/null || cat {answer}.tmp 2>/dev/null || true\n", check=False)
        if not done.stdout.strip():
            raise
        click.echo(f"hpc-ddp: the connection to {ssh.host} dropped during the submit; its answer was read back",
                   err=True)
        return done
