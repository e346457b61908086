"""Staging inside a job at scale: only each node's local rank 0 touches the shared run dir and dataset,
with a bounded number of metadata operations per poll; the node's other ranks hear the outcome (paths
or error) through their node's disk. Threads stand in for ranks; files are real."""

import dataclasses
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.data.staging import StagingError
from hpc_ddp.job import stagejob
from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.spec.jobspec import Layer, Target, build_spec


def _source(root: Path, files: int = 3) -> Path:
    src = root / "shared" / "mnist"
    src.mkdir(parents=True)
    for i in range(files):
        (src / f"{i}.bin").write_bytes(bytes([i]) * 100)
    return src


def _spec(src: Path, timeout: int = 60, **extra):
    spec = build_spec([Layer("t", {"datasets": [f"{src}:mnist"], **extra})], target=Target("script", "/t.py"),
                      workdir="/", python="p")
    return dataclasses.replace(spec, stage_timeout=timeout)


def _dist(rank: int, nodes: int, per_node: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank % per_node, world_size=nodes * per_node, local_world_size=per_node,
                   node_rank=rank // per_node, num_nodes=nodes, master_addr="n1", master_port=1,
                   hosts=tuple(f"gpu{n + 1:02d}" for n in range(nodes)), job_id="5", restart_count=0,
                   source="slurm")


def _node_env(tmp: Path, node: int) -> dict[str, str]:
    return {"SLURM_TMPDIR": str(tmp / f"node{node}-local")}


@pytest.fixture(autouse=True)
def own_tmp(tmp_path, monkeypatch):
    """The node's temp dir (the leader's second place for its word) is this test's, not /tmp."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def _run_ranks(ranks, target) -> dict[int, object]:
    """target(rank) on a thread per rank, named rank-R; rank -> its return value or exception."""
    results: dict[int, object] = {}

    def go(r):
        try:
            results[r] = target(r)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[r] = exc

    threads = [threading.Thread(target=go, args=(r,), name=f"rank-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


class _Touches:
    """Which thread stat'ed, listed, opened or made what, through os (pathlib goes through it too)."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, str, str]] = []
        lock = threading.Lock()
        for name in ("stat", "lstat", "listdir", "scandir", "mkdir", "open", "rename", "replace", "unlink"):
            real = getattr(os, name)

            def counted(path=".", *args, _real=real, _name=name, **kwargs):
                if not isinstance(path, int):
                    with lock:
                        self.seen.append((threading.current_thread().name, _name, os.fsdecode(os.fspath(path))))
                return _real(path, *args, **kwargs)
            monkeypatch.setattr(os, name, counted)

    def under(self, root: Path, who: str | None = None) -> list[tuple[str, str, str]]:
        return [t for t in self.seen if t[2].startswith(str(root)) and (who is None or t[0] == who)]


def test_only_each_nodes_local_rank_0_touches_the_shared_filesystem(tmp_path, monkeypatch):
    src = _source(tmp_path)
    spec, run_dir = _spec(src), tmp_path / "shared" / "run"
    touches = _Touches(monkeypatch)
    results = _run_ranks(range(6), lambda r: stagejob.stage_for_job(spec, _dist(r, 2, 3), run_dir,
                                                                    _node_env(tmp_path, r // 3), log=lambda _m: None))
    for r in range(6):
        assert results[r] == {"mnist": str(tmp_path / f"node{r // 3}-local" / "hpc-ddp-datasets" / "mnist")}
    shared = tmp_path / "shared"
    for r in (1, 2, 4, 5):  # neither the run dir nor the source: no walk of the dataset per rank
        assert touches.under(shared, f"rank-{r}") == [], touches.under(shared, f"rank-{r}")[:3]
    assert touches.under(shared, "rank-0") and touches.under(shared, "rank-3")


def test_a_leader_does_one_shared_operation_per_poll_however_many_nodes_wait(tmp_path, monkeypatch):
    """Node 5's leader waits for one missing node among 4 and among 64: the run dir sees the same
    number of operations, not one stat per node per poll."""
    counts = {}
    for nodes in (4, 64):
        run_dir = tmp_path / f"run{nodes}"
        marks = run_dir / "stage" / "5-0"
        marks.mkdir(parents=True)
        for n in range(nodes - 1):  # every node but the last is there
            (marks / f"node-{n}.json").write_text("{}")
        spec = _spec(tmp_path, timeout=1)
        touches = _Touches(monkeypatch)
        with pytest.raises(HpcDdpError, match=rf"staging did not finish on node {nodes - 1} \(gpu{nodes:02d}\) within 1 s"):
            stagejob._all_nodes_ready(spec, _dist(5 * 2, nodes, 2), run_dir, {})
        monkeypatch.undo()
        polls = touches.under(marks / "all-ready")
        counts[nodes] = len(touches.under(run_dir))
        assert polls and all(op == "stat" for _, op, _ in polls)
        assert counts[nodes] <= len(polls) + 6  # mkdirs, this node's mark, one listing at the deadline
    assert counts[4] == pytest.approx(counts[64], abs=2), counts


def test_node_0_lists_the_marks_and_says_when_all_are_there(tmp_path):
    run_dir = tmp_path / "run"
    marks = run_dir / "stage" / "5-0"
    marks.mkdir(parents=True)
    for n in (1, 2):
        (marks / f"node-{n}.json").write_text("{}")
    stagejob._all_nodes_ready(_spec(tmp_path, timeout=5), _dist(0, 3, 1), run_dir, {})
    assert (marks / "all-ready").exists()
    stagejob._all_nodes_ready(_spec(tmp_path, timeout=5), _dist(2, 3, 1), run_dir, {})  # returns at once


def test_the_leaders_error_reaches_its_nodes_other_ranks_at_once(tmp_path):
    src = _source(tmp_path)
    spec, run_dir = _spec(src, timeout=1), tmp_path / "shared" / "run"
    started = time.monotonic()
    results = _run_ranks(range(3), lambda r: stagejob.stage_for_job(spec, _dist(r, 2, 3), run_dir,
                                                                    _node_env(tmp_path, 0), log=lambda _m: None))
    assert time.monotonic() - started < 10  # not the followers' own, longer limit
    for r in range(3):  # node 1 never came: every rank of node 0 says so, naming it
        assert isinstance(results[r], HpcDdpError), results[r]
        assert "staging did not finish on node 1 (gpu02) within 1 s" in results[r].message
        assert "local rank 0's log on that node" in results[r].hint


def test_a_refused_dataset_is_the_users_error_on_every_rank(tmp_path):
    """A leader's UserError (exit 2) stays one for the ranks that hear of it."""
    bad = tmp_path / "shared" / "bad.tar"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a tar at all")
    spec, run_dir = _spec(bad), tmp_path / "shared" / "run"
    results = _run_ranks(range(2), lambda r: stagejob.stage_for_job(spec, _dist(r, 1, 2), run_dir,
                                                                    _node_env(tmp_path, 0), log=lambda _m: None))
    assert isinstance(results[0], HpcDdpError) and isinstance(results[1], HpcDdpError)
    assert results[1].message == results[0].message and results[1].exit_code == results[0].exit_code == 2


def test_the_shared_copy_fallback_reaches_the_other_ranks_through_the_temp_dir(tmp_path):
    src = _source(tmp_path)
    (tmp_path / "not-a-dir").write_text("")
    spec = _spec(src, scratch=str(tmp_path / "not-a-dir"), stage_fallback="shared")
    logged = []
    results = _run_ranks(range(2), lambda r: stagejob.stage_for_job(spec, _dist(r, 1, 2), tmp_path / "run", {},
                                                                    log=logged.append))
    assert results == {0: {"mnist": str(src)}, 1: {"mnist": str(src)}}
    assert any("reading the shared copy in place" in line for line in logged)
    assert (tmp_path / "tmp" / ".ready-5-0-node0.json").exists()


def test_a_silent_leader_times_out_its_nodes_ranks_pointing_at_it(tmp_path, monkeypatch):
    monkeypatch.setattr(stagejob, "LEADER_SILENT_GRACE_S", 0)
    src = _source(tmp_path)
    with pytest.raises(StagingError, match="waited 2 s for local rank 0 to stage mnist and to hear from every node"
                                           ".*local rank 0's log on this node"):
        stagejob.stage_for_job(_spec(src, timeout=1), _dist(1, 1, 2), tmp_path / "run", _node_env(tmp_path, 0),
                               log=lambda _m: None)
    assert not (tmp_path / "run").exists()  # the waiting rank never touched the run dir


def test_a_mark_that_is_a_link_is_not_trusted(tmp_path):
    real = tmp_path / "elsewhere.json"
    real.write_text('{"staged": {"mnist": "/etc"}}')
    mark = tmp_path / ".ready-5-0-node0.json"
    mark.symlink_to(real)
    assert stagejob._read_mark(mark) is None
    assert stagejob._read_mark(real) == {"staged": {"mnist": "/etc"}}


def test_polls_back_off_so_the_whole_job_stays_under_its_budget():
    def first(nodes, n=30):
        gen = stagejob.poll_delays(nodes)
        return [next(gen) for _ in range(n)]

    assert first(2) == [0.2] * 30  # small jobs poll as before
    big = first(256)
    assert big[0] == 0.2 and big == sorted(big) and big[-1] == pytest.approx(256 / stagejob.FS_POLLS_PER_S)
    for nodes in (256, 1024, 4096):  # steady state: nodes / delay stays within the budget
        assert nodes / first(nodes)[-1] <= stagejob.FS_POLLS_PER_S * 1.001
    assert first(10**6)[-1] == stagejob.MAX_POLL_S
