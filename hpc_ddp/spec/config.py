"""Reading the user's files into spec layers: job files (TOML) and the cluster profiles file.

The edge between the filesystem and the pure `spec` module: every read error becomes a one-line
SpecError that names the file.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import SpecError
from hpc_ddp.spec.jobspec import PROFILE_KEYS, SPEC_KEYS, Layer, Target

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["read_toml", "job_file_layer", "profile_layer", "profiles_path", "resolve_target"]

JOB_FILE_SUFFIXES = (".toml",)


def read_toml(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise SpecError(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise SpecError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start})",
                        hint="save it as UTF-8; TOML files must be") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{what} {str(path)!r} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise SpecError(f"{what} {str(path)!r} nests arrays or tables too deeply to read",
                        hint="no setting needs more than a few levels") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise SpecError(f"{what} {str(path)!r} is not valid TOML: {exc}") from None


def profiles_path(env: Mapping[str, str]) -> Path:
    if env.get("HPC_DDP_PROFILES"):
        return Path(env["HPC_DDP_PROFILES"]).expanduser()
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")) / ".config")
    return (base / "hpc-ddp" / "profiles.toml").expanduser()


def profile_layer(name: str, path: Path) -> Layer:
    """The `[name]` table of the profiles file, as a layer that only accepts site settings."""
    if not path.exists():
        raise SpecError(f"unknown profile {name!r}: there is no profiles file at {str(path)!r}",
                        hint=f"create it with a [{name}] table, or set HPC_DDP_PROFILES to its path")
    profiles = read_toml(path, "profiles file")
    if name not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        raise SpecError(f"unknown profile {name!r} in {str(path)!r} (known: {known})")
    table = profiles[name]
    if not isinstance(table, dict):
        raise SpecError(f"profile {name!r} in {str(path)!r} is not a table")
    return Layer(f"profile {name!r}", _resolve_paths(table, path.parent, ("template",)),
                 allowed=frozenset(PROFILE_KEYS))


def job_file_layer(path: Path) -> Layer:
    data = read_toml(path, "job file")
    _check_target_types(data, f"job file {str(path)!r}")
    if isinstance(data.get("train"), dict):
        data["train"] = _resolve_paths(data["train"], path.parent, ("data_dir",))
    if isinstance(data.get("datasets"), dict):
        data["datasets"] = _resolve_paths(data["datasets"], path.parent, tuple(data["datasets"]))
    return Layer(f"job file {str(path)!r}", _resolve_paths(data, path.parent, ("script", "template", "run_dir")),
                 allowed=frozenset(SPEC_KEYS))


def _check_target_types(data: Mapping[str, Any], origin: str) -> None:
    """script, module, args and profile are read before the spec is built (they choose the target and the
    profile), so their types are checked here, with the file's name, rather than failing later."""
    for key in ("script", "module", "profile"):
        value = data.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip() or "\0" in value):
            raise SpecError(f"{origin}: {key}: {_short(value)} is not a string",
                            hint=f'write it as {key} = "..."')
    args = data.get("args")
    if args is not None and (not isinstance(args, list) or not all(isinstance(a, str) for a in args)):
        raise SpecError(f"{origin}: args must be a list of strings, not {_short(args)}",
                        hint='quote each one: args = ["--epochs", "10"]')
    if args and any("\0" in a for a in args):
        raise SpecError(f"{origin}: args: an argument contains a NUL character, which no program can receive")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_job_file(target: str) -> bool:
    return target.endswith(JOB_FILE_SUFFIXES)


def resolve_target(script: str | None, module: str | None, args: tuple[str, ...], cwd: Path) -> Target:
    """The program every rank runs; a script must exist and be a readable file."""
    if script and module:
        raise SpecError(f"give either a script ({script!r}) or -m {module}, not both")
    if any("\0" in a for a in args):
        raise SpecError("an argument of the program contains a NUL character, which no program can receive")
    if module:
        if not all(part.isidentifier() for part in module.split(".")):
            raise SpecError(f"-m {module!r} is not a Python module name")
        return Target("module", module, args)
    if not script:
        raise SpecError("nothing to run", hint="give a script (train.py), -m package.module, or a job file (job.toml)")
    path = (cwd / script).resolve() if not os.path.isabs(script) else Path(script)
    if not path.is_file():
        raise SpecError(f"script {script!r} does not exist" if not path.exists() else f"{script!r} is not a file")
    if not os.access(path, os.R_OK):
        raise SpecError(f"script {script!r} is not readable")
    return Target("script", str(path), args)


def _resolve_paths(table: Mapping[str, Any], base: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """Paths inside a file are relative to that file, so a job file works from any directory."""
    out = dict(table)
    for key in keys:
        value = out.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            out[key] = str((base / value).resolve())
    return out
