"""What a master does when a key's replica list changes: a reconcile only where it has work on
the key, otherwise one more read that re-arms the watch while the key is under-replicated. And
what it does when masters come and go: re-read the lists a departed master was on, and
reconcile only the keys whose placement moves."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss, NodeExistsError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import EventType, KazooState, WatchedEvent
from support.sync_fakes import (
    ME,
    PATH,
    SESSION,
    A,
    Answer,
    B,
    FakeZk,
    Guard,
    NoDuties,
    settings,
)

from blobha.core import placement
from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.core.errors import BlobError
from blobha.store.local import LocalStore
from blobha.sync.feed import Wake
from blobha.sync.loop import SyncLoop
from blobha.sync.membership import Membership
from blobha.sync.settings import UNREACHABLE_REPORT_SECS
from blobha.sync.synchronizer import SyncDeferred, Synchronizer
from blobha.sync.view import Entry, ReplicaView, holders_of
from blobha.sync.workqueue import WorkQueue
from blobha.zk.layout import replica_path


def synchroniser(leader: bool | list[bool] = False, store: Any = None, recursive: bool = False,
                 ours: Any = True, key_lock: Any = None, membership: Any = None,
                 **changes: Any) -> tuple[Synchronizer, FakeZk]:
    """``leader`` as a one-element list can be changed while the synchroniser runs;
    ``recursive``: following /blobstore with the recursive watch; ``ours``: ZooKeeper holds
    this store's cluster (deletions allowed), or a function that tells; ``key_lock``: the
    store's per-key lock; ``changes``: other settings."""
    zk = FakeZk()
    leading = leader if isinstance(leader, list) else [leader]
    s = Synchronizer(
        zk, store=store or SimpleNamespace(), identity=ME, peers=SimpleNamespace(),  # type: ignore[arg-type]
        membership=membership or SimpleNamespace(known=lambda: {ME, A, B}, live=lambda: {ME, A, B}),
        settings=settings(recursive, **changes),
        duties=NoDuties(), guard=Guard(leading, ours, key_lock),
    )
    return s, zk


def entry(holders: list[str], registered: int = SESSION, acked: bool = True) -> Entry:
    return Entry(b"", 0, 5, 3, acked, holders_of([f"{h}-5" for h in holders], 5), registered)


def names(*holders: str) -> list[str]:
    return [f"{h}-5" for h in holders]


def test_a_holder_with_nothing_to_do_only_re_arms_the_watch() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME])
    zk.next_names = names(ME, A)
    s.feed.replicas_read("k", PATH, Answer(names(ME, A)))
    assert s.queue.depth() == 0
    assert zk.watched_reads == [(PATH, s.feed.watcher)]
    assert s.replicas.entries["k"].holders == (ME, A)


def test_a_change_between_the_two_reads_brings_a_reconcile() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME])
    zk.next_names = names(ME, A, B)  # the re-arming read already sees the third copy
    s.feed.replicas_read("k", PATH, Answer(names(ME, A)))
    assert s.queue.depth() == 1


def test_a_fully_replicated_key_is_left_alone() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME, A])
    s.feed.replicas_read("k", PATH, Answer(names(ME, A, B)))
    assert s.queue.depth() == 0 and zk.watched_reads == []


@pytest.mark.parametrize("case", [
    "leader, unacknowledged",
    "copy not registered in this session",
    "chosen holder lacking the version",
    "unknown key",
    "our copy lost",
])
def test_where_this_master_has_work_the_key_is_reconciled(case: str) -> None:
    s, zk = synchroniser(leader=case.startswith("leader"))
    if case == "leader, unacknowledged":
        s.replicas.entries["k"] = entry([ME], acked=False)
        listed = names(ME, A)
    elif case == "copy not registered in this session":
        s.replicas.entries["k"] = entry([ME], registered=SESSION - 1)
        listed = names(ME, A)
    elif case == "chosen holder lacking the version":
        s.replicas.entries["k"] = entry([A], registered=0)
        listed = names(A, B)
    elif case == "our copy lost":
        s.replicas.entries["k"] = entry([ME, A])
        listed = names(A)
    else:
        listed = names(A)
    s.feed.replicas_read("k", PATH, Answer(listed))
    assert s.queue.depth() == 1
    assert zk.watched_reads == []


@pytest.mark.parametrize("in_the_way", ["gone by itself", "an earlier session's"])
def test_a_registration_that_finds_another_sessions_node_ends_with_its_own(
        in_the_way: str) -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([A], registered=0)
    path = replica_path("k", ME, 5)
    created: list[str] = []
    owners = [None if in_the_way == "gone by itself" else SimpleNamespace(ephemeralOwner=5)]

    def create(path: str, value: bytes = b"", ephemeral: bool = False) -> str:
        created.append(path)
        if len(created) == 1:  # the earlier session's node is still there
            raise NodeExistsError()
        return path

    zk.create = create  # type: ignore[attr-defined]
    zk.exists = lambda path: owners.pop(0)  # type: ignore[attr-defined]
    s.register_replica("k", 5)
    assert created == [path, path]
    assert zk.deleted == ([] if in_the_way == "gone by itself" else [path])
    assert s.replicas.entries["k"].registered == SESSION and ME in s.replicas.entries["k"].holders


def test_a_registration_that_keeps_losing_the_race_is_not_marked_done() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([A], registered=0)

    def create(path: str, value: bytes = b"", ephemeral: bool = False) -> str:
        raise NodeExistsError()

    zk.create = create  # type: ignore[attr-defined]
    zk.exists = lambda path: None  # type: ignore[attr-defined]
    with pytest.raises(NodeExistsError):
        s.register_replica("k", 5)
    assert s.replicas.entries["k"].registered == 0 and ME not in s.replicas.entries["k"].holders


def test_a_departure_re_reads_each_list_once_with_its_watch() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME, A, B])
    s.replicas.entries["steady"] = entry([ME, A])
    assert s.replicas.held_by({B}) == ["k"]
    zk.listed[PATH] = names(ME, A)  # B's replica node went with its session
    s.feed.recheck_replicas(["k"])
    # One read, which armed the watch: no second read to re-arm it, no reconcile.
    assert zk.watched_reads == [(PATH, s.feed.watcher)]
    assert s.replicas.entries["k"].holders == (ME, A)
    assert s.queue.depth() == 0
    assert s.figures()[1] == 2  # both keys now show as under-replicated


def test_a_departure_that_leaves_this_master_work_queues_the_key() -> None:
    s, zk = synchroniser(leader=True)
    s.replicas.entries["k"] = entry([A, B], acked=False)
    zk.listed[PATH] = names(A)
    s.feed.recheck_replicas(["k"])
    assert s.queue.depth() == 1


def test_only_keys_whose_placement_moves_are_reconciled_when_masters_change() -> None:
    s, _ = synchroniser()
    before, after = frozenset({ME, A, B}), frozenset({ME, A})
    for i in range(200):
        s.replicas.entries[f"three-{i}"] = Entry(b"", 0, 1, 3, True, (ME, A, B), SESSION)
        s.replicas.entries[f"one-{i}"] = Entry(b"", 0, 1, 1, True, (B,), SESSION)
    moved = set(s.replicas.placement_moved(before, after))
    # With three copies wanted, both remaining masters hold every key either way.
    assert not any(key.startswith("three-") for key in moved)
    # With one, the keys B held move to whichever of ME and A the placement now picks.
    expected = {f"one-{i}" for i in range(200)
                if placement.choose(f"one-{i}", before, 1) == [B]
                and placement.choose(f"one-{i}", after, 1) == [ME]}
    assert moved == expected and 0 < len(expected) < 200


def test_departures_are_reported_once_even_after_a_quick_return() -> None:
    listed = [{ME, A, B}, {ME, A}, {ME, A, B}]
    zk = SimpleNamespace(get_children_async=lambda path, watch=None: Answer(sorted(listed.pop(0))))
    changes: list[None] = []
    m = Membership(zk, ME, grace_secs=30, on_change=lambda: changes.append(None),  # type: ignore[arg-type]
                   info={})
    m.refresh()
    m.refresh()  # B's session ended
    m.refresh()  # B is back, with a new session, before anyone asked
    assert m.take_departed() == {B}
    assert m.take_departed() == set()
    assert m.known() == {ME, A, B} and len(changes) == 3


def test_each_departure_is_announced_before_the_change() -> None:
    # The master abandons its fetches from a master that left (Master._master_left) before
    # the synchroniser looks at the new membership.
    listed = [{ME, A, B}, {ME}, {ME}, {ME, A}]
    zk = SimpleNamespace(get_children_async=lambda path, watch=None: Answer(sorted(listed.pop(0))))
    events: list[str] = []
    m = Membership(zk, ME, grace_secs=30, on_change=lambda: events.append("change"),  # type: ignore[arg-type]
                   info={}, on_leave=events.append)
    for _ in range(4):
        m.refresh()
    assert events == ["change", A, B, "change", "change"]


def test_dropping_a_copy_beyond_the_placement_keeps_a_version_committed_meanwhile(
        tmp_path: Path) -> None:
    # The leader, not chosen for R=2, read v1 complete on the chosen two and drops its copy;
    # meanwhile its write path installed and committed v2 (an acknowledged write). Only v1
    # may go.
    store = LocalStore(tmp_path / "store")
    key = next(k for k in (f"k{i}" for i in range(100))
               if ME not in placement.choose(k, {ME, A, B}, 2))
    v1, v2 = b"one", b"two"
    for seq, data in ((1, v1), (2, v2)):
        store.install_many([(key, seq, data, len(data), digest_bytes(data))])
    s, zk = synchroniser(leader=True, store=store)
    state = BlobState(seq=1, size=len(v1), digest=digest_bytes(v1), acl=(), replication_factor=2,
                      creator="alice", created_at=0.0, updated_at=0.0, epoch=1, acked=True)
    listed = [f"{h}-1" for h in (ME, A, B)]
    assert s.executor.settle(key, state.encode(), SimpleNamespace(version=0), listed) is None
    assert store.versions(key) == [2]
    assert b"".join(store.read(key, 2)) == v2
    assert zk.deleted == [f"/blobstore/{key}/{ME}-1"]


def test_a_read_older_than_the_leaders_own_commit_deletes_nothing(tmp_path: Path) -> None:
    # The key was deleted and created again by this leader after the batch sent its read: the
    # read shows the old v1 (content A), the store holds the new, acknowledged v1 (B). Acting
    # on the read deleted B as "a version of an earlier incarnation" and B's replica node with
    # it, leaving the acknowledged write on no master.
    store = LocalStore(tmp_path / "store")
    old, new = b"AAAA", b"BBBB"
    s, zk = synchroniser(leader=True, store=store)
    read_mark = s.replicas.commits  # the batch sends its reads
    store.install_many([("k", 1, new, len(new), digest_bytes(new))])
    s.registered("k", 1, SESSION, 1)  # the re-create's commit, under the key's lock
    stale = BlobState(seq=1, size=len(old), digest=digest_bytes(old), acl=(),
                      replication_factor=1, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    assert s.executor.settle("k", stale.encode(), SimpleNamespace(version=3), [f"{ME}-1"],
                     read_mark=read_mark) is None
    assert b"".join(store.read("k", 1)) == new and zk.deleted == []
    assert s.queue.get_batch(10) == ["k"]  # looked at again, with a newer read

    # That newer read (sent after the commit) is acted on as usual, and the mark is spent.
    current = BlobState(seq=1, size=len(new), digest=digest_bytes(new), acl=(),
                        replication_factor=1, creator="alice", created_at=0.0, updated_at=0.0,
                        epoch=1, acked=True)
    assert s.executor.settle("k", current.encode(), SimpleNamespace(version=0), [f"{ME}-1"],
                     read_mark=s.replicas.commits) is None
    assert b"".join(store.read("k", 1)) == new and zk.deleted == [] and not s.replicas.commit_marks


@pytest.mark.parametrize("ours", [True, False])
def test_a_copy_that_differs_from_zookeepers_record_goes_only_if_zookeeper_is_ours(
        tmp_path: Path, ours: bool) -> None:
    store = LocalStore(tmp_path / "store")
    mine, recorded = b"MINE", b"THEIRS"
    store.install_many([("k", 1, mine, len(mine), digest_bytes(mine))])
    s, zk = synchroniser(store=store, ours=ours)
    state = BlobState(seq=1, size=len(recorded), digest=digest_bytes(recorded), acl=(),
                      replication_factor=3, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    outcome = s.executor.settle("k", state.encode(), SimpleNamespace(version=0), [f"{A}-1"])
    if ours:  # an earlier incarnation's copy: replaced by a fetch of the recorded one
        assert store.versions("k") == [] and outcome == (state, [A])
    else:  # a wiped or foreign ZooKeeper's record: our copy stays, and nothing is fetched
        assert b"".join(store.read("k", 1)) == mine and outcome is None
    assert zk.deleted == []


def test_a_fetch_is_not_installed_over_a_commit_made_while_it_ran(tmp_path: Path) -> None:
    # The reconcile decided to fetch the old key's v1 (A) from a master that still had it; the
    # key was deleted and created again here meanwhile (v1 = B, acknowledged, this master's
    # copy only). Installing A then replaced B.
    store = LocalStore(tmp_path / "store")
    old, new = b"AAAA", b"BBBB"
    s, _ = synchroniser(leader=True, store=store)
    read_mark = s.replicas.commits
    stale = BlobState(seq=1, size=len(old), digest=digest_bytes(old), acl=(),
                      replication_factor=3, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    store.install_many([("k", 1, new, len(new), digest_bytes(new))])
    s.registered("k", 1, SESSION, 1)
    other = replace(stale, seq=4)
    failures = s.fetcher.install_fetched([("k", stale, old), ("j", other, old)], read_mark)
    assert list(failures) == ["k"] and isinstance(failures["k"], SyncDeferred)
    assert b"".join(store.read("k", 1)) == new
    assert b"".join(store.read("j", 4)) == old  # the rest of the batch is installed


class Intake:
    """The change feed as the periodic thread sees it (blobha.sync.loop.Intake)."""

    def __init__(self, all_keys: Any, recursive: bool = False, watch_tree: Any = None) -> None:
        self.all_keys = all_keys
        self.recursive = recursive
        self.watch_tree = watch_tree or (lambda: None)

    def recheck_replicas(self, keys: list[str]) -> None:
        pass


def periodic_loop(period_secs: float, feed: Intake, zk: Any = None,
                  wake: Wake | None = None) -> SyncLoop:
    """A loop whose periodic thread can run: connected, alone, registered already."""
    membership = SimpleNamespace(next_grace_expiry=lambda: None, refresh=lambda: None,
                                 known=lambda: {ME}, take_departed=set)
    return SyncLoop(
        zk or SimpleNamespace(state=KazooState.CONNECTED, client_id=(SESSION, b"")),
        membership, settings(period_secs=period_secs), WorkQueue(),  # type: ignore[arg-type]
        ReplicaView(ME, membership), feed, SimpleNamespace(handle=lambda keys: {}),  # type: ignore[arg-type]
        wake or Wake(), session=SESSION)


def test_the_periodic_pass_keeps_running_when_there_are_no_keys() -> None:
    # With no key anywhere the pass hands out nothing; its next start used to be left at
    # infinity, and the periodic thread died on its next wait (Event.wait overflows).
    from support.waiting import wait_until

    passes: list[float] = []
    loop = periodic_loop(0.01, Intake(lambda: passes.append(0.0) or []))
    thread = threading.Thread(target=loop.periodic, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(passes) >= 5 or not thread.is_alive(), timeout=10,
                   what="periodic passes")
        assert thread.is_alive() and len(passes) >= 5
    finally:
        loop.stop()
        thread.join(5)


def child_event(path: str = PATH) -> WatchedEvent:
    return WatchedEvent(EventType.CHILD, KazooState.CONNECTED, path)


def test_a_registration_event_arms_the_watch_with_its_one_read_while_copies_are_still_due(
        ) -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME])  # one copy of three
    zk.next_names = names(ME, A)
    s.feed.on_event(child_event())
    # One more copy still leaves the key short: the read that follows the change arms the
    # watch itself, and nothing reads the list a second time to re-arm it.
    assert zk.watched_reads == [(PATH, s.feed.watcher)]
    assert s.replicas.entries["k"].holders == (ME, A) and s.queue.depth() == 0
    # The last copy due: a plain read, which finds the key complete and leaves it alone.
    zk.next_names = names(ME, A, B)
    s.feed.on_event(child_event())
    assert zk.watched_reads == [(PATH, s.feed.watcher), (PATH, None)]
    assert s.replicas.entries["k"].holders == (ME, A, B) and s.queue.depth() == 0


def test_a_last_copy_that_does_not_complete_the_key_still_re_arms_its_watch() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME, A])
    zk.next_names = names(ME, A)  # a change that was not a new copy (one went and came)
    s.feed.on_event(child_event())
    assert zk.watched_reads == [(PATH, None), (PATH, s.feed.watcher)]
    assert s.queue.depth() == 0


def test_a_copy_registered_during_the_batch_costs_no_second_reconcile() -> None:
    # This master fetched and registered the key; meanwhile another master registered its copy
    # too. The read that arms the watch sees it: the figures follow, and with nothing left to
    # do here the key is not reconciled again.
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME])
    zk.next_names = names(ME, A)
    failures: dict[str, Exception] = {}
    s.feed.watch_replicas(["k"], failures)
    assert zk.watched_reads == [(PATH, s.feed.watcher)]
    assert s.replicas.entries["k"].holders == (ME, A)
    assert s.queue.depth() == 0 and not failures


@pytest.mark.parametrize("case", ["our copy lost", "chosen holder lacking the version",
                                  "leader, unacknowledged"])
def test_a_change_during_the_batch_that_leaves_work_here_queues_the_key(case: str) -> None:
    s, zk = synchroniser(leader=case.startswith("leader"))
    if case == "our copy lost":
        s.replicas.entries["k"] = entry([ME], registered=SESSION)
        zk.next_names = names(A)  # our copy's node is gone
    elif case == "chosen holder lacking the version":
        s.replicas.entries["k"] = entry([A], registered=0)  # a fetch deferred: no source yet
        zk.next_names = names(A, B)
    else:
        s.replicas.entries["k"] = entry([ME], acked=False)
        zk.next_names = names(ME, A)  # enough copies, maybe, to acknowledge the write
    s.feed.watch_replicas(["k"], {})
    assert s.queue.depth() == 1


#: A key whose single copy the placement gives this master.
ONE_HERE = next(k for k in (f"k{i}" for i in range(100))
                if placement.choose(k, {ME, A, B}, 1) == [ME])


def committed(key: str = "new", rf: int = 3, recursive: bool = False
              ) -> tuple[Synchronizer, FakeZk, BlobState]:
    """A leader that just committed v1 of ``key`` (its own copy registered by the commit), and
    a ZooKeeper that answers the reconcile's reads of it."""
    data = b"fresh"
    state = BlobState(seq=1, size=len(data), digest=digest_bytes(data), acl=(),
                      replication_factor=rf, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    store = SimpleNamespace(
        info=lambda k, seq: SimpleNamespace(digest=state.digest, size=state.size),
        versions=lambda k: [1], has_version=lambda k, seq: True)
    s, zk = synchroniser(leader=True, store=store, recursive=recursive)
    zk.data[f"/blobstore/{key}"] = (state.encode(), SimpleNamespace(version=0))
    zk.listed[f"/blobstore/{key}"] = [f"{ME}-1"]
    s.registered(key, 1, SESSION, rf)
    return s, zk, state


def test_the_reconcile_after_a_commit_arms_the_replica_watch_with_its_first_read() -> None:
    s, zk, _ = committed()
    assert s.executor.handle(["new"]) == {}
    # One read of the list, which armed its watch; no second read to arm it.
    assert zk.watched_reads == [("/blobstore/new", s.feed.watcher)]
    assert s.replicas.entries["new"].holders == (ME,) and s.replicas.flight.arming == {}
    # Only the reconcile right after the commit: a later one reads the list plainly (and,
    # the key being under-replicated, arms the watch with a second read, as before).
    zk.watched_reads.clear()
    s.executor.handle(["new"])
    assert zk.watched_reads == [("/blobstore/new", None), ("/blobstore/new", s.feed.watcher)]


def test_a_copy_registered_between_the_armed_read_and_its_reconcile_is_read_again() -> None:
    # The armed read saw only the leader's copy; A registered before the reconcile stored
    # that. The event's read saw A, but the reconcile then stored the older list: another
    # read puts it right (no event would, the watch having fired already).
    s, zk, _ = committed()
    path = "/blobstore/new"
    read_list = zk.get_children_async

    def get_children_async(p: str, watch: Any = None) -> Answer:
        answer = read_list(p, watch)
        if len(zk.watched_reads) == 1:  # the armed read: A registers right after it
            zk.listed[p] = [f"{ME}-1", f"{A}-1"]
            s.feed.on_event(child_event(p))
        return answer

    zk.get_children_async = get_children_async  # type: ignore[method-assign]
    assert s.executor.handle(["new"]) == {}
    assert s.replicas.entries["new"].holders == (ME, A)
    # The armed read; the event's (plain: the key had no entry yet, so the event also queued
    # it for another reconcile); the re-read after this reconcile, which re-arms the watch.
    assert zk.watched_reads == [(path, s.feed.watcher), (path, None), (path, s.feed.watcher)]


def test_a_reconcile_long_after_the_commit_reads_the_list_plainly() -> None:
    # A backlog: by now every copy is likely in place, and a watch armed on a complete key
    # would stay there. The old path runs: a plain read, and no watch once complete.
    s, zk, _ = committed()
    s.replicas.flight.arm_on_read["new"] -= 10.0
    zk.listed["/blobstore/new"] = [f"{h}-1" for h in (ME, A, B)]
    assert s.executor.handle(["new"]) == {}
    assert zk.watched_reads == [("/blobstore/new", None)]


def test_a_commit_of_a_single_copy_arms_no_watch() -> None:
    s, zk, _ = committed(ONE_HERE, rf=1)
    assert s.executor.handle([ONE_HERE]) == {}
    assert zk.watched_reads == [(f"/blobstore/{ONE_HERE}", None)]


def test_a_key_deleted_before_its_reconcile_leaves_nothing_behind() -> None:
    s, zk, _ = committed()
    del zk.data["/blobstore/new"]  # deleted right after the commit
    assert s.executor.handle(["new"]) == {}
    flight = s.replicas.flight
    assert flight.arm_on_read == {} and flight.arming == {} and "new" not in s.replicas.entries


def test_an_unreachable_zookeeper_is_reported_now_and_then_not_per_key(
        caplog: pytest.LogCaptureFixture) -> None:
    # A ZooKeeper outage fails every key of every batch, retry after retry: one warning per
    # key and retry made 580,000 log lines in one outage of a minute at 100,000 keys.
    s, _ = synchroniser()
    keys = [f"k{i}" for i in range(500)]
    with caplog.at_level(logging.WARNING, logger="blobha.sync.synchronizer"):
        s.loop.after_batch(keys, dict.fromkeys(keys, ConnectionLoss()))
        s.loop.after_batch(keys[:10], dict.fromkeys(keys[:10], SessionExpiredError()))
        first = [r.getMessage() for r in caplog.records]
        s.loop.unreachable_reported -= UNREACHABLE_REPORT_SECS  # the interval has passed
        s.loop.after_batch(["k0"], {"k0": ConnectionLoss()})
        second = [r.getMessage() for r in caplog.records][len(first):]
        s.loop.after_batch(["other"], {"other": BlobError("disk full")})
        third = [r.getMessage() for r in caplog.records][len(first) + len(second):]
    assert len(first) == 1 and "500 key(s)" in first[0] and "(ConnectionLoss)" in first[0]
    # The ten failures within the interval come with the next report.
    assert len(second) == 1 and "11 key(s)" in second[0]
    # Every key is retried all the same, with its backoff counting each failure.
    failures = s.loop.failures
    assert failures["k0"] == 3 and failures["k9"] == 2 and failures["k499"] == 1
    # Other errors are still reported per key, with what went wrong.
    assert len(third) == 1 and "'other'" in third[0] and "disk full" in third[0]


# ---- the recursive watch on /blobstore (the change feed alone: test_sync_feed.py) -----------


def tree_event(kind: str, path: str) -> WatchedEvent:
    return WatchedEvent(kind, KazooState.CONNECTED, path)


def test_events_that_come_while_the_key_is_read_are_replayed_onto_what_the_read_found(
        ) -> None:
    # The read found the leader's copy alone; A and B registered (and A went again) while it
    # was on its way back. Their events met the old entry (or none), which the read's older
    # list then replaced: replayed, they leave what ZooKeeper holds now.
    s, zk, _ = committed(recursive=True)
    read_list = zk.get_children_async

    def get_children_async(p: str, watch: Any = None) -> Answer:
        answer = read_list(p, watch)
        for kind, holder in ((EventType.CREATED, A), (EventType.CREATED, B),
                             (EventType.DELETED, A)):
            s.feed.on_tree(tree_event(kind, f"{p}/{holder}-1"))
        return answer

    zk.get_children_async = get_children_async  # type: ignore[method-assign]
    assert s.executor.handle(["new"]) == {}
    assert s.replicas.entries["new"].holders == (ME, B)
    assert s.replicas.flight.reading == {}
    # Reads without watches: the recursive watch needs none.
    assert zk.watched_reads == [("/blobstore/new", None)]
    assert zk.data_reads == [("/blobstore/new", None)]


def test_a_change_replayed_after_the_read_that_leaves_work_queues_the_key() -> None:
    # The leader's unacknowledged W=2 write: A's copy registered during the read completes
    # the quorum, so the key goes back to a worker (the leader acknowledges it there).
    s, zk, state = committed(recursive=True)
    unacked = BlobState(**{**state.__dict__, "acked": False, "write_quorum": 2})
    zk.data["/blobstore/new"] = (unacked.encode(), SimpleNamespace(version=0))
    read_list = zk.get_children_async

    def get_children_async(p: str, watch: Any = None) -> Answer:
        answer = read_list(p, watch)
        s.feed.on_tree(tree_event(EventType.CREATED, f"{p}/{A}-1"))
        return answer

    zk.get_children_async = get_children_async  # type: ignore[method-assign]
    assert s.executor.handle(["new"]) == {}
    assert s.replicas.entries["new"].holders == (ME, A)
    assert s.queue.get_batch(10) == ["new"]


def test_a_multi_read_answered_short_fails_only_its_keys() -> None:
    s, zk, _ = committed(recursive=True)
    zk._call = lambda request, result: setattr(  # type: ignore[method-assign]
        result, "get", Answer([]).get)
    failures = s.executor.handle(["new"])
    assert list(failures) == ["new"] and "came back with 0 answers" in str(failures["new"])
    # A bad answer is not a refusal: the next batch asks the same way.
    assert s.executor.reader.multi_read


def test_a_server_that_refuses_multi_read_gets_one_read_per_request() -> None:
    from kazoo.exceptions import UnimplementedError

    s, zk, _ = committed(recursive=True)
    zk._call = lambda request, result: setattr(  # type: ignore[method-assign]
        result, "get", Answer(UnimplementedError()).get)
    assert s.executor.handle(["new"]) == {}
    assert not s.executor.reader.multi_read
    assert zk.data_reads == [("/blobstore/new", None)]  # read again, on its own


def test_with_the_recursive_watch_a_commit_arms_nothing() -> None:
    s, zk, _ = committed(recursive=True)
    assert s.replicas.flight.arm_on_read == {}
    assert s.executor.handle(["new"]) == {}
    assert zk.watched_reads == [("/blobstore/new", None)]


def test_with_the_recursive_watch_departures_read_no_list() -> None:
    # Each of the departed master's replica nodes is deleted with its session, and each
    # deletion comes as an event.
    s, _ = synchroniser(recursive=True)
    s.replicas.entries["k"] = entry([ME, A, B])
    assert s.loop.follow_membership(frozenset({ME, A, B}), frozenset({ME, A, B}), {B}) == []
    s_old, _ = synchroniser()
    s_old.replicas.entries["k"] = entry([ME, A, B])
    assert s_old.loop.follow_membership(frozenset({ME, A, B}), frozenset({ME, A, B}), {B}) == ["k"]


def test_the_recursive_watch_falls_back_to_the_journal_when_zookeeper_refuses_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kazoo.exceptions import NoAuthError, UnimplementedError

    from blobha.sync import feed as feed_module

    answers: list[Exception] = [ConnectionLoss(), NoAuthError(), UnimplementedError()]

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise answers.pop(0)

    monkeypatch.setattr(feed_module, "add_recursive_watch", refuse)
    s, zk = synchroniser(recursive=True)
    with pytest.raises(ConnectionLoss):  # not the server's answer: tried again
        s.feed.watch_tree()
    with pytest.raises(NoAuthError):  # nor any answer but "unimplemented"
        s.feed.watch_tree()
    assert s.feed.recursive
    with caplog.at_level(logging.WARNING):
        s.feed.watch_tree()
    assert not s.feed.recursive
    assert "ZooKeeper 3.6 or later" in caplog.text
    # From now on reads arm the one-shot watches, and a full reconcile reads the journal.
    zk.data[PATH] = NoNodeError()
    s.executor.reader.read_many(["k"], set())
    assert zk.data_reads == [(PATH, s.feed.watcher)]


def test_a_copy_registered_while_this_master_fetches_the_key_sends_it_round_no_more() -> None:
    # A follower that lacks the key has work on it, so outside a batch a new holder queues
    # it (that may be the source it waited for). While a worker has the key, the event only
    # marks it, and the batch's end decides: here the follower registered its own copy by
    # then, and nothing is left to do.
    s, zk = synchroniser(recursive=True)
    s.replicas.entries["k"] = entry([A], registered=0)
    s.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{B}-5"))
    assert s.queue.get_batch(10) == ["k"]
    s.queue.done_many(["k"])
    s.replicas.entries["k"] = entry([A], registered=0)
    s.replicas.flight.batch_moved["k"] = False  # a worker's batch has the key
    s.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{B}-5"))
    assert s.queue.depth() == 0 and s.replicas.flight.batch_moved["k"]
    s.replicas.registered("k", 5, SESSION)  # the batch installed and registered its copy
    s.executor.act_on_moved(["k"])
    assert s.queue.depth() == 0
    assert s.replicas.entries["k"].holders == (ME, A, B) and zk.watched_reads == []


def test_a_reconnect_while_the_watch_is_added_brings_another_full_pass() -> None:
    # The watch went to a connection that dropped right after: the reconnect's request for a
    # full pass must survive the pass under way, so that the next one adds the watch again.
    from support.waiting import wait_until

    s, _ = synchroniser(recursive=True)  # its change feed tells the reconnect
    steps: list[str] = []

    def watch_tree() -> None:
        steps.append("watch")
        if len(steps) == 1:
            s.feed.on_state(KazooState.CONNECTED)  # the connection dropped and came back

    loop = periodic_loop(3600, Intake(lambda: steps.append("list") or [], recursive=True,
                                      watch_tree=watch_tree), wake=s.wake)
    s.wake.full_requested = True
    thread = threading.Thread(target=loop.periodic, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(steps) >= 4 or not thread.is_alive(), timeout=10,
                   what="two full passes")
        # Each pass adds the watch before it lists anything.
        assert steps[:4] == ["watch", "list", "watch", "list"]
    finally:
        loop.stop()
        thread.join(5)


def test_replayed_events_the_read_already_saw_change_nothing() -> None:
    # The read's answer already holds A's registration and B's go-and-come-back; their
    # events, replayed onto it, leave it as it is.
    s, zk, _ = committed(recursive=True)
    zk.listed["/blobstore/new"] = [f"{ME}-1", f"{A}-1", f"{B}-1"]
    read_list = zk.get_children_async

    def get_children_async(p: str, watch: Any = None) -> Answer:
        for kind, holder in ((EventType.CREATED, A), (EventType.DELETED, B),
                             (EventType.CREATED, B)):
            s.feed.on_tree(tree_event(kind, f"{p}/{holder}-1"))
        return read_list(p, watch)

    zk.get_children_async = get_children_async  # type: ignore[method-assign]
    assert s.executor.handle(["new"]) == {}
    assert s.replicas.entries["new"].holders == (ME, A, B)
    flight = s.replicas.flight
    assert s.queue.depth() == 0 and flight.batch_moved == {} and flight.reading == {}


def test_a_version_above_the_committed_one_is_judged_again_under_the_key_lock(
    tmp_path: Any,
) -> None:
    # The worker read the key at v5 and saw "not leading" during a blip of the leader's own
    # connection; meanwhile the still-leading master committed v6 (under the key's lock). Judged
    # on the v5 read, v6 looked like debris and was deleted, though committed.
    store = LocalStore(tmp_path / "s")
    store.install_many([("k", 6, b"new", 3, digest_bytes(b"new"))])
    s, zk = synchroniser(leader=False, store=store, key_lock=store.key_lock)

    def committed(seq: int) -> Any:
        state = BlobState(seq=seq, size=3, digest=digest_bytes(b"new"), acl=(),
                          replication_factor=3, creator="alice", created_at=0.0,
                          updated_at=0.0, epoch=1, acked=True)
        return lambda path: (state.encode(), SimpleNamespace(version=1))

    zk.get = committed(6)  # type: ignore[attr-defined]
    s.executor.prune("k", 5)
    assert store.versions("k") == [6]
    # Still above the committed version once the lock is held: debris, removed.
    zk.get = committed(5)  # type: ignore[attr-defined]
    s.executor.prune("k", 5)
    assert store.versions("k") == []


def test_a_delete_refused_for_the_cluster_identity_waits_a_full_grace_afterwards(
    tmp_path: Any,
) -> None:
    # ZooKeeper wiped, then restored in stages (the cluster's identity first, the keys after):
    # a key not back yet was deleted at once, on a grace counted from the wipe.
    store = LocalStore(tmp_path / "s")
    store.install_many([("k", 1, b"x", 1, digest_bytes(b"x"))])
    identity_back = [False]
    s, zk = synchroniser(store=store, key_lock=store.key_lock, ours=lambda: identity_back[0],
                         delete_grace_secs=0.2)
    zk.exists = lambda path: None  # type: ignore[attr-defined]
    now = [100.0]
    s.executor.clock = lambda: now[0]
    s.executor.key_gone("k")  # found gone (the wipe): its grace starts
    assert store.versions("k") == [1] and s.queue.depth() == 1
    now[0] += 0.25  # the grace passes while ZooKeeper holds no cluster identity
    s.executor.key_gone("k")
    assert store.versions("k") == [1]
    identity_back[0] = True
    s.executor.key_gone("k")
    assert store.versions("k") == [1]  # its grace starts now


def test_a_copy_fetched_across_a_delete_is_not_registered() -> None:
    # The batch read the key, then fetched it; meanwhile the key was deleted and created
    # again at the same version number. The copy was of the deleted key, and its replica node
    # (created after the re-create) counted it as a holder of the new version, which a
    # replication wait then trusted.
    s, _ = synchroniser(recursive=True)
    old = BlobState(seq=1, size=4, digest=digest_bytes(b"OLD!"), acl=(), replication_factor=3,
                    creator="alice", created_at=1.0, updated_at=1.0, epoch=1, acked=True)
    registered: list[tuple[str, int]] = []
    s.executor.reader.read_many = lambda keys, armed, listless: {"k": (old, (A,)), "j": (old, (A,))}  # type: ignore[method-assign,assignment,return-value]
    s.executor.settle = lambda key, state, holders, **_: (state, list(holders))  # type: ignore[method-assign,assignment,misc]

    def fetch_all(to_fetch: Any, failures: Any, read_mark: int) -> Any:
        s.feed.on_tree(tree_event(EventType.DELETED, "/blobstore/k"))  # during the fetch
        return [], [("k", 1), ("j", 1)], set()

    s.fetcher.fetch_all = fetch_all  # type: ignore[method-assign]
    s.registry.register_many = lambda items: registered.extend(items) or {}  # type: ignore[method-assign,func-returns-value]
    s.executor.prune = lambda key, seq: None  # type: ignore[method-assign]
    failures = s.executor.reconcile(["k", "j"], set(), {})
    assert registered == [("j", 1)]
    assert isinstance(failures["k"], SyncDeferred) and "j" not in failures
    assert s.queue.get_batch(10) == ["k"]  # the deletion's event sends it round again
    assert not s.replicas.flight.deleted_in_batch  # nothing kept past the batch


def test_a_deletion_seen_only_once_the_copy_was_registered_takes_the_registration_back() -> None:
    # The delete and the re-create reached ZooKeeper before the registration did, but their
    # events arrived after _drop_deleted looked: the node just created is removed again.
    s, zk = synchroniser(recursive=True)
    old = BlobState(seq=1, size=4, digest=digest_bytes(b"OLD!"), acl=(), replication_factor=3,
                    creator="alice", created_at=1.0, updated_at=1.0, epoch=1, acked=True)
    s.executor.reader.read_many = lambda keys, armed, listless: {"k": (old, (A,)), "j": (old, (A,))}  # type: ignore[method-assign,assignment,return-value]
    s.executor.settle = lambda key, state, holders, **_: (state, list(holders))  # type: ignore[method-assign,assignment,misc]
    s.fetcher.fetch_all = lambda to_fetch, failures, read_mark: ([], [("k", 1), ("j", 1)], set())  # type: ignore[method-assign,assignment,return-value]

    def register_many(items: list[tuple[str, int]]) -> dict[str, Exception]:
        s.feed.on_tree(tree_event(EventType.DELETED, "/blobstore/k"))  # before the answers
        return {}

    s.registry.register_many = register_many  # type: ignore[method-assign]
    s.executor.prune = lambda key, seq: None  # type: ignore[method-assign]
    failures = s.executor.reconcile(["k", "j"], set(), {})
    assert zk.deleted == [f"/blobstore/k/{ME}-1"]
    assert isinstance(failures["k"], SyncDeferred) and "j" not in failures


def test_a_full_pass_that_fails_during_a_paced_pass_neither_ends_the_thread_nor_is_forgotten(
        ) -> None:
    # A reconnect asks for a full pass while the paced safety-net pass is being handed out
    # (its next start is then infinite); the full pass's listing fails as the connection drops
    # again, and kazoo is still reconnecting a second later. The thread used to die on its next
    # wait (Event.wait(inf) overflows), and nothing re-registered or reconciled after that.
    import threading

    from kazoo.exceptions import ConnectionLoss
    from support.waiting import wait_until

    class Connection:
        """kazoo's state, counting how often the thread looked at it while disconnected."""

        def __init__(self) -> None:
            self.up = True
            self.looks_while_down = 0

        @property
        def state(self) -> str:
            if not self.up:
                self.looks_while_down += 1
            return KazooState.CONNECTED if self.up else KazooState.SUSPENDED

        client_id = (SESSION, b"")

    zk = Connection()
    listings: list[str] = []

    def all_keys() -> list[str]:
        if len(listings) == 1:  # the reconnect's full pass
            listings.append("failed")
            zk.up = False
            raise ConnectionLoss()
        listings.append("listed")
        return [f"k{i}" for i in range(10_000)]  # paced out over about 50 s

    wake = Wake()
    loop = periodic_loop(0.01, Intake(all_keys), zk=zk, wake=wake)
    thread = threading.Thread(target=loop.periodic, daemon=True)
    thread.start()
    try:
        wait_until(lambda: listings == ["listed"], timeout=10, what="the paced pass begun")
        wake.ask_full()  # what Synchronizer.request_full_reconcile asks
        wait_until(lambda: len(listings) == 2, timeout=10, what="the full pass tried")
        # Past the 1 s pause after the failure, the connection still down: the thread looks
        # again and again (every period), where it used to die at its second look.
        wait_until(lambda: zk.looks_while_down >= 5 or not thread.is_alive(), timeout=10,
                   what="the thread looking at the connection")
        assert thread.is_alive()
        zk.up = True
        # The failed full pass is made again once connected, without another request.
        wait_until(lambda: len(listings) >= 3 or not thread.is_alive(), timeout=10,
                   what="the full pass made again")
        assert thread.is_alive() and listings[:3] == ["listed", "failed", "listed"]
    finally:
        loop.stop()
        thread.join(5)


def test_concurrent_status_checks_share_one_pass_over_the_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each pass looks at every key, and under writes the view has moved at every call.
    # Callers that arrive while a pass runs wait for it and then share one pass that began
    # after they asked: its answer is as of a moment during their call, so nothing they could
    # expect to see is missing.
    from support.waiting import wait_until

    s, _ = synchroniser()
    s.replicas.entries["k"] = entry([A, B])
    s.replicas.entries["k2"] = entry([A])
    passes: list[int] = []
    first_inside = threading.Event()
    release = threading.Event()
    real_count = s.replicas.count

    def count(entries: list[tuple[str, Any]], known: frozenset[str]) -> tuple[int, int]:
        passes.append(len(passes))
        if len(passes) == 1:
            first_inside.set()
            assert release.wait(30)
        return real_count(entries, known)

    monkeypatch.setattr(s.replicas, "count", count)

    class CountingLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.waiting = 0

        def __enter__(self) -> None:
            self.waiting += 1
            self.lock.acquire()
            self.waiting -= 1

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    gate = CountingLock()
    s.replicas.figures_lock = gate  # type: ignore[assignment]
    results: dict[str, tuple[int, int, int]] = {}

    def ask(name: str) -> None:
        results[name] = s.figures()

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert first_inside.wait(30)
    with s.replicas.lock:  # a write lands while the first pass runs
        s.replicas.entries["k3"] = entry([A, B])
        s.replicas.generation += 1
    later = [threading.Thread(target=ask, args=(f"later-{i}",)) for i in range(3)]
    for t in later:
        t.start()
    wait_until(lambda: gate.waiting == 3, what="the later callers to wait for the pass")
    release.set()
    for t in (first, *later):
        t.join(30)
    # The first pass, then one more for all three later callers, which all see the write.
    assert len(passes) == 2
    assert results["first"] == (2, 2, 2)
    assert all(results[f"later-{i}"] == (3, 3, 3) for i in range(3))


def test_a_status_pass_hashes_only_the_keys_whose_placement_it_has_not_decided(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Where there are more masters than copies, a key this master lacks needs the placement's
    # hash to tell whether it should hold it; under writes every status check is a new pass,
    # and each hashed every such key again (0.2 s at 100,000 keys on five masters).
    from blobha.sync import view as view_mod

    c, d = "10.0.0.4:6627", "10.0.0.5:6627"
    known = {ME, A, B, c, d}
    s, _ = synchroniser(membership=SimpleNamespace(known=lambda: known, live=lambda: known))
    real_chosen = view_mod.chosen
    hashed: list[str] = []

    def chosen(me: str, key: str, rf: int, masters: Any) -> bool:
        hashed.append(key)
        return real_chosen(me, key, rf, masters)

    monkeypatch.setattr(view_mod, "chosen", chosen)

    def put(key: str, holders: list[str], rf: int = 3) -> None:
        with s.replicas.lock:
            s.replicas.entries[key] = Entry(b"", 0, 5, rf, True,
                                            holders_of([f"{h}-5" for h in holders], 5), SESSION)
            s.replicas.generation += 1

    def expected() -> tuple[int, int, int]:
        view = list(s.replicas.entries.items())
        return (len(view), sum(len(e.holders) < e.rf for _, e in view),
                sum(ME not in e.holders and ME in placement.choose(k, known, e.rf)
                    for k, e in view))

    for i in range(60):
        put(f"k{i}", [A, B])  # lacking here: about 60% of them are placed here
    put("mine", [ME, A, B])
    assert s.figures() == expected() and sorted(hashed) == sorted(f"k{i}" for i in range(60))
    assert 0 < expected()[2] < 60
    hashed.clear()
    put("new", [A, B])
    assert s.figures() == expected() and hashed == ["new"]
    hashed.clear()
    put("k1", [A], rf=1)  # its factor changed: decided again
    assert s.figures() == expected() and hashed == ["k1"]
    hashed.clear()
    known = {ME, A, B, c}  # the membership changed: every key lacking here is decided again
    s.replicas.generation += 1
    assert s.figures() == expected() and len(hashed) == 61
    hashed.clear()
    with s.replicas.lock:  # a deleted key's decision goes with it
        del s.replicas.entries["new"]
        s.replicas.generation += 1
    assert s.figures() == expected() and hashed == [] and "new" not in s.replicas.placed()


# ---- a key the leader's commit creates ------------------------------------------------------


def _new_key(rf: int = 3) -> BlobState:
    data = b"fresh"
    return BlobState(seq=1, size=len(data), digest=digest_bytes(data), acl=(),
                     replication_factor=rf, creator="alice", created_at=0.0, updated_at=0.0,
                     epoch=1, acked=True)


def test_a_key_created_by_the_leaders_commit_gets_its_entry_from_the_commit() -> None:
    # No reconcile reads back what the commit wrote (two reads per create); the copies
    # registered while the commit's answer was on its way are replayed onto the entry.
    s, zk = synchroniser(leader=True, recursive=True)
    state = _new_key()
    s.creating(["new"])
    for kind, holder in ((EventType.CREATED, ME), (EventType.CREATED, A)):
        s.feed.on_tree(tree_event(kind, f"/blobstore/new/{holder}-1"))
    s.registered("new", 1, SESSION, 3, state, state.encode())
    s.created(["new"])
    s.follow("new", 1)
    view = s.view("new")
    assert view is not None and view.state.seq == 1 and view.state.digest == state.digest
    assert view.holders == (ME, A) and s.replicas.entries["new"].registered == SESSION
    assert s.queue.depth() == 0 and s.replicas.flight.born == {} and s.replicas.made_here == {}
    assert s.replicas.commit_marks == {}  # no batch was reading it: nothing left to guard
    assert zk.data_reads == [] and zk.watched_reads == []
    # Later registrations reach the entry as for any key.
    s.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/new/{B}-1"))
    assert s.replicas.entries["new"].holders == (ME, A, B)


@pytest.mark.parametrize("case", ["update", "not announced", "known already", "one-shot",
                                  "reconnected meanwhile"])
def test_any_other_commit_is_followed_by_a_reconcile(case: str) -> None:
    s, _ = synchroniser(leader=True, recursive=case != "one-shot")
    state = _new_key()
    if case == "known already":
        s.replicas.entries["new"] = entry([ME])
    if case != "not announced":
        s.creating(["new"])
    if case == "reconnected meanwhile":
        s.feed.on_state(KazooState.SUSPENDED)  # events of the commit's time may be lost
    made = None if case == "update" else state
    s.registered("new", 1, SESSION, 3, made, state.encode())
    s.created(["new"])
    s.follow("new", 1)
    assert s.queue.get_batch(10) == ["new"]
    assert s.replicas.flight.born == {} and s.replicas.made_here == {}


def test_a_commit_that_fails_leaves_nothing_held() -> None:
    s, _ = synchroniser(leader=True, recursive=True)
    s.creating(["new"])
    s.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/new/{A}-1"))
    s.created(["new"])  # never registered: the commit failed
    assert s.replicas.flight.born == {} and "new" not in s.replicas.entries


# ---- a key whose creation a follower saw ----------------------------------------------------


def _follower_seeing_a_creation() -> tuple[Synchronizer, FakeZk, list[Any]]:
    """A follower (recursive watch) that saw key 'new' created by leader A (A's replica node
    in the same transaction), then B register a copy; its reconcile's fetches are recorded."""
    state = _new_key()
    store = SimpleNamespace(info=lambda k, seq: None, versions=lambda k: [],
                            has_version=lambda k, seq: False)
    s, zk = synchroniser(store=store, recursive=True)
    zk.data["/blobstore/new"] = (state.encode(), SimpleNamespace(version=0))
    fetched: list[Any] = []

    def fetch_all(to_fetch: Any, failures: Any, read_mark: int) -> Any:
        fetched.extend((key, tuple(holders)) for key, _, holders in to_fetch)
        return [], [], set()

    s.fetcher.fetch_all = fetch_all  # type: ignore[method-assign]
    s.registry.register_many = lambda items: {}  # type: ignore[method-assign]
    s.executor.prune = lambda key, seq: None  # type: ignore[method-assign]
    s.feed.on_tree(tree_event(EventType.CREATED, "/blobstore/new"))
    s.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/new/{A}-1"))
    s.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/new/{B}-1"))
    return s, zk, fetched


def test_a_follower_that_saw_a_key_created_reads_its_node_but_not_its_list() -> None:
    # The events since the creation are the whole list: one read per key instead of two.
    s, zk, fetched = _follower_seeing_a_creation()
    assert s.queue.get_batch(10) == ["new"]
    assert s.executor.handle(["new"]) == {}
    assert zk.data_reads == [("/blobstore/new", None)] and zk.watched_reads == []
    assert s.replicas.entries["new"].holders == (A, B) and fetched == [("new", (A, B))]
    assert s.replicas.flight.born == {} and s.replicas.flight.reading == {}
    # The next reconcile of the key reads its list as any other.
    s.executor.handle(["new"])
    assert zk.watched_reads == [("/blobstore/new", None)]


@pytest.mark.parametrize("case", ["reconnected", "deleted"])
def test_creation_events_are_trusted_only_while_nothing_could_be_missed(case: str) -> None:
    s, zk, _ = _follower_seeing_a_creation()
    if case == "reconnected":
        s.feed.on_state(KazooState.SUSPENDED)  # events may be lost until the next full pass
    else:
        s.feed.on_tree(tree_event(EventType.DELETED, "/blobstore/new"))
    assert s.replicas.flight.born == {}
    zk.listed["/blobstore/new"] = [f"{A}-1"]
    s.executor.handle(["new"])
    assert zk.watched_reads == [("/blobstore/new", None)]  # the list is read
    assert s.replicas.entries["new"].holders == (A,)


# ---- whether the view holds every change announced (what an outage may serve) -------------


@pytest.mark.parametrize("recursive", [True, False])
def test_an_announced_change_leaves_the_view_behind_until_a_read_sent_after_it_is_stored(
        recursive: bool) -> None:
    s, zk, _ = committed(recursive=recursive)
    assert s.executor.handle(["new"]) == {}
    view = s.view("new")
    assert view is not None and not view.behind
    changed = WatchedEvent(EventType.CHANGED, KazooState.CONNECTED, "/blobstore/new")
    (s.feed.on_tree if recursive else s.feed.on_event)(changed)
    view = s.view("new")
    assert view is not None and view.behind
    # A change announced while the read was on its way is not in what it found.
    read_data = zk.get_async

    def get_async(p: str, watch: Any = None) -> Answer:
        (s.feed.on_tree if recursive else s.feed.on_event)(changed)
        return read_data(p, watch)

    zk.get_async = get_async  # type: ignore[method-assign]
    s.executor.reader.multi_read = False  # reads through get_async
    assert s.executor.handle(["new"]) == {}
    view = s.view("new")
    assert view is not None and view.behind
    zk.get_async = read_data  # type: ignore[method-assign]
    assert s.executor.handle(["new"]) == {}
    view = s.view("new")
    assert view is not None and not view.behind


def test_a_reconnect_leaves_every_view_behind_until_it_is_read_again() -> None:
    s, _, _ = committed(recursive=True)
    assert s.executor.handle(["new"]) == {}
    s.feed.on_state(KazooState.SUSPENDED)
    view = s.view("new")
    assert view is not None and not view.behind  # cut off: what it last read stands
    s.feed.on_state(KazooState.CONNECTED)
    view = s.view("new")
    assert view is not None and view.behind  # changes while away were told to nobody
    assert s.keys_behind() == (1, 1)
    assert s.executor.handle(["new"]) == {}
    view = s.view("new")
    assert view is not None and not view.behind
    assert s.keys_behind() == (0, 0)
    s.feed.on_tree(WatchedEvent(EventType.CHANGED, KazooState.CONNECTED, "/blobstore/new"))
    assert s.keys_behind() == (1, 0)  # behind by a change as it comes, read since the reconnect
    s.replicas.forget("new")
    assert s.replicas.unread == {}
