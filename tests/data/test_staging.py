"""Dataset staging: one copy per node under concurrency, never a partial dataset, recovery after a kill,
hostile archives refused, reuse, and the free-space check."""

import hashlib
import multiprocessing as mp
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.data.staging import HostileArchive, StagingError, stage


def make_source(root: Path, files: int = 40, size: int = 50_000) -> Path:
    src = root / "shared" / "mnist"
    for i in range(files):
        path = src / f"class_{i % 4}" / f"{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(hashlib.sha256(str(i).encode()).digest() * (size // 32))
    return src


def digest_tree(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _rank(src, scratch, queue):
    result = stage(src, scratch, name="mnist", log=lambda _m: None)
    queue.put((str(scratch), result.copied, digest_tree(result.path)))


def test_two_nodes_four_ranks_stage_once_per_node(tmp_path):
    src = make_source(tmp_path, files=120)
    want = digest_tree(src)
    nodes = [tmp_path / "node0-local", tmp_path / "node1-local"]
    seen_partial = []
    stop = threading.Event()

    def watch():  # whenever the staged dir is visible, it must be complete
        while not stop.is_set():
            for node in nodes:
                target = node / "mnist"
                if target.is_dir() and sum(1 for p in target.rglob("*") if p.is_file()) != 120:
                    seen_partial.append(str(target))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(src, node, queue)) for node in nodes for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    stop.set()
    watcher.join()
    results = [queue.get(timeout=5) for _ in procs]
    assert all(p.exitcode == 0 for p in procs)
    for node in nodes:
        copies = [copied for scratch, copied, _ in results if scratch == str(node)]
        assert len(copies) == 4 and sum(copies) == 1  # exactly one copy per node
    assert {d for _, _, d in results} == {want}
    assert seen_partial == []


def test_reuse_and_restage_when_the_source_changes(tmp_path):
    src = make_source(tmp_path, files=5)
    first = stage(src, tmp_path / "local", log=lambda _m: None)
    assert first.copied and digest_tree(first.path) == digest_tree(src)
    assert not stage(src, tmp_path / "local", log=lambda _m: None).copied
    (src / "new.bin").write_bytes(b"x")
    again = stage(src, tmp_path / "local", log=lambda _m: None)
    assert again.copied and (again.path / "new.bin").read_bytes() == b"x"


def test_killed_stager_leaves_nothing_complete_and_rerun_recovers(tmp_path):
    src = make_source(tmp_path, files=400, size=200_000)  # ~80 MB: the kill lands mid-copy
    scratch = tmp_path / "local"
    code = ("import sys; from hpc_ddp.data.staging import stage; "
            "stage(sys.argv[1], sys.argv[2], name='mnist', checksums=True, log=lambda m: None)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(src), str(scratch)])
    deadline = time.monotonic() + 30
    while not list(scratch.glob(".mnist.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (scratch / "mnist.complete.json").exists()
    assert not (scratch / "mnist").exists() or (scratch / "mnist.complete.json").exists()
    result = stage(src, scratch, name="mnist", log=lambda _m: None)
    assert result.copied and digest_tree(result.path) == digest_tree(src)
    assert list(scratch.glob(".mnist.tmp-*")) == []


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for info, data in members:
            import io
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"abc") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


@pytest.mark.parametrize("member", [_file("../escape.txt"), _file("/tmp/abs-hpc-ddp-test.txt"),
                                    _link("data/evil", "/etc/passwd"), _link("data/up", "../../outside")])
def test_hostile_tar_is_refused(tmp_path, member):
    archive = _tar(tmp_path / "evil.tar.gz", [_file("data/ok.txt"), member])
    with pytest.raises(HostileArchive, match="refusing archive"):
        stage(archive, tmp_path / "local", name="evil", log=lambda _m: None)
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/abs-hpc-ddp-test.txt").exists()
    assert not (tmp_path / "local" / "evil").exists() and not list((tmp_path / "local").glob(".evil.tmp-*"))


def test_hostile_zip_is_refused(tmp_path):
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ok.txt", "fine")
        zf.writestr("../escape.txt", "bad")
    with pytest.raises(HostileArchive, match="'../escape.txt'"):
        stage(archive, tmp_path / "local", log=lambda _m: None)
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_archives_are_extracted_and_verified(tmp_path, kind):
    src = make_source(tmp_path, files=6)
    archive = tmp_path / f"mnist.{kind}"
    if kind == "zip":
        with zipfile.ZipFile(archive, "w") as zf:
            for p in sorted(src.rglob("*.bin")):
                zf.write(p, p.relative_to(src.parent).as_posix())
    else:
        with tarfile.open(archive, "w:gz") as tf:
            tf.add(src, arcname="mnist")
    result = stage(archive, tmp_path / "local", log=lambda _m: None)
    assert result.copied and result.files == 6
    assert digest_tree(result.path / "mnist") == digest_tree(src)


class FakeFs:
    """os.statvfs of a filesystem with 4 KiB blocks, `free_blocks` of them free."""

    def __init__(self, free_blocks: int, free_inodes: int = 10**6):
        self.f_frsize = self.f_bsize = 4096
        self.f_bavail, self.f_files, self.f_favail = free_blocks, 10**6, free_inodes


def test_not_enough_space_names_both_numbers(tmp_path, monkeypatch):
    import os

    src = make_source(tmp_path, files=4)  # 4 x 49,984 B: 13 blocks each, plus 5 directories
    monkeypatch.setattr(os, "statvfs", lambda _p: FakeFs(free_blocks=50))
    with pytest.raises(StagingError, match=r"needs 233\.5 kB \(4 files in 4096 B blocks\), 204\.8 kB free.*HINT"):
        stage(src, tmp_path / "local", log=lambda _m: None)
    assert [p.name for p in (tmp_path / "local").iterdir()] == [".mnist.lock"]  # nothing copied


def test_small_files_are_counted_in_blocks(tmp_path, monkeypatch):
    import os

    src = tmp_path / "tiny"
    src.mkdir()
    for i in range(100):
        (src / f"{i}.bin").write_bytes(b"x" * 100)  # 10 kB of bytes, 100 blocks
    monkeypatch.setattr(os, "statvfs", lambda _p: FakeFs(free_blocks=60))
    with pytest.raises(StagingError, match="not enough space"):
        stage(src, tmp_path / "local", log=lambda _m: None)
    monkeypatch.setattr(os, "statvfs", lambda _p: FakeFs(free_blocks=200, free_inodes=50))
    with pytest.raises(StagingError, match="needs 101, 50 free"):
        stage(src, tmp_path / "local", log=lambda _m: None)


def test_missing_source_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        stage(tmp_path / "nope", tmp_path / "local")


def test_stage_command(tmp_path):
    src = make_source(tmp_path, files=3)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "stage", str(src), "--dest", str(tmp_path / "local")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "local" / "mnist")
    assert "3 files" in done.stderr and "MB/s" in done.stderr


def test_job_staging_names_the_node_that_did_not_finish(tmp_path):
    import dataclasses

    from hpc_ddp.job.distenv import DistEnv
    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec
    from hpc_ddp.job.stagejob import stage_for_job

    src = make_source(tmp_path, files=2)
    spec = build_spec([Layer("c", {"datasets": [f"{src}:mnist"], "scratch": str(tmp_path / "local")})],
                      target=Target("script", "/t.py"), workdir="/", python="p")
    spec = dataclasses.replace(spec, stage_timeout=1)
    dist = DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=2, node_rank=0, num_nodes=2,
                   master_addr="n1", master_port=1, hosts=("gpu01", "gpu02"), job_id="5", restart_count=0,
                   source="slurm")
    with pytest.raises(HpcDdpError, match=r"staging did not finish on node 1 \(gpu02\) within 1 s"):
        stage_for_job(spec, dist, tmp_path / "run", {}, log=lambda _m: None)
    assert (tmp_path / "local" / "hpc-ddp-datasets" / "mnist.complete.json").exists()  # this node did its part


def test_waiting_rank_times_out_pointing_at_local_rank_0(tmp_path):
    from hpc_ddp.data.staging import wait_for_stage

    src = make_source(tmp_path, files=2)
    with pytest.raises(StagingError, match="waited 0 s for local rank 0 to stage mnist.*local rank 0's log"):
        wait_for_stage(src, tmp_path / "local", name="mnist", timeout=0.2)


@pytest.mark.parametrize("value,message", [
    (["data/x:1bad"], "must be a letter"), (["/tmp:m", "/:m"], "share a name"), ({"bad-name": "/x"}, "must be a letter"),
])
def test_bad_dataset_specs(value, message):
    from hpc_ddp.common.errors import SpecError
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    with pytest.raises(SpecError, match=message):
        build_spec([Layer("c", {"datasets": value})], target=Target("script", "/t.py"), workdir="/", python="p")


def _download_rank(target, local_rank, rank, shared, mirror, counter, queue):
    import fcntl

    from hpc_ddp.data.staging import download_once

    def fetch(tmp):  # a local file source standing in for the network
        with open(counter, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.write("x")
        time.sleep(0.3)  # slow, so the waiting ranks really wait
        import shutil

        shutil.copytree(mirror, tmp, dirs_exist_ok=True)

    builder = rank == 0 if shared else local_rank == 0
    path = download_once(fetch, target, key="v1", builder=builder, timeout=30, log=lambda _m: None)
    queue.put(digest_tree(Path(path)))


@pytest.mark.parametrize("shared", [False, True])
def test_download_happens_once_per_node_or_once_in_all(tmp_path, shared):
    mirror = make_source(tmp_path, files=3)
    counter = tmp_path / "downloads"
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = []
    for node in range(2):
        target = tmp_path / ("shared-fs" if shared else f"node{node}-local") / "mnist"
        for local in range(4):
            procs.append(ctx.Process(target=_download_rank, args=(target, local, node * 4 + local, shared, mirror,
                                                                  counter, queue)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert {queue.get(timeout=5) for _ in procs} == {digest_tree(mirror)}
    assert len(counter.read_text()) == (1 if shared else 2)


@pytest.mark.parametrize("fallback", ["shared", "fail"])
def test_unusable_local_disk_reads_the_shared_copy_or_fails(tmp_path, fallback):
    from hpc_ddp.job.distenv import DistEnv
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec
    from hpc_ddp.job.stagejob import stage_for_job

    src = make_source(tmp_path, files=2)
    (tmp_path / "not-a-dir").write_text("")
    spec = build_spec([Layer("c", {"datasets": [f"{src}:mnist"], "scratch": str(tmp_path / "not-a-dir"),
                                   "stage_fallback": fallback})],
                      target=Target("script", "/t.py"), workdir="/", python="p")
    dist = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr="n1", master_port=1, hosts=("n1",), job_id="5", restart_count=0, source="slurm")
    logged = []
    if fallback == "fail":
        with pytest.raises(StagingError, match="cannot stage mnist into .*HINT"):
            stage_for_job(spec, dist, tmp_path / "run", {}, log=logged.append)
        return
    assert stage_for_job(spec, dist, tmp_path / "run", {}, log=logged.append) == {"mnist": str(src)}
    assert "reading the shared copy in place" in logged[-1]


@pytest.mark.parametrize("fallback", ["shared", "fail"])
def test_a_users_directory_in_the_node_scratch_is_never_replaced_by_a_job(tmp_path, fallback):
    from hpc_ddp.job.distenv import DistEnv
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec
    from hpc_ddp.job.stagejob import stage_for_job

    src = make_source(tmp_path, files=2)
    mine = tmp_path / "local" / "hpc-ddp-datasets" / "mnist"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    spec = build_spec([Layer("c", {"datasets": [f"{src}:mnist"], "scratch": str(tmp_path / "local"),
                                   "stage_fallback": fallback})],
                      target=Target("script", "/t.py"), workdir="/", python="p")
    dist = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                   master_addr="n1", master_port=1, hosts=("n1",), job_id="5", restart_count=0, source="slurm")
    logged = []
    if fallback == "fail":
        with pytest.raises(StagingError, match="was not staged by hpc-ddp.*HINT") as info:
            stage_for_job(spec, dist, tmp_path / "run", {}, log=logged.append)
        assert str(info.value).count("HINT") == 1
    else:
        assert stage_for_job(spec, dist, tmp_path / "run", {}, log=logged.append) == {"mnist": str(src)}
        assert "was not staged by hpc-ddp" in logged[-1]
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
