"""A snapshot that travelled: the laptop lists and hashes the project (`manifest`), ships its files into
the cluster's mirror of it, and the cluster's submit takes the snapshot of that mirror by the manifest
(`listing`), never by what else the mirror holds. Every file copied into the run dir is checked against
the laptop's hash (`Snapshot.expected`), so a copy that a dropped connection left half-shipped never runs.

    {"format": 1, "id": ..., "project": the laptop's project, "origin": "laptop-host",
     "items": [[rel, kind, size, executable, target], ...],   kind file | link | live
     "hashes": {rel: sha256}, "notes": [...], "git": {...GitState, "patch": base64}}
"""

from __future__ import annotations

import base64
import os
import re
import socket
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.snapshot.gitinfo import GitState
from hpc_ddp.snapshot.listing import Item, Listing, parents

__all__ = ["manifest", "listing", "check_rel", "FORMAT"]

FORMAT = 1
MAX_PATCH = 16 * 2**20   # a bigger diff is left out of the manifest (the copy holds the changes all the same)


def manifest(listing: Listing, snapshot_id: str, hashes: dict[str, str]) -> dict[str, Any]:
    """What the laptop sends: the listing, the hashes of its files and the git state."""
    git = None
    if listing.git is not None:
        patch = listing.git.patch if len(listing.git.patch) <= MAX_PATCH else b""
        git = {**listing.git.to_json(), "patch": base64.b64encode(patch).decode()}
    return {"format": FORMAT, "id": snapshot_id, "project": listing.project, "origin": socket.gethostname(),
            "items": [[i.rel, i.kind, i.size, i.executable, i.target if i.kind == "link" else ""]
                      for i in listing.items],
            "hashes": hashes, "notes": list(listing.notes), "git": git}


def check_rel(rel: Any) -> str:
    """A manifest's path: relative, '/'-separated, with no '..', '.' or empty part (it names a file in the
    mirror and in the copy, never one beside them)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/") or any(
            part in ("", ".", "..") for part in rel.split("/")):
        raise UserError(f"the shipped manifest names the path {rel!r}, which is not one inside the project",
                        hint="submit again from the laptop (with the same hpc-ddp version on both sides)")
    return rel


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _git_state(git: Any) -> GitState | None:
    """The laptop's git state, every field of its type (a ValueError or TypeError where one is not)."""
    if git is None:
        return None
    if not isinstance(git, dict):
        raise TypeError("git is not a table")
    commit, branch, dirty = git["commit"], git["branch"], git["dirty"]
    changed, untracked = git["changed"], git["untracked"]
    if not (commit is None or isinstance(commit, str)) or not (branch is None or isinstance(branch, str)) \
            or not isinstance(dirty, bool) or not isinstance(changed, list) or not isinstance(untracked, list) \
            or not all(isinstance(x, str) for x in (*changed, *untracked)):
        raise TypeError("git's commit, branch, dirty, changed or untracked is not of its type")
    patch = git.get("patch") or ""
    if not isinstance(patch, str):
        raise TypeError("git's patch is not a string")
    return GitState(commit, branch, dirty, tuple(changed), tuple(untracked), base64.b64decode(patch, validate=True))


def listing(data: dict[str, Any], mirror: str | Path) -> tuple[Listing, dict[str, str]]:
    """The listing the cluster copies from its mirror `mirror` (left-out entries link into the mirror:
    the cluster's own data/ and runs/ folders there), and the hashes every file must have."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError("the shipped manifest is of another format than this hpc-ddp reads",
                        hint="install the same hpc-ddp version on the laptop and on the cluster")
    root = os.path.realpath(mirror)
    items, hashes = [], {}
    seen: set[str] = set()
    try:
        rows = data["items"]
        if not isinstance(rows, list):
            raise TypeError("items is not a list")
        for rel, kind, size, executable, target in rows:
            rel = check_rel(rel)
            if rel in seen or any(p in seen for p in parents(rel.rpartition("/")[0])):
                raise UserError(f"the shipped manifest names {rel!r} twice, or inside a file or link it names",
                                hint="submit again from the laptop")
            seen.add(rel)
            if kind == "file":
                digest = data["hashes"][rel]
                if not (isinstance(digest, str) and _SHA256.fullmatch(digest)) or type(size) is not int or size < 0 \
                        or not isinstance(executable, bool):
                    raise ValueError(f"{rel!r}: its size, executable flag or hash is not of its type")
                hashes[rel] = digest
                items.append(Item(rel, "file", size, executable))
            elif kind == "link":
                if not isinstance(target, str) or not target or "\0" in target:
                    raise ValueError(f"{rel!r}: the link's target {target!r} is not a path")
                items.append(Item(rel, "link", target=target))
            elif kind == "live":
                items.append(Item(rel, "live", target=os.path.join(root, rel)))
            else:
                raise ValueError(kind)
        # a file or link named with something inside it, whichever came first
        inside = next((rel for rel in seen if any(p in seen for p in parents(rel.rpartition("/")[0]))), None)
        if inside is not None:
            raise UserError(f"the shipped manifest names {inside!r} inside a file or link it names",
                            hint="submit again from the laptop")
        state = _git_state(data.get("git"))
        notes = data.get("notes", [])
        if not isinstance(notes, list):
            raise TypeError("notes is not a list")
        notes = tuple(str(n) if str(n).isprintable() else repr(str(n)) for n in notes)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the shipped manifest is damaged ({type(exc).__name__}: {exc})"[:300],
                        hint="submit again from the laptop") from None
    origin = f"{data.get('origin', '?')}:{data.get('project', '?')}"
    origin = origin if origin.isprintable() else repr(origin)
    laptop = data.get("project") if isinstance(data.get("project"), str) else None
    return Listing(root, tuple(items), (*notes, f"shipped from {origin}"), state, origin=laptop), hashes
