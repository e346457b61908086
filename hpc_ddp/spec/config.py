"""Reading what the user gave into spec layers: the command line, job files (TOML) and the cluster
profiles file, with their precedence (flag > job file > profile > defaults) in `spec_from_command`.

The edge between the filesystem and the pure `jobspec` module: every read error becomes a one-line
SpecError that names the file.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import NotRegularFile, TooLarge, read_bounded
from hpc_ddp.common.errors import SpecError
from hpc_ddp.spec.container import absolute_image
from hpc_ddp.spec.jobspec import (
    PROFILE_KEYS,
    SPEC_KEYS,
    JobSpec,
    Layer,
    OptionSource,
    Target,
    build_spec,
    no_installed_options,
    split_stage,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["read_toml", "job_file_layer", "profile_layer", "profiles_path", "REMOTE_KEYS", "chosen_profile", "resolve_target", "spec_from_command"]

JOB_FILE_SUFFIXES = (".toml",)


MAX_TOML_BYTES = 16 << 20   # a job or profiles file is a page of settings; more is not one


def read_toml(path: Path, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(read_bounded(path, MAX_TOML_BYTES).decode())
    except FileNotFoundError:
        raise SpecError(f"{what} {str(path)!r} does not exist") from None
    except (NotRegularFile, TooLarge) as exc:
        raise SpecError(f"{what} {str(path)!r} {exc.strerror}", hint=f"give a {what} that is a TOML text file") from None
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


# Profile keys that say how the laptop reaches the cluster (hpc_ddp.remote), not what the job is.
REMOTE_KEYS = ("ssh", "remote_dir", "remote_hpc_ddp")


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
    table = {k: v for k, v in table.items() if k not in REMOTE_KEYS}  # the laptop's: how to reach the cluster
    return Layer(f"profile {name!r}", _resolve_paths(table, path.parent, ("template", "container")),
                 allowed=frozenset(PROFILE_KEYS))


def job_file_layer(path: Path) -> Layer:
    data = read_toml(path, "job file")
    _check_target_types(data, f"job file {str(path)!r}")
    if isinstance(data.get("train"), dict):
        data["train"] = _resolve_paths(data["train"], path.parent, ("data_dir",))
    if isinstance(data.get("datasets"), dict):
        data["datasets"] = _resolve_paths(data["datasets"], path.parent, tuple(data["datasets"]))
    return Layer(f"job file {str(path)!r}", _resolve_paths(data, path.parent, ("script", "template", "run_dir",
                                                                              "container")),
                 allowed=frozenset(SPEC_KEYS | {"sweep"}))


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
    if path.is_dir():
        main = os.path.join(script, "__main__.py")
        raise SpecError(f"{script!r} is a folder, not a script", hint=f"give the file it runs: {main!r}"
                        if (path / "__main__.py").is_file() else "give the script in it that trains (train.py), "
                        "or -m package.module for a package")
    if not path.is_file():
        raise SpecError(f"script {script!r} does not exist" if not path.exists() else f"{script!r} is not a file",
                        hint="give the path of the training script, relative to this folder or absolute")
    if not os.access(path, os.R_OK):
        raise SpecError(f"script {script!r} is not readable", hint="make it readable for you (chmod u+r)")
    return Target("script", str(path), args)


def _resolve_paths(table: Mapping[str, Any], base: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """Paths inside a file are relative to that file, so a job file works from any directory."""
    out = dict(table)
    for key in keys:
        value = out.get(key)
        if key == "container" and value is not None:  # "RUNTIME:IMAGE" or a table: only a path image moves
            out[key] = absolute_image(value, str(base))
        elif isinstance(value, str) and value and not os.path.isabs(value):
            out[key] = str((base / value).resolve())
    return out


def spec_from_command(words: tuple[str, ...], module: str | None, flags: Mapping[str, Any], *, cwd: Path,
                      environ: Mapping[str, str], python: str, default_target: Target | None = None,
                      extra: Sequence[Layer] = (), options: OptionSource = no_installed_options) -> JobSpec:
    """The spec a command line asks for. `words`: TARGET and its arguments (a script, a job file, or the
    module's arguments with -m); `flags`: the spec options given; `extra`: layers above the flags (a sweep
    task's values). A job file's own script, module and args name the target; the profile is the flag's,
    else the job file's, else HPC_DDP_PROFILE's. A job file's [sweep] table is read by `spec.sweep`.
    `options`: what the installed sbatch and srun accept (read at the edge, `slurm.helptext`)."""
    head, args = (None, list(words)) if module else (words[0] if words else None, list(words[1:]))
    args = args[1:] if args[:1] == ["--"] else args
    flags = dict(flags)
    if flags.get("container"):  # so is --container's image, where it is a path
        flags["container"] = absolute_image(flags["container"], str(cwd))
    if "datasets" in flags:  # --stage paths are relative to where the command runs
        flags["datasets"] = [_absolute_stage(item, cwd) for item in flags["datasets"]]
    layers: list[Layer] = []
    if head and is_job_file(head):
        job_path = (cwd / head).resolve()
        job_layer = job_file_layer(job_path)
        target = _job_target(job_layer, job_path, tuple(args), cwd)
        job_values = {k: v for k, v in job_layer.values.items() if k not in ("script", "module", "args", "sweep")}
        layers.append(Layer(job_layer.origin, job_values, job_layer.allowed))
    elif default_target is not None and not (head or module):
        target = default_target
    else:
        target = resolve_target(head, module, tuple(args), cwd)
    profile = flags.get("profile") or next((ly.values.get("profile") for ly in layers), None) \
        or environ.get("HPC_DDP_PROFILE")
    if profile:
        layers.insert(0, profile_layer(str(profile), profiles_path(environ)))
        flags.setdefault("profile", profile)
    layers.append(Layer("command line", flags, is_cli=True))
    return build_spec([*layers, *extra], target=target, workdir=str(cwd), python=python, options=options)


def chosen_profile(words: tuple[str, ...], module: str | None, flag: str | None, cwd: Path,
                   environ: Mapping[str, str]) -> tuple[str | None, dict[str, Any]]:
    """(the profile a command line uses, as `spec_from_command` chooses it: the flag's, else the job
    file's, else HPC_DDP_PROFILE's; the job file's values, {} without one). For a laptop that ships the
    project before anything else is built (hpc_ddp.remote)."""
    head = None if module else (words[0] if words else None)
    job: dict[str, Any] = {}
    if head and is_job_file(head) and (cwd / head).is_file():
        job = dict(job_file_layer((cwd / head).resolve()).values)
    profile = flag or job.get("profile") or environ.get("HPC_DDP_PROFILE") or None
    return (str(profile) if profile else None), job


def _absolute_stage(item: str, cwd: Path) -> str:
    src, name = split_stage(item)
    resolved = src if os.path.isabs(src) else str((cwd / src).resolve())
    return f"{resolved}:{name}" if name or item.endswith(":") else resolved


def _job_target(layer: Layer, job_path: Path, extra_args: tuple[str, ...], cwd: Path) -> Target:
    values = layer.values
    if not isinstance(values.get("args", []), list):
        raise SpecError(f"{layer.origin}: args must be a list of strings")
    args = tuple(values.get("args", ())) + extra_args
    if values.get("script") or values.get("module"):
        return resolve_target(values.get("script"), values.get("module"), args, cwd)
    if "train" in values:
        if extra_args:
            raise SpecError(f"{' '.join(extra_args)!r} after the job file would be ignored by the built-in trainer",
                            hint="put options before the job file: hpc-ddp submit --nodes 2 JOB.toml")
        return Target("trainer", str(job_path), tuple(values.get("args", ())))
    raise SpecError(f"{layer.origin} names nothing to run",
                    hint="add script = \"train.py\", module = \"pkg.train\" or a [train] table to it")
