"""Where the ranks' code comes from: `Code`, the snapshot of the user's project that submit took, and the
checks on the snapshot settings (`snapshot`, `snapshot_exclude`, `snapshot_max_mb`).

The launcher copies the project once, at submit (snapshot.snapshot); every attempt, requeue, chain job and
sweep task then runs that copy, whatever happens to the working tree meanwhile. The working directory stays
the one submitted from, so relative data paths still work: only the code is pinned. Pure.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["Code", "DEFAULT_MAX_MB", "MAX_PATTERNS", "parse_excludes", "pinned"]

DEFAULT_MAX_MB = 256     # a project bigger than this is refused, not copied (snapshot_max_mb)
MAX_PATTERNS = 200


@dataclasses.dataclass(frozen=True)
class Code:
    """A snapshot: `project` (the project's root in the working tree, resolved), `dir` (its copy, read-only
    files) and `id` (the hash of its content). `script`: the copy of the script the ranks run (None for
    `-m`: the module is found through the copy on sys.path, see job/exitsite/hpc_ddp_code.py). `origin`: the
    laptop's project a shipped copy came from (submit --ssh), where a debugger there sets its breakpoints."""

    project: str
    dir: str
    id: str
    script: str | None = None
    origin: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "Code | None":
        return cls(**data) if data else None


def pinned(code: Code | None, path: str) -> str:
    """`path` inside the snapshot where it names something in the project; otherwise `path` itself."""
    if code is None:
        return path
    real = os.path.realpath(path)
    copy = os.path.realpath(code.dir)
    if real == copy or real.startswith(copy.rstrip(os.sep) + os.sep):
        return path  # in the copy already (a run dir inside the project holds it)
    if real == code.project:
        return code.dir
    if real.startswith(code.project.rstrip(os.sep) + os.sep):
        return os.path.join(code.dir, os.path.relpath(real, code.project))
    return path


def parse_excludes(raw: Any) -> tuple[str, ...]:
    """snapshot_exclude: glob patterns, relative to the project (`data`, `*.h5`, `notebooks/big/*`): a
    pattern without '/' matches a file or folder name anywhere, one with '/' the path from the root."""
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError("expected a pattern or a list of patterns, e.g. ['data', '*.h5']")
    if len(items) > MAX_PATTERNS:
        raise ValueError(f"{len(items)} patterns; at most {MAX_PATTERNS}")
    out = []
    for item in items:
        pattern = item.strip().strip("/")
        if not pattern or "\0" in pattern or "\n" in pattern:
            raise ValueError(f"{item!r} is not a usable pattern")
        if item.strip().startswith("/") or pattern == ".." or pattern.startswith("../") or "/../" in pattern:
            raise ValueError(f"{item!r} points outside the project: patterns are relative to its root")
        out.append(pattern)
    return tuple(out)
