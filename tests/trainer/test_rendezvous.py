"""The bounded rendezvous: taken ports, missing ranks, silent peers and a hanging exit, in one process
(threads stand in for ranks; the TCPStore is real)."""

import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.job.ports import first_free_port, port_in_use
from hpc_ddp.trainer import rendezvous
from hpc_ddp.watch.classify import classify_failure


def _env(rank: int, world: int, port: int, per_node: int = 1) -> DistEnv:
    hosts = tuple(f"node{i}" for i in range(-(-world // per_node)))
    return DistEnv(rank=rank, local_rank=rank % per_node, world_size=world, local_world_size=per_node,
                   node_rank=rank // per_node, num_nodes=len(hosts), master_addr="127.0.0.1", master_port=port,
                   hosts=hosts, job_id="7", restart_count=0, source="test")


@pytest.fixture
def port():
    return first_free_port(31000 + threading.get_ident() % 500)


@pytest.fixture
def listener(port):
    with socket.socket() as s:
        s.bind(("", port))
        s.listen()
        yield port


def test_port_in_use_sees_a_listener_and_first_free_port_skips_it(listener):
    assert port_in_use(listener)
    assert first_free_port(listener) == listener + 1 or port_in_use(listener + 1)
    assert first_free_port(listener) != listener


def test_a_taken_port_fails_at_once_naming_it_and_the_fix(listener):
    started = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError) as err:
        rendezvous.join(_env(0, 2, listener), timeout_s=30, host="login1")
    assert time.monotonic() - started < 5
    assert f"MASTER_PORT {listener} is already in use on login1" in err.value.message
    assert "--master-port" in err.value.hint


def test_missing_ranks_are_named_with_their_expected_hosts(port):
    seen = []

    def rank_1():
        with pytest.raises(rendezvous.RendezvousError) as err:
            rendezvous.join(_env(1, 4, port, per_node=2), timeout_s=2)
        seen.append(err.value.message)

    helper = threading.Thread(target=rank_1)
    started = time.monotonic()
    helper.start()
    with pytest.raises(rendezvous.RendezvousError) as err:
        rendezvous.join(_env(0, 4, port, per_node=2), timeout_s=2)
    helper.join()
    assert 1.5 < time.monotonic() - started < 10
    expected = "ranks 2 (node1), 3 (node1) did not join the rendezvous within 2 s (2 of 4 ranks did)"
    assert expected in err.value.message and seen and expected in seen[0]  # every waiting rank says the same


def test_everyone_joins_and_gets_a_working_store(port):
    stores = [None, None]

    def go(rank):
        stores[rank] = rendezvous.join(_env(rank, 2, port), timeout_s=10)

    threads = [threading.Thread(target=go, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(stores) and stores[1].get("joined/0") == socket.gethostname().encode()
    stores[0].set("x", "1")
    assert stores[1].get("x") == b"1"


def test_a_rank_that_cannot_reach_rank_0_says_so_within_its_timeout(port):
    started = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError) as err:
        rendezvous.join(_env(3, 4, port, per_node=2), timeout_s=1.5, host="node1")
    assert time.monotonic() - started < 6
    assert f"rank 3 on node1 could not reach rank 0's rendezvous at 127.0.0.1:{port} within 1.5 s" in err.value.message
    assert "rank 0 (node0) did not start, died, or is unreachable" in err.value.message


def test_a_silent_rank_is_named_and_beating_ranks_are_not(port):
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    store = rendezvous._scoped(server, _env(0, 3, port))
    alive = rendezvous.Heartbeat(_env(1, 3, port), interval_s=0.1).start()
    store.add("heartbeat/2", 1)  # rank 2 beat once, then went quiet
    try:
        # A 2 s window for rank 1's 0.1 s beats: a loaded machine once left its thread 0.5 s without a beat.
        assert rendezvous.unresponsive(store, _env(0, 3, port), window_s=2) == [2]
        line = rendezvous.explain_failure(store, _env(0, 3, port), window_s=2)
        assert line.startswith("rank 2 (node2) stopped responding (no heartbeat for 2 s)"), line
    finally:
        alive.stop()


def test_rank_0_outlives_ranks_that_beat_until_they_leave_but_not_a_rank_that_died(port):
    """Rank 0 keeps its store up for the ranks still beating (they read there why the run stopped) and
    stops waiting for one whose heartbeat stopped without saying it left: a crash's restart is not held
    up by the whole bound (issue 44)."""
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    store = rendezvous._scoped(server, _env(0, 3, port))
    alive = rendezvous.Heartbeat(_env(1, 3, port), interval_s=0.1).start()
    store.add("heartbeat/2", 1)  # rank 2 beat once, then was killed
    rendezvous.mark_left(store, _env(0, 3, port), "finished")
    leaves = threading.Timer(1.5, lambda: (rendezvous.mark_left(store, _env(1, 3, port), "finished"), alive.stop()))
    leaves.start()
    try:
        began = time.monotonic()
        rendezvous.outlive_peers(store, _env(0, 3, port), timeout_s=30, quiet_s=0.5)
        waited = time.monotonic() - began
    finally:
        leaves.cancel()
        alive.stop()
    assert 1.4 <= waited < 10  # until rank 1 said it left; rank 2, quiet since, was not waited for
    assert sorted(rendezvous.left_ranks(store)) == [0, 1]

    began = time.monotonic()  # nobody beating: only the quiet time, not the bound
    rendezvous.outlive_peers(store, _env(0, 3, port), timeout_s=30, quiet_s=0.5)
    assert time.monotonic() - began < 10


def test_a_store_that_is_gone_means_rank_0_is_gone(port):
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False)
    del server
    line = rendezvous.explain_failure(client, _env(1, 2, port))
    assert line.startswith("rank 0 (node0) is gone: its rendezvous store at 127.0.0.1:")


def test_leave_does_not_wait_for_a_hanging_destroy(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: time.sleep(60))
    started = time.monotonic()
    rendezvous.leave(timeout_s=0.3)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("text,kind", [
    ("hpc-ddp train: error: rank 0: rank 3 (hpcn2) stopped responding (no heartbeat for 5 s): it died", "rank_lost"),
    ("rank 0 (hpcn1) is gone: its rendezvous store at hpcn1:21234 stopped answering", "rank_lost"),
    ("rank 1 (hpcn1) did not join the rendezvous within 20 s", "rendezvous_timeout"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad", "user_code_exception"),
    ("slurmstepd: error: *** JOB 5 ON hpcn1 CANCELLED AT 2026 DUE TO TIME LIMIT ***", "time_limit"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "out_of_memory"),
])
def test_failures_are_classified(text, kind):
    assert classify_failure([text])[0] == kind


def test_a_rank_that_left_with_an_error_is_named_for_it_and_one_that_finished_is_not(port):
    server = dist.TCPStore("127.0.0.1", port, 4, True, wait_for_workers=False)
    store = rendezvous._scoped(server, _env(0, 4, port))
    alive = rendezvous.Heartbeat(_env(3, 4, port), interval_s=0.1).start()
    for r in (1, 2):
        store.add(f"heartbeat/{r}", 1)
    rendezvous.mark_left(store, _env(1, 4, port), "ValueError: bad shard")
    rendezvous.mark_left(store, _env(2, 4, port), "finished")
    try:
        began = time.monotonic()
        line = rendezvous.explain_failure(store, _env(0, 4, port), window_s=5)
        assert line == "rank 1 (node1) failed: ValueError: bad shard"
        assert time.monotonic() - began < 4  # named at once: the heartbeat window is for ranks that said nothing
    finally:
        alive.stop()


def test_the_first_verdict_is_repeated_by_ranks_that_find_out_later(port):
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    store = rendezvous._scoped(server, _env(0, 3, port))
    store.add("heartbeat/2", 1)
    first = rendezvous.explain_failure(store, _env(1, 3, port), window_s=0.3)
    assert first.startswith("ranks 0 (node0), 2 (node2) stopped responding")
    # Rank 1 has left after finding out; a later rank must not blame it (or re-wait).
    rendezvous.mark_left(store, _env(1, 3, port), rendezvous.LEFT_AFTER_OTHERS)
    started = time.monotonic()
    assert rendezvous.explain_failure(store, _env(0, 3, port), window_s=5) == first
    assert time.monotonic() - started < 1


def test_ranks_still_waiting_when_rank_0_gives_up_say_so(port):
    server = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    client = rendezvous._scoped(dist.TCPStore("127.0.0.1", port, 3, False), _env(1, 3, port))
    del server
    with pytest.raises(rendezvous.RendezvousError) as err:
        rendezvous._wait_all(client, _env(1, 3, port), "joined", time.monotonic() + 5)
    assert "rank 1: rank 0 (node0) is gone" in err.value.message and "gave up or died first" in err.value.message


# ---- at scale: what one rank works out for all, and how often waiting ranks ask ----

def _counting(monkeypatch, name):
    """Wrap rendezvous.<name> to count its calls."""
    calls = []
    real = getattr(rendezvous, name)

    def counted(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(rendezvous, name, counted)
    return calls


def _in_threads(n, target):
    results = {}

    def go(i):
        try:
            results[i] = target(i)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,), name=f"rank-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_every_survivor_asks_why_but_one_rank_investigates(port, monkeypatch):
    world, dead = 12, 7
    server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
    stores = [rendezvous._scoped(dist.TCPStore("127.0.0.1", port, world, False), _env(r, world, port))
              for r in range(world)]
    beats = [rendezvous.Heartbeat(_env(r, world, port), interval_s=0.1).start() for r in range(world) if r != dead]
    stores[0].add(f"heartbeat/{dead}", 1)  # it beat once, then died
    looked = _counting(monkeypatch, "unresponsive")
    survivors = [r for r in range(world) if r != dead]
    try:
        answers = _in_threads(len(survivors), lambda i: rendezvous.explain_failure(
            stores[survivors[i]], _env(survivors[i], world, port), window_s=0.5))
    finally:
        for b in beats:
            b.stop()
    assert len(looked) == 1  # one investigation, O(world) requests once, not once per survivor
    assert set(answers.values()) == {"rank 7 (node7) stopped responding (no heartbeat for 0.5 s): it died or hung"}
    del server


def test_an_investigation_that_blames_nobody_does_not_silence_a_later_one(port):
    world = 3
    server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
    store = rendezvous._scoped(server, _env(0, world, port))
    beats = [rendezvous.Heartbeat(_env(r, world, port), interval_s=0.1).start() for r in (0, 2)]
    try:
        # Rank 1's own code raised: every other rank is alive, nobody to blame.
        assert rendezvous.explain_failure(store, _env(1, world, port), window_s=0.5) is None
        rendezvous.mark_left(store, _env(1, world, port), "ValueError: bad shard")
        # Rank 0's collective then fails because rank 1 left: it must name rank 1, not repeat "nobody".
        assert rendezvous.explain_failure(store, _env(0, world, port), window_s=0.5) == \
            "rank 1 (node1) failed: ValueError: bad shard"
    finally:
        for b in beats:
            b.stop()


def test_ranks_that_time_out_together_work_out_who_is_missing_once(port, monkeypatch):
    world, came = 16, 12
    asked = _counting(monkeypatch, "_missing")
    results = _in_threads(came, lambda r: rendezvous.join(_env(r, world, port, per_node=4), timeout_s=1.5))
    expected = "ranks 12 (node3), 13 (node3), 14 (node3), 15 (node3) did not join the rendezvous within 1.5 s"
    for r in range(came):
        assert isinstance(results[r], rendezvous.RendezvousError), results[r]
        assert expected in results[r].message
    assert len(asked) == 1


def test_the_health_watchdogs_name_the_absent_rank_working_it_out_once(port, monkeypatch, capsys):
    world = 6
    server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
    store = rendezvous._scoped(server, _env(0, world, port))
    for r in range(world - 1):  # rank 5 never reached the health check
        store.set(f"health/{r}", "entered")
        store.add("health/count", 1)
    asked = _counting(monkeypatch, "_missing")

    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)  # the watchdog's last act: here it ends only its thread
    _in_threads(world - 1, lambda r: rendezvous._health_watchdog(store, _env(r, world, port), 0.3, threading.Event()))
    lines = [line for line in capsys.readouterr().err.splitlines() if "health check" in line]
    assert len(lines) == world - 1 and all("rank 5 (node5) never reached it" in line for line in lines)
    assert exits == [1] * (world - 1) and len(asked) == 1


def test_waiting_ranks_back_off_so_all_of_them_poll_the_store_a_bounded_number_of_times():
    def delays(world, n=40):
        gen = rendezvous.poll_delays(world)
        return [next(gen) for _ in range(n)]

    assert delays(16) == [rendezvous.FIRST_POLL_S] * 40  # small jobs (and checkpoint barriers) as before
    for world in (2048, 8192):
        steady = delays(world)[-1]
        assert steady > rendezvous.FIRST_POLL_S and world / steady <= rendezvous.STORE_POLLS_PER_S * 1.001
    assert delays(10**6)[-1] == rendezvous.MAX_POLL_S


class _Counted(dist.Store):
    """A store that counts the requests made through it (each is one round trip to the server)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.requests = inner, 0

    def _n(self):
        self.requests += 1

    def set(self, key, value):
        self._n()
        return self.inner.set(key, value)

    def get(self, key):
        self._n()
        return self.inner.get(key)

    def add(self, key, value):
        self._n()
        return self.inner.add(key, value)

    def check(self, keys):
        self._n()
        return self.inner.check(keys)

    def multi_get(self, keys):
        self._n()
        return self.inner.multi_get(keys)

    def append(self, key, value):
        self._n()
        return self.inner.append(key, value)


def test_the_investigation_does_not_ask_once_per_rank(port):
    world, dead = 24, 9
    server = dist.TCPStore("127.0.0.1", port, world, True, wait_for_workers=False)
    counted = _Counted(server)  # kept: the PrefixStore below holds only its C++ half
    store = rendezvous._scoped(counted, _env(0, world, port))
    for r in range(world):
        store.add(f"heartbeat/{r}", 1)  # every rank beat at start-up
    beats = [rendezvous.Heartbeat(_env(r, world, port), interval_s=0.1).start() for r in range(1, world) if r != dead]
    rendezvous.mark_left(store, _env(5, world, port), "finished")  # a rank that finished is not blamed
    counted.requests = 0
    try:
        line = rendezvous.explain_failure(store, _env(0, world, port), window_s=0.5)
    finally:
        for b in beats:
            b.stop()
    assert line == "rank 9 (node9) stopped responding (no heartbeat for 0.5 s): it died or hung"
    assert counted.requests < 20  # not 3 per rank


def test_missing_ranks_are_found_by_halving_not_by_asking_for_each(port):
    world = 256
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    counted = _Counted(server)
    store = rendezvous._scoped(counted, _env(0, world, port))
    for r in set(range(world)) - {3, 200, 201}:
        store.set(f"joined/{r}", "h")
    counted.requests = 0
    assert rendezvous._missing(store, _env(0, world, port), "joined") == [3, 200, 201]
    assert counted.requests < 50  # about 2 m log2(world / m), not 256


def _limits(monkeypatch, soft, hard):
    """getrlimit answers (soft, hard) for open files; the setrlimit calls are recorded, not made."""
    calls = []
    monkeypatch.setattr(rendezvous.resource, "getrlimit", lambda what: (soft, hard))
    monkeypatch.setattr(rendezvous.resource, "setrlimit", lambda what, limits: calls.append((what, limits)))
    return calls


def test_rank_0_raises_its_open_file_limit_to_fit_two_connections_per_rank(monkeypatch):
    calls = _limits(monkeypatch, 1024, 65536)
    rendezvous._room_for_connections(_env(0, 2048, 1), "node0")
    need = 2 * 2048 + rendezvous.FD_MARGIN
    assert calls == [(rendezvous.resource.RLIMIT_NOFILE, (need, 65536))]


def test_a_hard_limit_that_fits_the_connections_but_not_the_margin_is_used_whole(monkeypatch):
    calls = _limits(monkeypatch, 1024, 4200)
    rendezvous._room_for_connections(_env(0, 2048, 1), "node0")
    assert calls == [(rendezvous.resource.RLIMIT_NOFILE, (4200, 4200))]


def test_a_soft_limit_that_fits_already_is_left_alone(monkeypatch):
    calls = _limits(monkeypatch, 8192, 65536)
    rendezvous._room_for_connections(_env(0, 2048, 1), "node0")
    calls_unlimited = _limits(monkeypatch, rendezvous.resource.RLIM_INFINITY, rendezvous.resource.RLIM_INFINITY)
    rendezvous._room_for_connections(_env(0, 2048, 1), "node0")
    assert calls == [] and calls_unlimited == []


def test_a_hard_limit_too_low_for_the_job_fails_rank_0_at_once_saying_so(monkeypatch, port):
    _limits(monkeypatch, 1024, 4096)
    started = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError) as err:
        rendezvous.join(_env(0, 2048, port), timeout_s=30, host="hpcn1")
    assert time.monotonic() - started < 5
    assert "rank 0 on hpcn1 may open at most 4096 files" in err.value.message
    assert "needs 4096 connections for 2048 ranks" in err.value.message
    assert "nofile" in err.value.hint
    assert not port_in_use(port)  # it said so before listening


def test_other_ranks_leave_their_limits_alone(monkeypatch, port):
    calls = _limits(monkeypatch, 64, 64)
    with pytest.raises(rendezvous.RendezvousError, match="could not reach rank 0"):
        rendezvous.join(_env(1, 2048, port), timeout_s=0.5)
    assert calls == []
