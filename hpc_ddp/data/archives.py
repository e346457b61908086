"""Archives staged as datasets (.tar, .tar.gz, .tgz, .zip): the whole listing read once, every member
checked before anything is written (absolute names, `..`, devices, links that resolve outside the target
the way tar resolves them), then extracted and checked against the listing. See staging.py's docstring."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import lzma
import shutil
import stat
import subprocess
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from hpc_ddp.data.stageerrors import BadArchive, HostileArchive, StagingError
from hpc_ddp.data.stagelock import _die_with_parent

_LINK_BUDGET = 40  # symlinks followed while resolving one path, as Linux does before ELOOP


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    kind: str             # file, dir, symlink, hardlink, special
    size: int = 0
    link: str | None = None


def _list_archive(src: Path) -> list[Member]:
    """Read the whole listing once, before anything is written: a truncated or corrupt archive fails here.
    (EOFError from a truncated .gz must not escape: click would report it as "aborted", exit 130.)"""
    try:
        if src.name.endswith(".zip"):
            with zipfile.ZipFile(src) as zf:
                return [_zip_member(info) for info in zf.infolist()]
        with tarfile.open(src) as tf:
            members = tf.getmembers()
            if not isinstance(tf.fileobj, (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile)):
                _whole(members, src, tf.offset)
            return [_tar_member(m) for m in members]
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError) as exc:
        raise BadArchive(f"cannot read archive {src}: {_why(exc)}",
                         hint="it is truncated or not a valid .tar/.tar.gz/.tgz/.zip; copy or pack it again") from None


def _whole(members: list[tarfile.TarInfo], src: Path, end: int) -> None:
    """A plain tar cut inside a member's data, or between members, lists without complaint (tarfile seeks
    past data, and takes a missing end as the end). Its offsets and its end-of-archive block tell."""
    size = src.stat().st_size
    if any(m.offset_data + m.size > size for m in members if m.isfile()):
        raise EOFError("a member's data goes past the end of the file")
    with open(src, "rb") as fh:
        fh.seek(end)
        if fh.read(tarfile.BLOCKSIZE) != tarfile.NUL * tarfile.BLOCKSIZE:
            raise EOFError("no end-of-archive block")


def _why(exc: BaseException) -> str:
    """One line: tarfile's "could not be opened" lists every method it tried, one per line."""
    text = str(exc)
    if isinstance(exc, EOFError) or "unexpected end" in text:
        return "it ends early (truncated)"
    if "could not be opened successfully" in text or "empty file" in text:
        return "it is not a tar archive (plain, gzip, bzip2 or xz), or it is empty"
    return _first_line(text) or type(exc).__name__


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[0][:300] + (" (and more)" if len(lines) > 1 else "")) if lines else ""


def _tar_member(m: tarfile.TarInfo) -> Member:
    if m.issym():
        return Member(m.name, "symlink", 0, m.linkname)
    if m.islnk():
        return Member(m.name, "hardlink", 0, m.linkname)
    if m.isdir():
        return Member(m.name, "dir")
    if m.isfile():
        return Member(m.name, "file", m.size)
    return Member(m.name, "special")


def _zip_member(info: zipfile.ZipInfo) -> Member:
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return Member(info.filename, "symlink", 0, None)  # its target is the data; refused below anyway
    return Member(info.filename, "dir" if info.is_dir() else "file", info.file_size)


def _parts(name: str) -> tuple[str, ...] | None:
    """A member name as path components below the root, or None when it is absolute or has `..`."""
    if name.startswith("/") or "\0" in name:
        return None
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    return None if ".." in parts else parts


def _resolve(parts: Iterable[str], links: dict[tuple[str, ...], str]) -> tuple[str, ...] | None:
    """Where `parts` (relative to the root) ends up once the archive's symlinks exist, following each one
    the way the kernel will: a link's target is read relative to the directory holding the link, and a
    `..` after it climbs from where the link led, not from its name. None when it climbs out of the root,
    is absolute, or loops."""
    out: list[str] = []
    todo = list(parts)
    budget = _LINK_BUDGET
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                return None
            out.pop()
            continue
        here = (*out, part)
        if here in links:
            budget -= 1
            target = links[here]
            if budget < 0 or target.startswith("/"):
                return None
            todo = target.split("/") + todo
            continue
        out.append(part)
    return tuple(out)


def _check_members(src: Path, members: list[Member]) -> None:
    """Refuse, before writing anything, what would land outside the target when extracted the way tar
    extracts: absolute names and `..`; devices and FIFOs; any member path, symlink target or hard-link
    target that resolves outside through the archive's own symlinks (every symlink, whatever its order:
    extractors differ in when they create them); hard links resolved from the archive root, as tar does;
    and a path that is a symlink in one member and something else in another.
    (tarfile's `data` filter would silently strip a leading `/`; we want the archive refused instead.)"""
    def refuse(what: str) -> HostileArchive:
        return HostileArchive(f"refusing archive {src}: {what} would land outside the target directory")

    links: dict[tuple[str, ...], str] = {}
    kinds: dict[tuple[str, ...], Member] = {}
    for m in members:
        parts = _parts(m.name)
        if parts is None:
            raise refuse(f"member {m.name!r}")
        if m.kind == "special":
            raise HostileArchive(f"refusing archive {src}: {m.name!r} is a device or FIFO")
        if m.kind == "symlink" and m.link is None:
            raise HostileArchive(f"refusing archive {src}: member {m.name!r} is a link")
        before = kinds.get(parts)
        if before is not None and "symlink" in (before.kind, m.kind) and (before.kind, before.link) != (m.kind, m.link):
            raise HostileArchive(f"refusing archive {src}: {m.name!r} is a symlink in one member and "
                                 "something else in another")
        kinds[parts] = m
        if m.kind == "symlink":
            links[parts] = m.link
    for m in members:
        parts = _parts(m.name)
        if parts and _resolve(parts[:-1], links) is None:
            raise refuse(f"member {m.name!r} (through a symlink in its path)")
        if m.kind == "symlink" and (m.link.startswith("/") or _resolve((*parts[:-1], *m.link.split("/")), links) is None):
            raise refuse(f"link {m.name!r} -> {m.link!r}")
        if m.kind == "hardlink" and (m.link.startswith("/") or _resolve(m.link.split("/"), links) is None):
            raise refuse(f"hard link {m.name!r} -> {m.link!r} (tar resolves it from the archive root)")


def _archive_dirs(members: list[Member]) -> int:
    dirs = {parts for m in members if m.kind == "dir" and (parts := _parts(m.name))}
    for m in members:
        parts = _parts(m.name) or ()
        dirs.update(parts[:i] for i in range(1, len(parts)))
    return len(dirs) + 1


def _extract(src: Path, members: list[Member], tmp: Path) -> tuple[int, int]:
    tmp.mkdir(mode=0o700)
    try:
        if src.name.endswith(".zip"):
            with zipfile.ZipFile(src) as zf:
                zf.extractall(tmp)
        elif shutil.which("tar"):
            # Every member was checked above; GNU tar then extracts about 20% faster than tarfile.
            done = subprocess.run(["tar", "-xf", str(src.absolute()), "-C", str(tmp.absolute()), "--no-same-owner"],
                                  capture_output=True, text=True, preexec_fn=_die_with_parent)
            if done.returncode != 0:
                raise StagingError(f"tar could not extract {src}, nothing kept: {_first_line(done.stderr)}",
                                   hint="check the free space of the scratch directory and the archive")
        else:
            with tarfile.open(src) as tf:
                tf.extractall(tmp, filter="data")  # PEP 706: a second guard that refuses what escapes
    except tarfile.FilterError as exc:
        raise HostileArchive(f"refusing archive {src}: {exc}") from None
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError) as exc:
        raise BadArchive(f"cannot extract archive {src}: {_why(exc)}",
                         hint="it is corrupt or truncated; copy or pack it again") from None
    files = {m.name: m for m in members if m.kind == "file"}  # a name repeated: the last one is what is left
    for m in files.values():
        if (tmp / m.name).stat().st_size != m.size:
            raise StagingError(f"extracted {m.name} has the wrong size")
    return len(files), sum(m.size for m in files.values())
