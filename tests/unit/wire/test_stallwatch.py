"""The watch that cancels silent streams (blobha.wire.stallwatch), with stand-in calls."""

from __future__ import annotations

import threading
import time

from support.waiting import wait_until

from blobha.wire.stallwatch import TERM_CHECK_SECS, CallWatch, StallWatch


class _Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def test_cancel_ends_every_stream_of_its_tag_and_no_other() -> None:
    watch = StallWatch()
    try:
        gone = [_Call(), _Call()]
        kept = _Call()
        watched = [watch.watch(c, 60.0, "a:1") for c in gone]
        other = watch.watch(kept, 60.0, "b:1")
        assert watch.cancel("a:1", "a:1 left the cluster") == 2
        assert all(c.cancelled.is_set() for c in gone)
        assert all(w.fired and w.reason == "a:1 left the cluster" for w in watched)
        assert not kept.cancelled.is_set() and not other.fired
        assert watch.cancel("a:1", "again") == 0  # cancelled streams are no longer watched
    finally:
        watch.close()


def test_a_silent_stream_is_cancelled_without_a_reason_and_a_busy_one_is_not() -> None:
    watch = StallWatch()
    try:
        silent, busy = _Call(), _Call()
        w_silent = watch.watch(silent, 0.2, "a:1")
        w_busy = watch.watch(busy, 0.2, "a:1")
        w_busy.hold()  # the consumer is working on a message
        wait_until(silent.cancelled.is_set, 5, "the silent stream cancelled")
        assert w_silent.fired and w_silent.reason == ""
        w_busy.wait_again()
        assert not busy.cancelled.is_set()
    finally:
        watch.close()


class _Master:
    """Stands in for the status check and the channel close a :class:`CallWatch` is given."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.checked: list[str] = []
        self.waits: list[tuple[float, tuple[str, ...]]] = []
        self.cut: list[str] = []
        self.was_cut = threading.Event()

    def check(self, address: str, half: float, rivals: tuple[str, ...] = ()) -> bool:
        self.checked.append(address)
        self.waits.append((half, rivals))
        return self.answers

    def close(self, address: str) -> None:
        self.cut.append(address)
        self.was_cut.set()


def test_a_call_that_ends_within_half_its_limit_costs_no_check() -> None:
    master = _Master(answers=False)
    watch = CallWatch(master.check, master.close)
    try:
        for _ in range(100):
            watch.end(watch.begin("a:1", 0.5))
        # The thread ticks every eighth of a second while calls are made, then sleeps.
        wait_until(lambda: watch._idle, 5, "the watch asleep once calls stopped")
        assert master.checked == [] and master.cut == []
    finally:
        watch.close()


def test_a_master_that_fails_its_check_has_every_call_to_it_ended_and_no_other() -> None:
    master = _Master(answers=False)
    watch = CallWatch(master.check, master.close)
    try:
        quiet = [watch.begin("a:1", 0.1), watch.begin("a:1", 5.0)]
        other = watch.begin("b:1", 5.0)
        assert master.was_cut.wait(5), "the silent master's calls were ended"
        assert master.cut == ["a:1"] and master.checked == ["a:1"]
        assert all(p.fired for p in quiet)  # the longer limit's call too: the master is gone
        assert not other.fired
    finally:
        watch.close()


def test_a_master_that_answers_its_check_is_waited_for_and_checked_again() -> None:
    master = _Master(answers=True)
    watch = CallWatch(master.check, master.close)
    try:
        long_call = watch.begin("a:1", 0.1)
        wait_until(lambda: len(master.checked) >= 3, 5, "the call checked once per half limit")
        assert master.cut == [] and not long_call.fired
        watch.end(long_call)
        checks = len(master.checked)
        wait_until(lambda: watch._idle, 5, "the watch asleep once the call ended")
        assert len(master.checked) <= checks + 1  # at most one check already under way
    finally:
        watch.close()


def test_a_failing_check_is_no_verdict() -> None:
    class _Broken(_Master):
        def check(self, address: str, half: float, rivals: tuple[str, ...] = ()) -> bool:
            self.checked.append(address)
            raise ValueError("Cannot invoke RPC on closed channel!")

    master = _Broken(answers=False)
    watch = CallWatch(master.check, master.close)
    try:
        p = watch.begin("a:1", 0.1)
        wait_until(lambda: len(master.checked) >= 2, 5, "the call checked again")
        assert not p.fired and master.cut == []
    finally:
        watch.close()


def test_a_call_to_the_leader_is_looked_at_early_with_its_rivals_and_keeps_its_limit() -> None:
    master = _Master(answers=True)
    watch = CallWatch(master.check, master.close)
    try:
        started = time.monotonic()
        leader_call = watch.begin("a:1", 5.0, ("b:1", "c:1"))
        plain = watch.begin("b:1", 5.0)
        wait_until(lambda: master.checked, 4, "the leader call looked at")
        # After TERM_CHECK_SECS, not after half the stall limit (5 s).
        assert time.monotonic() - started < 2.5
        assert master.checked == ["a:1"]  # the other call, with no rivals, is not due yet
        # A silent leader with no successor is still given the whole stall limit (10 s).
        assert master.waits == [(10.0 - TERM_CHECK_SECS, ("b:1", "c:1"))]
        watch.end(leader_call)
        watch.end(plain)
    finally:
        watch.close()


def test_a_leader_call_ends_when_the_check_finds_a_successor() -> None:
    class _Deposed(_Master):
        def check(self, address: str, half: float, rivals: tuple[str, ...] = ()) -> bool:
            self.checked.append(address)
            return not rivals  # silent, and a rival leads

    master = _Deposed(answers=False)
    watch = CallWatch(master.check, master.close)
    try:
        p = watch.begin("a:1", 30.0, ("b:1",))
        assert master.was_cut.wait(5), "the deposed leader's call ended"
        assert p.fired and master.cut == ["a:1"]
    finally:
        watch.close()
