"""GroupCommitter: batching, one write per key per batch, per-write errors, bounds, close."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
from support.waiting import wait_until

from blobha.core.errors import Unavailable
from blobha.master.groupcommit import GroupCommitter, Later


class Recorder:
    """A handler that records its batches and, while ``gate`` is clear, blocks in the first
    one, so the test can queue writes behind it."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = fail or set()

    def __call__(self, batch: Sequence[str]) -> list[str | BaseException]:
        self.batches.append(list(batch))
        self.entered.set()
        assert self.gate.wait(10)
        return [ValueError(f"refused {k}") if k in self.fail else f"done {k}" for k in batch]


def committer(handler: Recorder, **kw: object) -> GroupCommitter[str, str]:
    return GroupCommitter(handler, key=lambda item: item.split("#")[0], **kw)  # type: ignore[arg-type]


def queue_behind_first(gc: GroupCommitter[str, str], rec: Recorder, first: str,
                       more: list[str]) -> tuple[Future[str], list[Future[str]]]:
    head = gc.submit_async(first)
    assert rec.entered.wait(10)
    return head, [gc.submit_async(item) for item in more]


def test_writes_that_arrive_during_a_commit_go_together_in_the_next() -> None:
    rec = Recorder()
    gc = committer(rec)
    head, rest = queue_behind_first(gc, rec, "a", ["b", "c", "d", "e"])
    rec.gate.set()
    assert head.result(10) == "done a"
    assert [f.result(10) for f in rest] == ["done b", "done c", "done d", "done e"]
    assert rec.batches == [["a"], ["b", "c", "d", "e"]]
    gc.close(5)


def test_a_key_is_never_twice_in_one_batch_and_keeps_its_order() -> None:
    rec = Recorder()
    gc = committer(rec)
    head, rest = queue_behind_first(gc, rec, "x", ["k#1", "k#2", "m", "k#3"])
    rec.gate.set()
    assert [f.result(10) for f in rest] == ["done k#1", "done k#2", "done m", "done k#3"]
    assert head.result(10) == "done x"
    assert rec.batches == [["x"], ["k#1", "m"], ["k#2"], ["k#3"]]
    gc.close(5)


def test_each_write_gets_its_own_error_and_the_others_their_results() -> None:
    rec = Recorder(fail={"bad"})
    gc = committer(rec)
    head, (good, bad, other) = queue_behind_first(gc, rec, "a", ["good", "bad", "other"])
    rec.gate.set()
    assert good.result(10) == "done good"
    assert other.result(10) == "done other"
    with pytest.raises(ValueError, match="refused bad"):
        bad.result(10)
    head.result(10)
    gc.close(5)


def test_a_failing_handler_fails_its_batch_and_the_committer_carries_on() -> None:
    calls: list[list[str]] = []

    def handler(batch: Sequence[str]) -> list[str | BaseException]:
        calls.append(list(batch))
        if "boom" in batch:
            raise OSError("disk on fire")
        return [f"ok {k}" for k in batch]

    gc: GroupCommitter[str, str] = GroupCommitter(handler, key=lambda k: k)
    with pytest.raises(OSError, match="disk on fire"):
        gc.submit("boom")
    assert gc.submit("after") == "ok after"
    gc.close(5)


def test_a_handler_giving_the_wrong_number_of_results_fails_the_batch() -> None:
    gc: GroupCommitter[str, str] = GroupCommitter(lambda batch: [], key=lambda k: k)
    with pytest.raises(RuntimeError, match="0 results for 1 items"):
        gc.submit("a")
    gc.close(5)


def test_batches_are_bounded_by_count_and_by_weight() -> None:
    rec = Recorder()
    gc = committer(rec, max_batch=3)
    head, rest = queue_behind_first(gc, rec, "0", [str(i) for i in range(1, 8)])
    rec.gate.set()
    for f in [head, *rest]:
        f.result(10)
    assert rec.batches == [["0"], ["1", "2", "3"], ["4", "5", "6"], ["7"]]
    gc.close(5)

    rec = Recorder()
    # Weight: the length of the item; at most 5 per batch, a heavier item alone.
    gc = GroupCommitter(rec, key=lambda item: item, weight=len, max_weight=5)
    head, rest = queue_behind_first(gc, rec, "z", ["aa", "bb", "cc", "dddddddd", "e"])
    rec.gate.set()
    for f in [head, *rest]:
        f.result(10)
    assert rec.batches == [["z"], ["aa", "bb"], ["cc"], ["dddddddd"], ["e"]]
    gc.close(5)


def test_close_commits_what_is_queued_then_refuses_new_writes() -> None:
    rec = Recorder()
    gc = committer(rec)
    head, rest = queue_behind_first(gc, rec, "a", ["b", "c"])
    closer = threading.Thread(target=gc.close, args=(10,))
    closer.start()
    wait_until(lambda: gc._closed, timeout=10, what="the committer to start closing")
    with pytest.raises(Unavailable, match="stopping"):
        gc.submit("late")
    rec.gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert [f.result(0) for f in [head, *rest]] == ["done a", "done b", "done c"]


class BusyKey:
    """A handler for which key 'busy' is locked elsewhere until ``free`` is set: its first
    write gets Later (ready once free), and every write it commits is recorded in order."""

    def __init__(self) -> None:
        self.free = threading.Event()
        self.deferred = 0
        self.committed: list[str] = []

    def __call__(self, batch: Sequence[str]) -> list[str | BaseException | Later]:
        out: list[str | BaseException | Later] = []
        for item in batch:
            if item.startswith("busy") and not self.free.is_set():
                self.deferred += 1
                out.append(Later(self._wait_free))
            else:
                self.committed.append(item)
                out.append(f"done {item}")
        return out

    def _wait_free(self) -> None:
        if not self.free.wait(10):
            raise Unavailable("the key stayed busy; retry")


def test_a_write_whose_key_is_busy_waits_off_the_queue_and_keeps_its_keys_order() -> None:
    handler = BusyKey()
    gc = GroupCommitter(handler, key=lambda item: item.split("#")[0])
    first = gc.submit_async("busy#1")
    wait_until(lambda: handler.deferred == 1, timeout=10, what="the busy key's write deferred")
    second = gc.submit_async("busy#2")  # behind the first: must not overtake it
    assert gc.submit_async("other").result(10) == "done other"
    assert not first.done() and not second.done() and handler.deferred == 1
    handler.free.set()
    assert [first.result(10), second.result(10)] == ["done busy#1", "done busy#2"]
    assert handler.committed == ["other", "busy#1", "busy#2"]
    gc.close(5)


def test_a_deferred_write_gets_its_wait_error_and_close_fails_what_waits_behind_it() -> None:
    gate = threading.Event()

    def never_free() -> None:
        gate.wait(10)
        raise Unavailable("the key stayed busy; retry")

    gc: GroupCommitter[str, str] = GroupCommitter(
        lambda batch: [Later(never_free) for _ in batch], key=lambda item: item.split("#")[0])
    first = gc.submit_async("busy#1")
    wait_until(lambda: "busy" in gc._later, timeout=10, what="the write deferred")
    behind = gc.submit_async("busy#2")
    gc.close(10)
    with pytest.raises(Unavailable, match="stopping"):
        behind.result(10)
    gate.set()
    with pytest.raises(Unavailable, match="stayed busy"):
        first.result(10)
