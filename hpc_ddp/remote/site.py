"""Where a laptop's command goes: the cluster's host (`--ssh HOST`, or `ssh = "HOST"` in the profile), the
folder the project is mirrored into there (`remote_dir`/PROJECT, PROJECT the project folder's name; without
remote_dir the same path under the remote home as the project has under the laptop's), and the hpc-ddp to
run there (`remote_hpc_ddp`; default: hpc-ddp on the remote PATH). Read from the flag and the profiles
file; pure apart from reading that file."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.remote.ssh import check_host
from hpc_ddp.spec.config import REMOTE_KEYS, profiles_path, read_toml

__all__ = ["Site", "site_for", "remote_dir_for", "profile_toml"]


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
    if profile:
        path = profiles_path(env)
        if path.is_file():
            found = read_toml(path, "profiles file").get(profile)
            table = found if isinstance(found, dict) else {}
    host = ssh or table.get("ssh")
    if not host:
        return None
    for key in ("ssh", "remote_dir", "remote_hpc_ddp"):
        if key in table and not isinstance(table[key], str):
            raise SpecError(f"profile {profile!r}: {key} must be a string, not {table[key]!r}")
    hpc_ddp = table.get("remote_hpc_ddp") or "hpc-ddp"
    if "\n" in hpc_ddp or "\0" in hpc_ddp:
        raise SpecError(f"profile {profile!r}: remote_hpc_ddp must be one command line")
    return Site(check_host(str(host)), table.get("remote_dir") or None, hpc_ddp, profile,
                {k: v for k, v in table.items() if k not in REMOTE_KEYS} if profile else None)


def remote_dir_for(site: Site, project: Path, home: Path | None = None) -> str:
    """The mirror's folder on the cluster, as the remote shell should read it ('~/...' or absolute): each
    project its own, so one profile serves every project."""
    if site.remote_dir:
        return site.remote_dir.rstrip("/") + "/" + project.name
    home = Path(os.path.realpath(home or Path.home()))
    if not project.is_relative_to(home) or project == home:
        raise UserError(f"the project {project} is not in a folder under your home ({home}), so it has no place "
                        "of its own under the cluster's home",
                        hint='set remote_dir = "~/projects" in the profile (a folder on the cluster; the project goes in '
                             f'it as {project.name}/)')
    return "~/" + project.relative_to(home).as_posix()


def profile_toml(name: str, table: Mapping[str, Any]) -> str:
    """A profiles file holding the one profile `name` (TOML; JSON's strings, numbers, arrays and booleans
    are TOML's)."""
    lines = [f"[{json.dumps(name)}]"]
    lines += [f"{json.dumps(key)} = {_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise UserError(f"the profile's value {value!r} cannot be sent to the cluster",
                    hint="use strings, numbers, booleans, arrays and tables in the profile")
