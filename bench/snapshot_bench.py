"""Code snapshot: the copy of the user's project that submit takes, against `git archive HEAD | tar -x` and
`rsync -a` of the same tree.

The project is generated (seeded, so every run has the same one): a git repo of FILES files, ~TOTAL_MB MB,
in ~FOLDERS nested folders (mostly small .py/.json/.yaml/.md files, some bigger .csv and binary assets),
one commit (packed, as a clone's would be), then a few uncommitted edits of tracked files, a few untracked
files, and a `.gitignore`d `data/` folder of large files that no side may copy.

hpc-ddp's side is what submit does for a script in that repo, each repeat into a new code_root:
`snapshot.plan(spec, code_root, read=False)` (git lists the project; names and sizes only: since bf893fe
only a dry run reads and hashes the files in the plan) then `snapshot.take(snap)` (every file read,
hashed and written into code_root/<id>, a manifest beside it). Against code from before bf893fe (no `read`
argument) it is `plan` (which read and hashed every file) + `take` (which read and hashed them again), as
submit did then. The baselines:
    git archive --format=tar HEAD | tar -x -C DEST      (ships the commit only: no edits, no untracked files)
    rsync -a --exclude .git --exclude data SRC/ DEST/   (the working tree as it is, like the snapshot)
each into a new folder. The project is on the scratch disk; the copies go to tmpfs where it has room (see
`destination`: this VM's ext4 makes file creation 20x dearer at times, for every side alike). All sides read
warm files (one untimed run of each first, which also checks what each copied); `sync` runs before each
timed run, outside the timing, and no side syncs inside it (submit does not). The sides alternate
A B C / B C A / C A B.

Measured in a fresh interpreter that never imports torch, like the CLI that submits: the snapshot is
Python that allocates per file, and a process holding torch's objects would pay more for its garbage
collections.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import PY, REPO, Row, Settings, Target, Workspace, compare, interleaved, say

SECTION = "snapshot"
FILES = 5_000          # committed files (.gitignore and the script among them)
TOTAL_MB = 50          # their bytes, in MB (10**6)
FOLDERS = 100
BIG_FILES = 60         # of FILES: .csv, .jsonl and binary assets (0.1-0.8 MB, half the bytes); the rest small
EDITED = 5             # tracked files changed after the commit
UNTRACKED = 5          # new files, not ignored (the snapshot and rsync copy them, git archive cannot)
DATA_FILES, DATA_MB = 4, 16   # data/: ignored, never copied (rsync: --exclude data; hpc-ddp: a link)
SEED = 20261127

_WORDS = ["model", "loader", "trainer", "config", "utils", "metrics", "layers", "optim", "sched", "augment", "vision",
          "text", "audio", "graph", "eval", "export", "serve", "cli", "io", "sampler", "tokenizer", "encoder",
          "decoder", "heads", "losses", "callbacks", "logging", "viz", "registry", "plugins", "kernels", "ops",
          "quant", "distill", "search", "tune", "cache", "hooks", "schema", "api", "core", "common"]
_GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", "-c", "commit.gpgsign=false",
        "-c", "init.defaultBranch=main"]


def _text_pool(rng: random.Random) -> list[str]:
    """Lines that look like code and config, for files that compress like source does."""
    pool = []
    for _ in range(4000):
        a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
        n = rng.randrange(1000)
        pool.append(rng.choice((
            f"    {a}_{n} = {b}.{c}(x, dim={rng.randrange(8)})  # {a} {b}\n",
            f"def {a}_{b}_{n}(self, {c}, *args, **kwargs):\n",
            f"        return self.{a}({b}_{n}, {c}={rng.random():.4f})\n",
            f'  "{a}_{b}": {{"{c}": {rng.random():.6f}, "n": {n}}},\n',
            f"{a}:\n  {b}: {n}\n  {c}: [{rng.randrange(99)}, {rng.randrange(99)}]\n",
            f"from .{a} import {b.capitalize()}{c.capitalize()}\n",
            f"The {a} {b} uses the {c} of step {n}; see `{a}.{b}`.\n",
        )))
    return pool


def _text(rng: random.Random, pool: list[str], size: int) -> bytes:
    lines, n = [], 0
    while n < size:
        chunk = rng.choices(pool, k=max(1, (size - n) // 40))
        lines += chunk
        n += sum(map(len, chunk))
    return "".join(lines).encode()[:size]


def _folders(rng: random.Random) -> list[str]:
    tops = ["src/proj", "tests", "configs", "scripts", "docs", "assets", "notebooks"]
    folders = ["src", *tops]
    while len(folders) < FOLDERS:
        parent = rng.choice(folders)
        if parent == "src" or parent.count("/") >= 5:
            continue
        name = f"{rng.choice(_WORDS)}_{len(folders)}"
        folders.append(f"{parent}/{name}")
    return folders


def make_project(root: Path) -> dict:
    """The generated repo; what it holds, as each side should copy it."""
    rng = random.Random(SEED)
    pool = _text_pool(rng)
    folders = _folders(rng)
    files: dict[str, int] = {".gitignore": 0, "train.py": 0, "README.md": 0, "pyproject.toml": 0}
    small_exts = (".py",) * 12 + (".json",) * 4 + (".yaml", ".md", ".txt")
    n_small = FILES - BIG_FILES - len(files)
    for i in range(n_small):
        folder = rng.choice(folders)
        ext = ".py" if folder.startswith(("src", "tests", "scripts")) and rng.random() < 0.8 else rng.choice(small_exts)
        files[f"{folder}/{rng.choice(_WORDS)}_{i}{ext}"] = int(min(max(rng.lognormvariate(8.11, 0.9), 200), 60_000))
    small = sum(files.values())
    weights = [rng.uniform(0.2, 1.8) for _ in range(BIG_FILES)]
    left = TOTAL_MB * 10**6 - small - 200  # the root files below
    asset_folders = [f for f in folders if f.startswith(("assets", "docs", "notebooks"))] or folders
    for i, w in enumerate(weights):
        ext = (".csv", ".png", ".bin", ".jsonl")[i % 4]
        files[f"{rng.choice(asset_folders)}/{rng.choice(_WORDS)}_big_{i}{ext}"] = int(left * w / sum(weights))
    root.mkdir(parents=True)
    for rel, size in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel == ".gitignore":
            path.write_text("data/\n__pycache__/\n")
        elif rel == "train.py":
            path.write_text("import proj\n\nif __name__ == '__main__':\n    proj.main()\n")
        elif rel.endswith((".png", ".bin")):
            path.write_bytes(rng.randbytes(size))
        else:
            path.write_bytes(_text(rng, pool, size or 60))
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the project"], ["repack", "-adq"]):
        subprocess.run([*_GIT, *cmd], cwd=root, check=True)
    committed = {rel: (root / rel).stat().st_size for rel in files}
    pys = sorted(rel for rel in files if rel.endswith(".py") and rel != "train.py")
    for rel in rng.sample(pys, EDITED):
        with open(root / rel, "ab") as fh:
            fh.write(b"\n# changed after the commit\nDEBUG = True\n")
    for i in range(UNTRACKED):
        path = root / rng.choice(folders) / f"scratch_{i}.py"
        path.write_bytes(_text(rng, pool, 3000))
    (root / "data").mkdir()
    for i in range(DATA_FILES):
        (root / "data" / f"shard-{i}.bin").write_bytes(rng.randbytes(DATA_MB * 2**20))
    return {"committed": committed, "working": _tree(root, skip=(".git", "data"))}


def _tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """rel -> size of every regular file under `root` (links not followed; top-level `skip` left out)."""
    out = {}
    for folder, dirs, names in os.walk(root):
        if Path(folder) == root:
            dirs[:] = [d for d in dirs if d not in skip]
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                out[path.relative_to(root).as_posix()] = path.stat().st_size
    return out


def _digest(root: Path, rels) -> str:
    h = hashlib.sha256()
    for rel in sorted(rels):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    return h.hexdigest()


def create_cost(folder: Path, n: int = 2000) -> float:
    """µs the kernel takes to create an empty file in a new `folder` beside the copies (a plain loop): every
    side pays it per file (see `destination`)."""
    folder.mkdir()
    started = time.perf_counter()
    for i in range(n):
        os.close(os.open(folder / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    return (time.perf_counter() - started) / n * 1e6


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # the snapshot's read-only files sit in writable folders


def code_under_test(module) -> dict:
    """Which snapshot code was measured: the commit, the files of the copy path changed since, and the
    sha256 of snapshot.py as imported (the working tree may hold uncommitted changes)."""
    paths = ["hpc_ddp/snapshot/snapshot.py", "hpc_ddp/snapshot/listing.py", "hpc_ddp/snapshot/copying.py",
             "hpc_ddp/snapshot/gitinfo.py", "hpc_ddp/common/durable.py"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip(),
            "uncommitted": [line[3:] for line in git("status", "--porcelain", "--", *paths).splitlines()],
            "snapshot_py_sha256": hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]}


def destination(ws: Workspace) -> tuple[Path, str]:
    """Where the copies go: a folder on tmpfs (/dev/shm) where it has room, else on the scratch disk
    (BENCH_SNAPSHOT_ON_DISK=1 asks for the disk). On the 2-core VM's ext4 (no journal) the kernel takes
    20-50 µs to create a file in some folders and 300-900 µs in others, for minutes at a time (perf:
    `__ext4_new_inode` -> `find_inode_bit` -> `recently_deleted`), whoever creates it: in that state all
    three sides take ~3 s and the ratios say nothing about the tools. tmpfs has no such state."""
    need = 40 * TOTAL_MB * 10**6
    shm = Path("/dev/shm")
    if os.environ.get("BENCH_SNAPSHOT_ON_DISK") != "1" and shm.is_dir() and os.access(shm, os.W_OK) \
            and shutil.disk_usage(shm).free > need:
        return Path(tempfile.mkdtemp(prefix="hpc-ddp-bench-snapshot-", dir=shm)), "tmpfs (/dev/shm)"
    folder = ws.fresh("snapshot-copies")
    folder.mkdir()
    return folder, "the scratch disk"


def measure(ws: Workspace) -> dict:
    from hpc_ddp.snapshot import snapshot

    code = code_under_test(snapshot)
    src = ws.root / "snapshot-project"
    started = time.monotonic()
    expected = make_project(src)
    say(f"generated {len(expected['committed']):,} committed files, "
        f"{sum(expected['committed'].values()) / 1e6:,.1f} MB, in {FOLDERS} folders (+{UNTRACKED} untracked, "
        f"{EDITED} edited, data/ {DATA_FILES * DATA_MB} MiB ignored) in {time.monotonic() - started:.1f} s")
    dest, where = destination(ws)
    say(f"copies go to {dest} ({where})")
    try:
        return {**_measure(ws, snapshot, src, dest, expected), "code": code, "dest": where}
    finally:
        _remove(dest)
        _remove(src)


def _measure(ws: Workspace, snapshot, src: Path, base: Path, expected: dict) -> dict:
    from hpc_ddp.spec.jobspec import JobSpec
    from hpc_ddp.spec.jobspec import Target as JobTarget

    working, committed = expected["working"], expected["committed"]
    spec = JobSpec(JobTarget("script", str(src / "train.py")), job_name="bench", workdir=str(src), python=PY)
    parts: list[tuple[float, float]] = []   # (plan, take) seconds of each timed hpc-ddp run
    last: dict[str, Path] = {}              # each side's copy in its latest run
    count = iter(range(1, 10**6))

    lazy = "read" in inspect.signature(snapshot.plan).parameters  # submit's plan reads no file (bf893fe on)

    def ours(dest: Path) -> Path:
        t0 = time.perf_counter()
        snap = snapshot.plan(spec, str(dest), read=False) if lazy else snapshot.plan(spec, str(dest))
        t1 = time.perf_counter()
        taken = snapshot.take(snap)
        parts.append((t1 - t0, time.perf_counter() - t1))
        return Path(taken.dir)

    def archive(dest: Path) -> Path:
        dest.mkdir()
        subprocess.run(["bash", "-c", 'set -o pipefail; git -C "$1" archive --format=tar HEAD | tar -x -C "$2"',
                        "-", str(src), str(dest)], check=True)
        return dest

    def rsync(dest: Path) -> Path:
        subprocess.run(["rsync", "-a", "--exclude", ".git", "--exclude", "data", f"{src}/", f"{dest}/"], check=True)
        return dest

    def timed(name: str, op):
        """Each run copies into a new folder; the copies are kept until the section ends (as run dirs are),
        so no side's timing follows the removal of thousands of files."""
        def run(_n: int) -> float:
            dest = base / f"{name.split()[0]}-{next(count)}"  # never used before: nothing to reuse
            os.sync()  # no side pays for the writeback of another's copy
            t0 = time.perf_counter()
            last[name] = op(dest)
            return time.perf_counter() - t0
        return run

    sides = {"hpc-ddp snapshot": timed("hpc-ddp snapshot", ours),
             "git archive | tar -x": timed("git archive | tar -x", archive),
             "rsync -a": timed("rsync -a", rsync)}
    # one untimed run of each: warms the page cache and git's, and checks what each side copied
    for name, fn in sides.items():
        say(f"  warm-up {name}: {fn(-1):.3f} s")
    parts.clear()
    copies = dict(last)
    got = {name: _tree(copy) for name, copy in copies.items()}
    if got["hpc-ddp snapshot"] != working or got["rsync -a"] != working or got["git archive | tar -x"] != committed:
        raise RuntimeError("a side copied other files than it should: "
                           + ", ".join(f"{n} {len(t)} files, {sum(t.values()):,} B" for n, t in got.items())
                           + f"; expected {len(working)} files ({sum(working.values()):,} B) in the working tree")
    if _digest(copies["hpc-ddp snapshot"], working) != _digest(copies["rsync -a"], working):
        raise RuntimeError("the snapshot's bytes differ from rsync's copy of the working tree")
    if not os.path.islink(copies["hpc-ddp snapshot"] / "data"):
        raise RuntimeError("the snapshot has no link for the ignored data/ folder")
    say(f"checked: snapshot and rsync {len(working):,} files, {sum(working.values()) / 1e6:,.2f} MB each; "
        f"git archive {len(committed):,} files (the commit only)")
    repeats = 2 * ws.s.repeats + 1 if not ws.s.quick else 1
    creates = [create_cost(base / "creates-before")]
    runs = interleaved(sides, repeats, "s")
    creates.append(create_cost(base / "creates-after"))
    say(f"creating an empty file there: {creates[0]:.0f} µs before the runs, {creates[1]:.0f} µs after")
    return {"runs": runs, "parts": parts, "create_us": creates, "files": len(working),
            "path": "plan(read=False) + take" if lazy else "plan (reads + hashes) + take (reads + hashes again)",
            "bytes": sum(working.values()), "committed_files": len(committed),
            "committed_bytes": sum(committed.values()), "folders": len({r.rpartition("/")[0] for r in working})}


def run(ws: Workspace) -> list[Row]:
    out = ws.fresh("snapshot").with_suffix(".json")
    argv = [PY, "-m", "bench.snapshot_bench", str(ws.root), json.dumps(dataclasses.asdict(ws.s)), str(out)]
    subprocess.run(argv, check=True, cwd=REPO, env=ws.env())
    m = json.loads(out.read_text())
    runs, parts = m["runs"], m["parts"]
    extra = {"files": m["files"], "bytes": m["bytes"], "folders": m["folders"],
             "git_archive_files": m["committed_files"], "git_archive_bytes": m["committed_bytes"],
             "plan_s": statistics.median(p[0] for p in parts), "take_s": statistics.median(p[1] for p in parts),
             "submit_path": m["path"], "copies_on": m["dest"], "create_us_per_file": m["create_us"],
             "code_under_test": m["code"]}
    what = f"{m['files']:,} files, {m['bytes'] / 1e6:,.0f} MB"
    note = (f"{m['path']}, as submit calls them, a new code_root each repeat; copies on {m['dest']}; warm page "
            "cache; sync before each run, outside the timing")
    ours = "hpc-ddp snapshot (as submit takes it)"
    return [
        compare(SECTION, f"code snapshot vs git archive ({what})", "s", ours=ours,
                ours_samples=runs["hpc-ddp snapshot"], baseline="git archive HEAD piped to tar -x",
                baseline_samples=runs["git archive | tar -x"], target=Target("<=", 1.00), extra=extra,
                note=note + "; git archive ships the commit only (no edits, no untracked files)"),
        compare(SECTION, f"code snapshot vs rsync -a ({what})", "s", ours=ours,
                ours_samples=runs["hpc-ddp snapshot"], baseline="rsync -a --exclude .git --exclude data",
                baseline_samples=runs["rsync -a"], target=Target("<=", 1.00), extra=dict(extra), note=note),
    ]


if __name__ == "__main__":  # the fresh interpreter of run()
    root, settings_json, out_path = sys.argv[1:4]
    result = measure(Workspace(Path(root), Settings(**json.loads(settings_json))))
    Path(out_path).write_text(json.dumps(result))
