"""The hpc_ddp a container's ranks import: this installation's own source, copied into the run dir.

Why a copy and not the image's hpc_ddp: the runner inside the container must read the spec.json that this
hpc_ddp wrote, so it must be this version; and an image then needs nothing of hpc-ddp's, only Python (with
torch for the built-in trainer or the Session API). hpc_ddp's runner, distenv, spec and staging use the
standard library only. The copy is on the ranks' sys.path first, also for the program the runner execs
(`import hpc_ddp`, `-m hpc_ddp.trainer.train`), so an image that has another hpc_ddp installed does not
mix two versions.

`ensure_source(run_dir)` makes RUN_DIR/hpc-ddp-src/ hold hpc_ddp's .py files and `rank.py`, the entry
every rank starts (`python RUN_DIR/hpc-ddp-src/rank.py RUN_DIR/spec.json`); idempotent (a stamp of the
source's hash), and atomic (built beside, then renamed into place), since every attempt calls it: the
batch script before its ranks, the srun and local executors before theirs.
    python -m hpc_ddp.job.containersrc RUN_DIR
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["SOURCE_DIR", "ENTRY", "entry_path", "ensure_source"]

SOURCE_DIR = "hpc-ddp-src"   # in the run dir
ENTRY = "rank.py"            # in SOURCE_DIR
STAMP = ".source-sha256"

ENTRY_TEXT = '''"""hpc-ddp's per-rank runner, started in a container from this copy of hpc_ddp (written by hpc-ddp)."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))  # on sys.path already: it is this script's directory
# The program the runner execs imports this same copy (`import hpc_ddp`, the built-in trainer).
paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join([here] + paths)
from hpc_ddp.job.runner import main  # noqa: E402

main(sys.argv[1:])
'''


def entry_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / SOURCE_DIR / ENTRY


def _package_files() -> list[tuple[str, Path]]:
    root = Path(__file__).resolve().parent.parent  # the hpc_ddp package
    return sorted((str(p.relative_to(root.parent)), p) for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _stamp(files: list[tuple[str, Path]]) -> str:
    digest = hashlib.sha256(ENTRY_TEXT.encode())
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def ensure_source(run_dir: str | os.PathLike) -> Path:
    """RUN_DIR/hpc-ddp-src as this hpc_ddp's source; its entry script's path."""
    target = Path(run_dir) / SOURCE_DIR
    files = _package_files()
    stamp = _stamp(files)
    if (target / STAMP).is_file() and (target / STAMP).read_text() == stamp:
        return target / ENTRY
    fresh = Path(tempfile.mkdtemp(prefix=f".{SOURCE_DIR}-", dir=run_dir))
    for name, path in files:
        (fresh / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, fresh / name)
    (fresh / ENTRY).write_text(ENTRY_TEXT)
    (fresh / STAMP).write_text(stamp)
    os.chmod(fresh, 0o755)  # mkdtemp's 0700 would hide it from a container's user namespace mapping
    _replace(fresh, target)
    return target / ENTRY


def _replace(fresh: Path, target: Path) -> None:
    """Put `fresh` at `target`: a rename, with an older copy moved aside first (and then removed)."""
    old = None
    if target.exists():
        old = target.with_name(f".{SOURCE_DIR}-old-{os.getpid()}")
        os.replace(target, old)
    os.replace(fresh, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m hpc_ddp.job.containersrc RUN_DIR")
    ensure_source(args[0])


if __name__ == "__main__":
    main()
