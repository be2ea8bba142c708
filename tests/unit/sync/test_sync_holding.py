"""Persistent replica nodes that count only for masters under /holders: the check a master
makes of its own nodes before they count, the counting itself, and a new leader's pass."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss, NoNodeError
from support.sync_fakes import Answer
from support.sync_replicas import Intake, periodic_loop
from support.waiting import wait_until

from blobha.core.blobstate import BlobState
from blobha.sync import verify
from blobha.sync.decide import counted
from blobha.sync.feed import Wake
from blobha.sync.membership import Membership
from blobha.sync.verify import own_nodes_to_remove
from blobha.sync.view import Entry, ReplicaView, holders_of, pack
from blobha.sync.workqueue import WorkQueue
from blobha.zk.layout import HOLDERS, MASTERS

ME, A, B = "m1:6627", "m2:6627", "m3:6627"
SESSION = 77


def state(seq: int = 5, acked: bool = True) -> BlobState:
    return BlobState(seq=seq, size=1, digest="d" * 32, acl=(), replication_factor=3,
                     creator="alice", created_at=1.0, updated_at=1.0, epoch=1, acked=acked)


def view(holding: frozenset[str]) -> ReplicaView:
    return ReplicaView(ME, SimpleNamespace(known=lambda: {ME, A, B},  # type: ignore[arg-type]
                                         holding=lambda: holding))


def put(v: ReplicaView, key: str, holders: tuple[str, ...], acked: bool = True) -> None:
    s = state(acked=acked)
    with v.lock:
        v.put(key, Entry.of(pack(s.encode()), 0, s, holders_of([f"{h}-5" for h in holders], 5),
                            SESSION))


# ---- the check of a master's own nodes ---------------------------------------------------------

def test_only_this_masters_nodes_of_versions_it_lacks_are_removed() -> None:
    held = {("a", 5), ("b", 2)}
    doomed = own_nodes_to_remove(
        ME, ["a", "b", "c", "gone"],
        [[f"{ME}-5", f"{A}-5", f"{ME}-4"],  # v4 is not on the disk: its node goes
         [f"{ME}-2", f"{B}-2"],  # all there
         [f"{A}-1", f"{B}-1", f"{ME}-1"],  # a wiped disk: nothing of c
         NoNodeError()],  # deleted meanwhile, with its nodes
        lambda key, seq: (key, seq) in held)
    assert doomed == [f"/blobstore/a/{ME}-4", f"/blobstore/c/{ME}-1"]


def test_a_failed_read_fails_the_check_rather_than_skipping_the_key() -> None:
    # A key whose list could not be read might hold a false node: the check is tried again
    # whole, and the master does not count until it passed.
    with pytest.raises(ConnectionLoss):
        own_nodes_to_remove(ME, ["a"], [ConnectionLoss()], lambda key, seq: False)


# ---- counting ----------------------------------------------------------------------------------

def test_only_the_nodes_of_holding_masters_count() -> None:
    holders = (ME, A, B)
    assert counted(holders, frozenset({ME, A, B})) is holders  # the common case: no new tuple
    assert counted(holders, frozenset({ME, B})) == (ME, B)
    assert counted(holders, frozenset()) == ()


def test_a_dead_masters_nodes_stop_counting_in_the_figures_and_the_views() -> None:
    holding = {ME, A, B}
    v = ReplicaView(ME, SimpleNamespace(known=lambda: {ME, A, B},  # type: ignore[arg-type]
                                        holding=lambda: frozenset(holding)))
    for i in range(50):
        put(v, f"k{i}", (ME, A, B))
    put(v, "two", (ME, A))
    assert v.figures()[:2] == (51, 1)
    view_of = v.view("k1")
    assert view_of is not None and view_of.holders == (ME, A, B)
    holding.discard(B)  # B's session ended: one node, not one per key
    assert v.figures()[:2] == (51, 51)
    view_of = v.view("k1")
    assert view_of is not None and view_of.holders == (ME, A)
    assert all(kv.holders == (ME, A) for kv in v.views().values())


def test_a_node_of_ours_read_after_the_check_stands_as_registered_in_the_session() -> None:
    v = view(frozenset({ME, A, B}))
    s = state()
    data = s.encode()
    # Before the check of this session: not taken as registered (the worker registers it).
    _, registered, _ = v.read_stored("k", s, data, 0, (ME, A), SESSION, from_events=False)
    assert registered == 0
    v.checked_session = SESSION
    _, registered, _ = v.read_stored("k2", s, data, 0, (ME, A), SESSION, from_events=False)
    assert registered == SESSION
    # Not ours in the list: nothing registered, whatever the check.
    _, registered, _ = v.read_stored("k3", s, data, 0, (A, B), SESSION, from_events=False)
    assert registered == 0


def test_keys_a_new_leader_looks_at_first() -> None:
    v = view(frozenset({ME, A, B}))
    put(v, "done", (ME, A, B))
    put(v, "unacked", (ME,), acked=False)
    put(v, "announced", (ME, A, B))
    v.heard("announced")
    v.heard("new")  # created: announced, not read yet
    assert v.tally.unsettled() == ["unacked", "announced", "new"]


# ---- the membership's holders ------------------------------------------------------------------

class _Zk:
    def __init__(self) -> None:
        self.children = {MASTERS: [ME, A, B], HOLDERS: [ME, A, B]}
        self.client_id = (SESSION, b"")
        self.created: list[tuple[str, bool]] = []

    def get_children_async(self, path: str, watch: Any = None) -> Answer:
        return Answer(list(self.children[path]))

    def create(self, path: str, data: bytes = b"", ephemeral: bool = False,
               makepath: bool = False) -> None:
        self.created.append((path, ephemeral))


def test_holding_follows_the_holders_nodes_and_each_change_is_announced() -> None:
    zk = _Zk()
    changes: list[None] = []
    m = Membership(zk, ME, grace_secs=30, on_change=lambda: changes.append(None),  # type: ignore[arg-type]
                   info={})
    m.refresh()
    assert m.holding() == {ME, A, B} and len(changes) == 1
    zk.children[HOLDERS] = [ME, A]  # B's session ended; its membership too, a moment later
    m.refresh()
    assert m.holding() == {ME, A} and m.live() == {ME, A, B} and len(changes) == 2
    m.hold()
    assert zk.created == [(f"{HOLDERS}/{ME}", True)]


# ---- a new leader's pass -----------------------------------------------------------------------

def test_a_new_leader_queues_the_unsettled_keys_at_once_and_paces_the_rest() -> None:
    # In key order, a pass paced at 200 keys a second reaches k2000 after 10 s; the new
    # leader's pass hands it out at once, and the others only later.
    keys = [f"k{i:04d}" for i in range(3000)]
    wake = Wake()
    loop = periodic_loop(3600.0, Intake(lambda: list(keys), recursive=True), wake=wake)
    for key in keys:
        put(loop.view, key, (ME, A, B), acked=key != "k2000")
    queue: WorkQueue = loop.queue
    taken: list[str] = []

    def take() -> None:
        while queue.depth():
            batch = queue.get_batch(len(keys))
            queue.done_many(batch)
            taken.extend(batch)

    thread = threading.Thread(target=loop.periodic, daemon=True)
    thread.start()
    try:
        # The loop's first look queues every key (the placement it acts on is new to it).
        wait_until(lambda: queue.depth() >= len(keys), timeout=10, what="the first look")
        take()
        taken.clear()
        wake.ask_leader_pass()
        wait_until(lambda: (take(), "k2000" in taken)[1], timeout=2,
                   what="the unacknowledged key handed out")
        assert len(taken) < len(keys) / 2
    finally:
        loop.stop()
        thread.join(5)


class _Txn:
    def __init__(self, zk: _RemovingZk) -> None:
        self.zk, self.paths = zk, []

    def delete(self, path: str) -> None:
        self.paths.append(path)

    def commit(self) -> list[bool]:
        self.zk.removed.extend(self.paths)
        if len(self.zk.removed) >= self.zk.stop_after:
            self.zk.stopping.set()
        return [True] * len(self.paths)


class _RemovingZk:
    def __init__(self, stop_after: int = 10**9) -> None:
        self.removed: list[str] = []
        self.stop_after = stop_after
        self.stopping = _Pauses()

    def transaction(self) -> _Txn:
        return _Txn(self)


class _Pauses(threading.Event):
    """A stop event whose waits are recorded, not waited."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(round(timeout or 0.0, 6))
        return self.is_set()


def test_a_wiped_masters_removals_are_paced(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each removal reaches every other master as an event, on the connection of its commits:
    # 1,000 nodes at 10,000 a second, in transactions of 200, go over 0.1 s, not at once.
    monkeypatch.setattr(verify.time, "monotonic", lambda: 100.0)  # no time passes by itself
    zk = _RemovingZk()
    paths = [f"/blobstore/k{i}/{ME}-1" for i in range(1000)]
    verify._remove(zk, paths, zk.stopping)  # type: ignore[arg-type]
    assert zk.removed == paths
    assert zk.stopping.waits == [0.02, 0.04, 0.06, 0.08]


def test_a_master_stopping_during_its_removals_does_not_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify.time, "monotonic", lambda: 100.0)
    zk = _RemovingZk(stop_after=400)
    paths = [f"/blobstore/k{i}/{ME}-1" for i in range(1000)]
    with pytest.raises(verify.CheckInterrupted, match="400 of 1000"):
        verify._remove(zk, paths, zk.stopping)  # type: ignore[arg-type]
    assert len(zk.removed) == 400
