"""The watch that cancels silent streams (blobha.stallwatch), with stand-in calls."""

from __future__ import annotations

import threading

from waiting import wait_until

from blobha.stallwatch import StallWatch


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
