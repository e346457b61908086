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
import socket
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.launch.gitinfo import GitState
from hpc_ddp.launch.snapshot import Item, Listing, parents

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
        for rel, kind, size, executable, target in data["items"]:
            rel = check_rel(rel)
            if rel in seen or any(p in seen for p in parents(rel.rpartition("/")[0])):
                raise UserError(f"the shipped manifest names {rel!r} twice, or inside a file or link it names",
                                hint="submit again from the laptop")
            seen.add(rel)
            if kind == "file":
                hashes[rel] = str(data["hashes"][rel])
                items.append(Item(rel, "file", int(size), bool(executable)))
            elif kind == "link":
                items.append(Item(rel, "link", target=str(target)))
            elif kind == "live":
                items.append(Item(rel, "live", target=os.path.join(root, rel)))
            else:
                raise ValueError(kind)
        git = data.get("git")
        state = None if git is None else GitState(
            git["commit"], git["branch"], bool(git["dirty"]), tuple(git["changed"]), tuple(git["untracked"]),
            base64.b64decode(git.get("patch") or ""))
        notes = tuple(str(n) for n in data.get("notes", ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the shipped manifest is damaged ({type(exc).__name__}: {exc})",
                        hint="submit again from the laptop") from None
    origin = f"{data.get('origin', '?')}:{data.get('project', '?')}"
    laptop = data.get("project") if isinstance(data.get("project"), str) else None
    return Listing(root, tuple(items), (*notes, f"shipped from {origin}"), state, origin=laptop), hashes
