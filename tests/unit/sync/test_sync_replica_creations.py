"""A key the leader's commit creates, a key whose creation a follower saw, and whether the
view holds every change announced (what an outage may serve)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.protocol.states import EventType, KazooState, WatchedEvent
from support.sync_fakes import (
    ME,
    SESSION,
    A,
    Answer,
    B,
    FakeZk,
)
from support.sync_replicas import (
    committed,
    entry,
    synchroniser,
    tree_event,
)

from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.sync.synchronizer import Synchronizer


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
