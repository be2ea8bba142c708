"""The replica watches: the periodic pass, registration events that re-arm the watch while
copies are still due, the watch a commit arms with its first read, and an unreachable
ZooKeeper reported now and then, not per key."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss, SessionExpiredError
from kazoo.protocol.states import EventType, KazooState, WatchedEvent
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
    names,
    periodic_loop,
    synchroniser,
)

from blobha.core import placement
from blobha.core.errors import BlobError
from blobha.sync.settings import UNREACHABLE_REPORT_SECS


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
