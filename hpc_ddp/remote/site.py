"""Where a laptop's command goes: the cluster's host (`--ssh HOST`, or `ssh = "HOST"` in the profile), the
folder the project is mirrored into there (`remote_dir`/PROJECT, PROJECT the project folder's name; without
remote_dir the same path under the remote home as the project has under the laptop's), and the hpc-ddp to
run there (`remote_hpc_ddp`; default: hpc-ddp on the remote PATH). Read from the flag and the profiles
file; pure apart from reading that file."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.remote.ssh import check_host
from hpc_ddp.spec.config import REMOTE_KEYS, profiles_path, read_toml

__all__ = ["Site", "site_for", "remote_dir_for", "profile_toml", "shell_words", "command_words"]


@dataclasses.dataclass(frozen=True)
class Site:
    host: str
    remote_dir: str | None                 # projects go in remote_dir/NAME; None: the path under the laptop's home
    hpc_ddp: str = "hpc-ddp"
    profile_name: str | None = None
    profile: Mapping[str, Any] | None = None   # the profile's job settings, for the cluster's submit


def site_for(ssh: str | None, profile: str | None, env: Mapping[str, str] = os.environ) -> Site | None:
    """The cluster a command goes to over ssh; None: it runs here."""
    table: dict[str, Any] = {}
    here = False   # the profile is in this machine's profiles file (else the cluster's own is used there)
    if profile:
        path = profiles_path(env)
        if path.is_file():
            found = read_toml(path, "profiles file").get(profile)
            here = isinstance(found, dict)
            table = found if here else {}
    if ssh is not None and not ssh.strip():
        # `--ssh "$HOST"` with HOST unset: submitting here instead of on the cluster is never what was meant
        raise SpecError("--ssh was given an empty host (an unset variable?): nothing is submitted here instead",
                        hint="give the cluster's host (--ssh login.example.org, or a Host alias of ~/.ssh/config)")
    host = ssh or table.get("ssh")
    if not host:
        return None
    for key in ("ssh", "remote_dir", "remote_hpc_ddp"):
        if key in table and not isinstance(table[key], str):
            raise SpecError(f"profile {profile!r}: {key} must be a string, not {table[key]!r}")
    hpc_ddp = table.get("remote_hpc_ddp") or "hpc-ddp"
    if not hpc_ddp.isprintable() or not hpc_ddp.strip():
        raise SpecError(f"profile {profile!r}: remote_hpc_ddp must be the path of hpc-ddp on the cluster, not "
                        f"{hpc_ddp!r}")
    command_words(hpc_ddp)  # refused here, naming remote_hpc_ddp, where the cluster's shell could not take it
    remote_dir = table.get("remote_dir") or None
    if remote_dir is not None:
        _printable_path(remote_dir, f"profile {profile!r}: remote_dir")
        shell_words(remote_dir)  # refused here, before anything runs, where the cluster's shell could not take it
    job = {k: v for k, v in table.items() if k not in REMOTE_KEYS} if here else None
    for key in ("template",):
        if job and isinstance(job.get(key), str) and not os.path.isabs(job[key]):
            raise SpecError(f"profile {profile!r}: {key} = {job[key]!r} is relative, and the profile is used on the "
                            f"cluster, where it would not name the same file",
                            hint=f"give {key} as the cluster's absolute path")
    return Site(check_host(str(host)), remote_dir, hpc_ddp, profile, job)


def _printable_path(path: str, what: str) -> None:
    """A folder whose name the cluster says back on one line of its answer: a newline or another control
    character in it would cut that line, and the files would go to the folder the cut names."""
    if not path.isprintable():
        raise SpecError(f"{what} {path!r} holds a control character (a newline, a tab, an escape)",
                        hint="rename the folder, or give remote_dir in the profile")


def remote_dir_for(site: Site, project: Path, home: Path | None = None) -> str:
    """The mirror's folder on the cluster, as the remote shell should read it ('~/...' or absolute): each
    project its own, so one profile serves every project."""
    _printable_path(project.name, "the project's folder")
    if site.remote_dir:
        return site.remote_dir.rstrip("/") + "/" + project.name
    home = Path(os.path.realpath(home or Path.home()))
    if not project.is_relative_to(home) or project == home:
        raise UserError(f"the project {project} is not in a folder under your home ({home}), so it has no place "
                        "of its own under the cluster's home",
                        hint='set remote_dir = "~/projects" in the profile (a folder on the cluster; the project goes in '
                             f'it as {project.name}/)')
    return "~/" + project.relative_to(home).as_posix()


_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_USER = re.compile(r"~([a-z_][a-z0-9_.-]{0,31})")


def shell_words(path: str, what: str = "remote_dir") -> str:
    """A folder of the cluster as words of its sh: '~/x' (or '~'), '~user/x', '$VAR/x' and '${VAR}/x' expand
    there, the rest is quoted; a relative path is under the home folder."""
    head, sep, rest = path.partition("/")
    if head == "~":
        start = '"$HOME"'
    elif _USER.fullmatch(head):
        start = head  # ~user: expanded by the shell, nothing else in it
    elif (var := _VAR.fullmatch(head)) is not None:
        start = f'"${{{var.group(1)}}}"'
    elif head.startswith(("~", "$")):
        raise SpecError(f"{what} {path!r}: only ~, ~USER, $VAR or ${{VAR}} may begin it",
                        hint=f'e.g. {what} = "$SCRATCH/projects" or "~/projects"' if what == "remote_dir" else
                        f'e.g. {what} = "~/venv/bin/hpc-ddp" or "$SCRATCH/venv/bin/hpc-ddp"')
    elif path.startswith("/"):
        return shlex.quote(path)
    else:
        return '"$HOME"/' + shlex.quote(path)
    return start + (("/" + shlex.quote(rest)) if sep and rest else "")


def command_words(command: str) -> str:
    """remote_hpc_ddp as a word of the cluster's sh: a path (~/ and $VAR/ expand), never shell code."""
    return shell_words(command, "remote_hpc_ddp") if command.startswith(("~", "$", "/")) else shlex.quote(command)


def profile_toml(name: str, table: Mapping[str, Any]) -> str:
    """A profiles file holding the one profile `name` (TOML; JSON's strings, numbers, arrays and booleans
    are TOML's)."""
    lines = [f"[{_value(name)}]"]
    lines += [f"{_value(key)} = {_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # TOML has no surrogate pairs: the character itself
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_value(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise UserError(f"the profile's value {value!r} cannot be sent to the cluster",
                    hint="use strings, numbers, booleans, arrays and tables in the profile")
