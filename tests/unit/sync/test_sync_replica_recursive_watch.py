"""The recursive watch on /blobstore (the change feed alone: test_sync_feed.py): events
replayed onto what a read found, multi reads, the fall-back to the journal, reconnects."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss, NoNodeError
from kazoo.protocol.states import EventType, KazooState
from support.sync_fakes import (
    ME,
    PATH,
    SESSION,
    A,
    Answer,
    B,
)
from support.sync_replicas import (
    Intake,
    committed,
    entry,
    periodic_loop,
    synchroniser,
    tree_event,
)

from blobha.core.blobstate import BlobState


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
