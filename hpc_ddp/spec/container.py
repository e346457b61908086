"""The container every rank runs in: a runtime and an image (`--container RUNTIME:IMAGE`, a job file's or
profile's `container`, or a table with the image's `python` and extra runtime `args`).

    container = "apptainer:/shared/images/pytorch-24.01.sif"
    container = { runtime = "charliecloud", image = "/shared/images/pytorch", python = "/opt/venv/bin/python",
                  args = ["-b", "/scratch"] }
    --container none          (no container, over a profile's)

Owns the runtimes hpc-ddp knows, and what an image, a python and an argument may be. How each runtime is
started is `launch.container`'s. Pure, standard library only (spec.json holds it; the runner loads it
inside the container).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["Container", "RUNTIMES", "parse_container", "image_is_path", "absolute_image"]

# runtime -> what starts it (an executable on the nodes, or Slurm's own plugin)
RUNTIMES = {
    "apptainer": "apptainer", "singularity": "singularity", "charliecloud": "ch-run", "podman": "podman",
    "pyxis": "srun --container-image (the pyxis SPANK plugin)", "shifter": "shifter (#SBATCH --image)",
}
NONE = "none"
_SHELL_SYNTAX = set(";|&$`<>\"'\\")


@dataclasses.dataclass(frozen=True)
class Container:
    runtime: str
    image: str
    python: str = "python3"             # the image's interpreter, which runs hpc-ddp's runner and the program
    args: tuple[str, ...] = ()          # extra arguments of the runtime (bind mounts, ...), one word each

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Container | None:
        return None if data is None else cls(**{**data, "args": tuple(data.get("args", ()))})

    def describe(self) -> str:
        return f"{self.runtime}:{self.image}"


def image_is_path(runtime: str, image: str) -> bool:
    """Whether `image` names a file or directory (not a registry reference or a URI): where it can be
    checked, and made absolute."""
    if "://" in image:
        return False
    if runtime in ("apptainer", "singularity", "charliecloud"):
        return True
    return runtime == "pyxis" and image.startswith(("/", "./", "../", "~"))


def absolute_image(raw: Any, base: str) -> Any:
    """`raw` (a container value as given) with a relative image path made absolute against `base` (the
    job file's or profile's directory, or where the command runs), `~` expanded. Anything else unchanged:
    the parser says what is wrong with it."""
    if isinstance(raw, str) and ":" in raw and raw.strip() != NONE:
        runtime, _, image = raw.partition(":")
        return f"{runtime}:{_absolute(runtime.strip(), image, base)}"
    if isinstance(raw, Mapping) and isinstance(raw.get("image"), str):
        return {**raw, "image": _absolute(str(raw.get("runtime")), raw["image"], base)}
    return raw


def _absolute(runtime: str, image: str, base: str) -> str:
    if not image or not image_is_path(runtime, image):
        return image
    return os.path.normpath(os.path.join(base, os.path.expanduser(image)))


def parse_container(raw: Any) -> Container | None:
    """"RUNTIME:IMAGE", "none", or a table {runtime, image, python, args}."""
    if isinstance(raw, str):
        if raw.strip() == NONE:
            return None
        runtime, sep, image = raw.partition(":")
        if not sep:
            raise ValueError(f"{raw[:60]!r} is not RUNTIME:IMAGE (e.g. apptainer:/shared/pytorch.sif), or none")
        return _checked(runtime.strip(), image, "python3", ())
    if isinstance(raw, Mapping):
        unknown = set(raw) - {"runtime", "image", "python", "args"}
        if unknown:
            raise ValueError(f"unknown key {sorted(unknown)[0]!r} (a container has runtime, image, python, args)")
        if "runtime" not in raw or "image" not in raw:
            raise ValueError("a container table needs runtime and image")
        args = raw.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("args: expected a list of strings, one word each")
        return _checked(str(raw["runtime"]), raw["image"], raw.get("python", "python3"), tuple(args))
    raise ValueError("expected RUNTIME:IMAGE or a table {runtime, image, python, args}")


def _checked(runtime: str, image: Any, python: Any, args: tuple[str, ...]) -> Container:
    if runtime not in RUNTIMES:
        close = difflib.get_close_matches(runtime, sorted(RUNTIMES), n=1)
        guess = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"unknown container runtime {runtime[:40]!r} ({guess}known: {', '.join(RUNTIMES)})")
    for what, value in (("image", image), ("python", python)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"the container's {what} is empty")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"the container's {what} contains a control character (newline, NUL, ...)")
        if any(c.isspace() for c in value):
            raise ValueError(f"the container's {what} {value[:60]!r} contains whitespace")
        if value.startswith("-"):  # the runtime would take it as an option (--privileged), not an image
            raise ValueError(f"the container's {what} {value[:60]!r} starts with '-': the runtime would read it as "
                             "an option (give extra runtime options as the table's args)")
    if runtime == "shifter" and set(image) & set("#\"'\\"):  # it becomes an #SBATCH --image line
        raise ValueError(f"the shifter image {image[:60]!r} contains a character an #SBATCH line cannot hold")
    for arg in args:
        bad = sorted(set(arg) & _SHELL_SYNTAX) or [c for c in arg if ord(c) < 32 or c.isspace()][:1]
        if bad or not arg:
            raise ValueError(f"args: {arg[:60]!r} is not one plain word (it contains {bad[0]!r})" if bad else
                             "args: an empty argument")
    return Container(runtime, image, python, args)
