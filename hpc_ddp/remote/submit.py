"""`submit --ssh HOST` (or a profile with ssh = "HOST"), from the laptop:

1. list and hash the project here, as a snapshot would (launch.snapshot; the same rules and limits);
2. one ssh call asks the cluster for its hpc-ddp's version, rsync, the mirror folder's state and free space,
   and refuses, in one line, what would fail later (no hpc-ddp or another version, a folder hpc-ddp did not
   make, a disk too full);
3. the project's files go into the mirror with rsync (what changed since the last submit to that host; a
   tar over ssh where the cluster has no rsync), over the same shared connection;
4. the cluster's hpc-ddp submits, from the mirror, with the manifest: it copies the files into the run dir
   and checks each against the laptop's hash (a copy a dropped connection left half-done never runs);
5. its answer is printed as a local submit prints it, and the run recorded here (host, remote run dir).

The mirror is hpc-ddp's (a `.hpc-ddp-mirror` folder marks it): shipping writes the project's files there
and nothing else; the cluster's own data/ and runs/ beside them are never touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from hpc_ddp import __version__
from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.common.registryfile import register
from hpc_ddp.common.units import MB, human_bytes
from hpc_ddp.launch import shipped, snapshot
from hpc_ddp.launch.gitinfo import Git
from hpc_ddp.remote.site import Site, profile_toml, remote_dir_for
from hpc_ddp.remote.ssh import Ssh, classify
from hpc_ddp.spec.config import is_job_file, resolve_target
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["submit_over_ssh", "MARK"]

MARK = ".hpc-ddp-mirror"      # the folder that marks a mirror as hpc-ddp's (and holds its manifests)
_ROOM = 1.2                   # the mirror needs this much free space for what it ships (+ MB below)


def submit_over_ssh(site: Site, params: dict[str, Any], argv: list[str], env=os.environ) -> int:
    """Ship and submit; the exit code (the cluster's submit's)."""
    cwd = Path(os.path.realpath(os.getcwd()))
    project, script_rel = _project(params, cwd)
    listing, snap_id, hashes = _list(project, params, site)
    remote = remote_dir_for(site, project)
    ssh = Ssh(site.host, env)
    hello = _hello(ssh, site, remote, listing.size)
    mirror = hello["dir"]
    where = cwd.relative_to(project).as_posix() if cwd.is_relative_to(project) else None
    if script_rel is not None and where is None:  # the shell is outside the project: run from the script's folder
        where = os.path.dirname(script_rel)
    args = _rewrite_target(argv, params, cwd, project, where)
    manifest = shipped.manifest(listing, snap_id, hashes)
    for checksum in (False, True):
        _ship(ssh, hello, project, listing, checksum=checksum)
        done = ssh.run(_submit_script(site, mirror, where or "", manifest, args), check=False)
        if checksum or done.returncode != 2 or snapshot.INCOMPLETE.encode() not in done.stderr:
            break
        # a file rsync's quick check (size and time) took for unchanged is not: compare contents, once
    sys.stderr.write(done.stderr.decode(errors="replace"))
    if done.returncode != 0:
        return done.returncode
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        raise HpcDdpError(f"the cluster's hpc-ddp answered what is not JSON: {done.text.strip()[:200]!r}") from None
    return _report(site, answer, params, env)


# ------------------------------------------------------------------------------------------------ here


def _project(params: dict[str, Any], cwd: Path) -> tuple[Path, str | None]:
    """The project's root here (the git repo's, else the script's folder, else the working directory for
    -m) and the script or job file in it."""
    argv = list(params.get("argv") or ())
    module = params.get("module")
    target = resolve_target(None if module else (argv[0] if argv else None), module, tuple(argv[1:]), cwd)
    spec = JobSpec(target, job_name="ship", workdir=str(cwd), python=sys.executable)
    found = snapshot.project_root(spec, Git())
    if found is None:  # -m of a module not in this folder
        raise UserError(f"-m {module}: the module is not in this folder, so there is no project to ship",
                        hint="run the command in the project's folder (where the module's package is)")
    root, script = found
    if root == Path(root.anchor):
        raise UserError(f"the project would be the whole filesystem ({root})",
                        hint="move the script into a project folder")
    if target.kind == "script" and is_job_file(argv[0]) and script is None:
        script = Path(target.value).relative_to(root).as_posix()
    return root, script


def _list(project: Path, params: dict[str, Any], site: Site) -> tuple[snapshot.Listing, str, dict[str, str]]:
    profile = site.profile or {}
    excludes = [*profile.get("snapshot_exclude", ()), *params.get("snapshot_exclude", ())]
    max_mb = int(params.get("snapshot_max_mb") or profile.get("snapshot_max_mb") or 256)
    listing = snapshot.list_project(project, excludes, Git(), max_bytes=max_mb * MB)
    snapshot.check_limits(listing, max_mb)
    snapshot_id, hashes = snapshot.hashed(listing, max_mb * MB)
    return listing, snapshot_id, hashes


def _rewrite_target(argv: list[str], params: dict[str, Any], cwd: Path, project: Path, where: str | None) -> list[str]:
    """The command line for the cluster: the script (or job file) as a path from the folder it runs in."""
    words = list(params.get("argv") or ())
    if not words or params.get("module"):
        return argv
    local = Path(os.path.realpath(cwd / words[0]))
    relative = os.path.relpath(local, project / (where or ""))
    try:
        cut = len(argv) - len(words)
        return [*argv[:cut], relative, *argv[cut + 1:]]
    except IndexError:
        return argv


def _report(site: Site, answer: dict[str, Any], params: dict[str, Any], env) -> int:
    host = site.host
    if params.get("dry_run"):
        if params.get("as_json"):
            click.echo(json.dumps({**answer, "host": host}, indent=2))
        else:
            click.echo(answer.get("script", ""), nl=False)
        return 0
    job_id, run_dir = answer.get("job_id"), answer.get("run_dir")
    if job_id and run_dir:
        try:
            register({"job_id": str(job_id), "executor": answer.get("executor"), "run_dir": run_dir, "host": host,
                      "remote_hpc_ddp": site.hpc_ddp, "name": Path(run_dir).name.rsplit("-", 2)[0]}, env)
        except OSError as exc:
            click.echo(f"warning: could not record the run in the registry: {exc}", err=True)
    if params.get("as_json"):
        click.echo(json.dumps({**answer, "host": host}, indent=2))
    else:
        click.echo(f"Submitted job {job_id} ({answer.get('executor')} on {host}); run dir {host}:{run_dir}")
    if params.get("debug_rank") is not None and job_id:
        click.echo(f"hpc-ddp: rank {params['debug_rank']} will wait for a debugger once the job runs: "
                   f"`hpc-ddp status --tunnel {job_id}` then opens the tunnel from here", err=True)
    return int(answer.get("returncode") or 0)


# ------------------------------------------------------------------------------------------ the cluster


def _dir_words(remote: str) -> str:
    """The folder for the remote sh: '~/x' as "$HOME"/'x', an absolute one quoted."""
    if remote == "~":
        return '"$HOME"'
    if remote.startswith("~/"):
        return '"$HOME"/' + shlex.quote(remote[2:])
    if not remote.startswith("/"):
        return '"$HOME"/' + shlex.quote(remote)
    return shlex.quote(remote)


def _hello(ssh: Ssh, site: Site, remote: str, size: int) -> dict[str, str]:
    """One call: the cluster's hpc-ddp version, rsync, the mirror's folder (absolute) and state, free KB."""
    script = f"""
D={_dir_words(remote)}
V=$({site.hpc_ddp} --version 2>/dev/null) || V=missing
printf 'version=%s\\n' "$V"
if command -v rsync >/dev/null 2>&1; then echo rsync=yes; else echo rsync=no; fi
printf 'dir=%s\\n' "$D"
if [ -L "$D" ]; then echo state=link
elif [ -d "$D/{MARK}" ] && [ ! -L "$D/{MARK}" ] && [ -O "$D/{MARK}" ]; then echo state=ours
elif [ -d "$D" ] && [ -z "$(ls -A "$D" 2>/dev/null)" ]; then echo state=empty
elif [ -e "$D" ]; then echo state=foreign
else echo state=absent; fi
P=$D; while [ ! -e "$P" ]; do P=$(dirname "$P"); done
printf 'free_kb=%s\\n' "$(df -Pk "$P" 2>/dev/null | awk 'NR==2 {{print $4}}')"
if [ -d "$P" ] && [ -w "$P" ] && [ -x "$P" ]; then echo writable=yes; else printf 'writable=no\\nblocked=%s\\n' "$P"; fi
"""
    out = ssh.run(script).text
    said = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    version = said.get("version", "missing")
    if version == "missing" or not version.strip():
        raise UserError(f"there is no hpc-ddp on {ssh.host} (tried {site.hpc_ddp!r})",
                        hint=f"install it there (pip install hpc-ddp=={__version__}), or name it with "
                             "remote_hpc_ddp = \"/path/to/venv/bin/hpc-ddp\" in the profile")
    theirs = version.strip().rsplit(" ", 1)[-1]
    if theirs != __version__:
        raise UserError(f"{ssh.host} has hpc-ddp {theirs}, this laptop {__version__}: the two must be the same",
                        hint=f"install hpc-ddp=={__version__} on {ssh.host} (or this laptop's version there)")
    state, mirror = said.get("state"), said.get("dir", "")
    if state in ("foreign", "link"):
        raise UserError(f"{ssh.host}:{mirror} exists and is not a folder hpc-ddp made (no {MARK} in it): "
                        "the project is not shipped over it", hint="set remote_dir = \"~/another/folder\" in the "
                        "profile, or move that folder away on the cluster")
    if said.get("writable") == "no":
        raise UserError(f"{ssh.host}:{said.get('blocked', mirror)} is not a folder you can write to, so the project "
                        f"cannot go to {mirror}", hint="set remote_dir = \"~/projects\" (a folder of yours on the "
                                                     "cluster) in the profile")
    free = said.get("free_kb", "")
    if free.isdigit() and int(free) * 1024 < size * _ROOM + 10 * MB:
        raise UserError(f"{ssh.host} has {human_bytes(int(free) * 1024)} free where the project goes ({mirror}); "
                        f"it needs {human_bytes(int(size * _ROOM + 10 * MB))}",
                        hint="free space there (or set remote_dir to a filesystem with room)")
    if not mirror.startswith("/"):
        raise HpcDdpError(f"{ssh.host} gave no absolute folder for {remote!r}: {mirror!r}")
    return said


def _ship(ssh: Ssh, hello: dict[str, str], project: Path, listing: snapshot.Listing, checksum: bool = False) -> None:
    """The project's files and links into the mirror: rsync sends only what changed (tar all, where the
    cluster has no rsync). A transfer cut short leaves the mirror partly updated; the next submit finishes
    it, and the cluster's submit checks every file against the manifest before a job may run."""
    mirror = hello["dir"]
    ssh.run(f"mkdir -p {shlex.quote(mirror)}/{MARK}/shipped && chmod 700 {shlex.quote(mirror)}/{MARK}")
    names = b"".join(i.rel.encode(errors="surrogateescape") + b"\0" for i in listing.items if i.kind != "live")
    if hello.get("rsync") == "yes" and _have("rsync"):
        argv = ["rsync", "-a", "-s", *(["--checksum"] if checksum else []), "--from0", "--files-from=-",
                "-e", ssh.rsh(), f"{project}/", f"{ssh.host}:{mirror}/"]
        done = subprocess.run(argv, input=names, capture_output=True, check=False)
    else:
        tar = subprocess.Popen(["tar", "-C", str(project), "--null", "-T", "-", "-cf", "-"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert tar.stdin is not None and tar.stdout is not None
        tar.stdin.write(names)
        tar.stdin.close()
        done = subprocess.run(ssh.argv(f"tar -xf - -C {shlex.quote(mirror)}"), stdin=tar.stdout,
                              capture_output=True, check=False)
        tar.wait()
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace")
        if done.returncode == 255 and "connection unexpectedly closed" not in said:
            raise classify(ssh.host, said)
        if done.returncode in _DROPPED or done.returncode < 0 or "connection unexpectedly closed" in said \
                or "Broken pipe" in said:
            raise UserError(f"the connection to {ssh.host} dropped while the project was copied; nothing was "
                            "submitted", hint="submit again: the copy continues where it stopped")
        if "No space left" in said or "Disk quota exceeded" in said:
            raise UserError(f"{ssh.host} ran out of space (or quota) while the project was copied to {mirror}; "
                            "nothing was submitted", hint="free space there, or set remote_dir to another filesystem")
        lines = [ln for ln in said.strip().splitlines() if ln.strip()]
        raise HpcDdpError(f"copying the project to {ssh.host} failed: {lines[-1] if lines else done.returncode}")


# rsync's exit codes for a transfer cut short: the connection (12: protocol data stream, 255: ssh), a signal
# (20), a timeout (30, 35); a negative code: rsync itself was killed.
_DROPPED = (12, 20, 30, 35, 255)


def _have(tool: str) -> bool:
    return shutil.which(tool) is not None


def _submit_script(site: Site, mirror: str, where: str, manifest: dict[str, Any], args: list[str]) -> str:
    """The cluster's side of submit: the manifest and profile written beside the mirror, then its submit."""
    mark = f"{shlex.quote(mirror)}/{MARK}"
    path = f"{mark}/shipped/{manifest['id']}.json"
    end = f"HPC_DDP_{secrets.token_hex(8)}"
    lines = ["set -e", f"cat > {path}.tmp <<'{end}'", json.dumps(manifest), end, f"mv -f {path}.tmp {path}"]
    env = ""
    if site.profile_name and site.profile is not None:
        lines += [f"cat > {mark}/profiles.toml <<'{end}'", profile_toml(site.profile_name, site.profile).rstrip("\n"),
                  end]
        env = f"HPC_DDP_PROFILES={mark}/profiles.toml "
    lines += [f"cd {shlex.quote(mirror)}/{shlex.quote(where)}" if where else f"cd {shlex.quote(mirror)}",
              f"{env}exec {site.hpc_ddp} submit --json --shipped {path} {shlex.join(args)}"]
    return "\n".join(lines) + "\n"
