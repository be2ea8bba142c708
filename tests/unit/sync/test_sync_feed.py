"""The change feed (blobha.sync.feed) on its own: ZooKeeper's events below /blobstore become
queued keys and holder changes in the replica view, with no read where none is needed; the
change journal is followed by followers only."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from kazoo.protocol.states import EventType, KazooState, WatchedEvent
from support.sync_fakes import ME, SESSION, A, B, FakeZk, Guard, settings

from blobha.sync.feed import ChangeFeed, Wake
from blobha.sync.view import Entry, ReplicaView, holders_of
from blobha.sync.workqueue import WorkQueue
from blobha.zk.layout import JOURNAL, JournalRecord


@dataclass
class Feed:
    feed: ChangeFeed
    view: ReplicaView
    queue: WorkQueue
    zk: FakeZk

    def hold(self, key: str, holders: list[str], acked: bool = True) -> None:
        """Give ``key`` an entry at v5 (three copies wanted), registered in this session."""
        with self.view.lock:
            self.view.put(key, Entry(b"", 0, 5, 3, acked,
                                     holders_of([f"{h}-5" for h in holders], 5), SESSION))

    def holders(self, key: str) -> tuple[str, ...]:
        # The entry itself: its record's bytes are empty here, so KeyView would not decode.
        return self.view.entries[key].holders


def make(leader: bool | list[bool] = False, recursive: bool = True) -> Feed:
    """A change feed of master ME among ME, A and B; ``leader`` as a one-element list can be
    changed while it runs."""
    zk = FakeZk()
    membership = SimpleNamespace(known=lambda: {ME, A, B}, live=lambda: {ME, A, B},
                                 holding=lambda: frozenset({ME, A, B}))
    view = ReplicaView(ME, membership)  # type: ignore[arg-type]
    queue = WorkQueue()
    leading = leader if isinstance(leader, list) else [leader]
    feed = ChangeFeed(zk, SimpleNamespace(), ME, membership, settings(recursive),  # type: ignore[arg-type]
                      view, queue, Guard(leading), Wake())
    return Feed(feed, view, queue, zk)


def tree_event(kind: str, path: str) -> WatchedEvent:
    return WatchedEvent(kind, KazooState.CONNECTED, path)


# ---- the recursive watch on /blobstore ------------------------------------------------------


def test_with_the_recursive_watch_a_key_node_event_queues_the_key() -> None:
    f = make()
    for kind in (EventType.CREATED, EventType.CHANGED, EventType.DELETED):
        f.feed.on_tree(tree_event(kind, "/blobstore/k"))
        assert f.queue.get_batch(10) == ["k"]
        f.queue.done_many(["k"])
    # Nothing read: the worker's reconcile reads the key.
    assert f.zk.watched_reads == [] and f.zk.data_reads == []


def test_the_leader_passes_over_the_creation_of_its_own_keys() -> None:
    # Its commit queues the key itself; a second reconcile would cost two more reads.
    f = make(leader=True)
    f.feed.on_tree(tree_event(EventType.CREATED, "/blobstore/k"))
    assert f.queue.depth() == 0
    f.feed.on_tree(tree_event(EventType.CHANGED, "/blobstore/k"))  # others still count
    assert f.queue.depth() == 1


def test_a_replica_event_changes_the_holders_without_a_read() -> None:
    f = make()
    f.hold("k", [ME])
    f.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{A}-5"))
    assert f.holders("k") == (ME, A)
    f.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{B}-5"))
    assert f.holders("k") == (ME, A, B)
    f.feed.on_tree(tree_event(EventType.DELETED, f"/blobstore/k/{A}-5"))
    assert f.holders("k") == (ME, B)
    # Another version's nodes, deeper paths and changes of a node's data are not holders.
    f.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{A}-4"))
    f.feed.on_tree(tree_event(EventType.CHANGED, f"/blobstore/k/{A}-5"))
    f.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{A}-5/x"))
    assert f.holders("k") == (ME, B)
    assert f.zk.watched_reads == [] and f.zk.data_reads == [] and f.queue.depth() == 0


def test_a_replica_event_moves_the_figures() -> None:
    f = make()
    f.hold("k", [ME, A])
    assert f.view.figures() == (1, 1, 0)
    f.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{B}-5"))
    assert f.view.figures() == (1, 0, 0)  # no longer under-replicated


@pytest.mark.parametrize("case", [
    "leader, unacknowledged",
    "our copy lost",
])
def test_a_replica_event_that_leaves_this_master_work_queues_the_key(case: str) -> None:
    f = make(leader=case.startswith("leader"))
    if case == "our copy lost":
        f.hold("k", [ME, A])
        f.feed.on_tree(tree_event(EventType.DELETED, f"/blobstore/k/{ME}-5"))
    else:
        f.hold("k", [ME], acked=False)
        f.feed.on_tree(tree_event(EventType.CREATED, f"/blobstore/k/{A}-5"))
    assert f.queue.depth() == 1 and f.zk.watched_reads == []


def test_a_leader_stepping_down_lists_the_keys_once() -> None:
    # Events of keys the next leader created may have come while this master still led.
    f = make(leader=[False])
    f.feed.stepped_down()
    assert f.queue.get_batch(10) == [""]  # the listing
    assert f.zk.data_reads == []  # the journal plays no part


# ---- the change journal (without the recursive watch) ---------------------------------------


def test_a_leader_leaves_the_journal_unwatched_and_follows_it_again_once_deposed() -> None:
    leading = [True]
    f = make(leader=leading, recursive=False)
    f.zk.data[JOURNAL] = (JournalRecord(7, ("a", "b")).encode(), SimpleNamespace(mzxid=70))
    journal_event = WatchedEvent(EventType.CHANGED, KazooState.CONNECTED, JOURNAL)
    # The leader's own commit changed the journal: nothing is read, no watch re-armed.
    f.feed.on_journal(journal_event)
    assert f.zk.data_reads == []
    leading[0] = False
    f.feed.stepped_down()
    # One read, re-arming the watch; its record is taken as any follower takes it.
    assert f.zk.data_reads == [(JOURNAL, f.feed.on_journal)]
    assert f.feed.journal_seen == 7
    f.feed.stepped_down()  # already followed: nothing more
    assert len(f.zk.data_reads) == 1
    # As a follower, every change of the journal is read at once.
    f.feed.on_journal(journal_event)
    assert f.zk.data_reads == [(JOURNAL, f.feed.on_journal)] * 2


def test_a_step_down_with_the_journal_watch_armed_reads_nothing() -> None:
    f = make(leader=[False], recursive=False)
    f.feed.stepped_down()
    assert f.zk.data_reads == []
