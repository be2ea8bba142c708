"""The synchroniser's keyed work queue: batches, exclusivity, re-queueing while running."""

from __future__ import annotations

import threading
import time

import pytest
from support.waiting import wait_until

from blobha.sync import workqueue
from blobha.sync.workqueue import HURRIED_LINGER, WorkQueue


def test_get_batch_takes_up_to_the_limit_in_order() -> None:
    q = WorkQueue()
    q.put_many(["a", "b", "c", "d"])
    assert q.get_batch(3) == ["a", "b", "c"]
    assert q.get_batch(3) == ["d"]


def test_a_key_being_handled_is_not_handed_out_again_until_done() -> None:
    q = WorkQueue()
    q.put_many(["a", "b"])
    assert q.get_batch(10) == ["a", "b"]
    q.put("a")  # an event while a worker has it: runs once more afterwards
    q.put("c")
    assert q.get_batch(10) == ["c"]
    q.done_many(["a", "b"])
    assert q.get_batch(10) == ["a"]


def test_get_batch_returns_empty_once_closed() -> None:
    q = WorkQueue()
    got: list[list[str]] = []
    t = threading.Thread(target=lambda: got.append(q.get_batch(5)))
    t.start()
    q.close()
    t.join(timeout=5)
    assert not t.is_alive() and got == [[]]


def test_delayed_keys_join_a_batch_when_due() -> None:
    q = WorkQueue()
    q.put("later", delay=0.05)
    q.put("now")
    assert q.get_batch(10) == ["now"]
    # Blocks until the delayed key is due (bounded by the test timeout, no sleep needed).
    assert q.get_batch(10) == ["later"]


def _get_in_thread(q: WorkQueue, limit: int) -> tuple[threading.Thread, list[list[str]]]:
    got: list[list[str]] = []
    t = threading.Thread(target=lambda: got.append(q.get_batch(limit)), daemon=True)
    t.start()
    return t, got


def _assert_goes_at_once(q: WorkQueue, key: str) -> None:
    """``key``, put now, is handed out at once: were it held for a long linger, the join
    would give up first."""
    q.put(key)
    t, got = _get_in_thread(q, 10)
    t.join(timeout=10)
    assert not t.is_alive() and got == [[key]]


def _handling_a(linger: float) -> WorkQueue:
    """A queue one of whose workers is handling key "a" (and goes on doing so)."""
    q = WorkQueue(linger=linger)
    q.put("a")
    assert q.get_batch(10) == ["a"]
    return q


def test_a_key_goes_at_once_when_no_batch_is_being_handled() -> None:
    # A lone write replicates as soon as without the linger: were it held, the call would
    # block for the whole minute and the join below would give up.
    q = WorkQueue(linger=60.0)
    _assert_goes_at_once(q, "a")


def test_while_a_batch_is_handled_a_new_key_waits_out_the_linger() -> None:
    q = _handling_a(linger=0.3)
    q.put("b")
    started = time.monotonic()
    assert q.get_batch(10) == ["b"]
    # It waited for company while "a" ran, but no longer than the linger from its arrival.
    assert time.monotonic() - started >= 0.3 - 0.01


def test_keys_arriving_meanwhile_join_the_held_batch() -> None:
    q = _handling_a(linger=0.3)
    q.put("b")
    t, got = _get_in_thread(q, 10)
    q.put("c")  # within b's linger: the two go together, whichever came first to the worker
    t.join(timeout=10)
    assert got == [["b", "c"]]


def test_a_held_key_goes_as_soon_as_the_running_batch_ends() -> None:
    q = _handling_a(linger=60.0)
    q.put("b")
    t, got = _get_in_thread(q, 10)
    q.done_many(["a"])  # nothing is handled any more: no reason left to wait
    t.join(timeout=10)
    assert not t.is_alive() and got == [["b"]]


def test_a_full_batch_is_not_held() -> None:
    q = _handling_a(linger=60.0)
    q.put_many(["b", "c", "d"])
    t, got = _get_in_thread(q, 2)
    t.join(timeout=10)
    assert not t.is_alive() and got == [["b", "c"]]


def test_keys_joining_a_held_batch_do_not_wake_its_worker_until_it_is_full() -> None:
    q = _handling_a(linger=60.0)
    q.put("b")
    t, got = _get_in_thread(q, 3)
    _wait_holding(q)
    wakes = []
    real_notify = q._cond.notify

    def counting_notify(n: int = 1) -> None:
        wakes.append(n)
        real_notify(n)

    q._cond.notify = counting_notify  # type: ignore[method-assign]
    q.put("c")  # joins the held batch: waking the worker would change nothing
    assert wakes == []
    q.put("d")  # the batch is full now: it goes at once, not after the minute
    t.join(timeout=10)
    assert wakes == [1] and not t.is_alive() and got == [["b", "c", "d"]]


def _wait_holding(q: WorkQueue) -> None:
    def holding() -> bool:
        with q._cond:
            return q._holding > 0

    wait_until(holding, 10, "the worker to hold its batch", interval=0.005)


def test_a_hurried_queue_holds_a_batch_no_longer_than_the_hurried_linger() -> None:
    q = _handling_a(linger=60.0)
    q.hurry(60.0)
    q.put("b")
    started = time.monotonic()
    t, got = _get_in_thread(q, 10)
    t.join(timeout=10)  # held for the minute, the join would give up
    assert not t.is_alive() and got == [["b"]]
    assert time.monotonic() - started >= HURRIED_LINGER - 0.01  # still a short hold


def test_hurry_lets_a_batch_held_now_go() -> None:
    q = _handling_a(linger=60.0)
    q.put("b")
    t, got = _get_in_thread(q, 10)
    q.hurry(60.0)  # "b" waits for the minute's hold; a writer waits for its copy
    t.join(timeout=10)
    assert not t.is_alive() and got == [["b"]]


def test_holds_come_back_when_the_hurry_ends() -> None:
    q = _handling_a(linger=0.3)
    q.hurry(0.0)  # over at once
    q.put("b")
    started = time.monotonic()
    assert q.get_batch(10) == ["b"]
    assert time.monotonic() - started >= 0.3 - 0.01


def _after_a_batch_of(keys: list[str], linger: float) -> WorkQueue:
    """A queue idle again after one batch of ``keys`` went through a worker."""
    q = WorkQueue(linger=linger)
    q.put_many(keys)
    assert q.get_batch(10) == keys
    q.done_many(keys)
    return q


def test_right_after_a_batch_with_company_a_key_waits_for_the_stream() -> None:
    # One client creating key after key: the last batch had company and just ended, so the
    # next key waits out the linger for the keys behind it.
    _assert_the_next_key_waits_for_company(_after_a_batch_of(["a", "b"], linger=0.3), 0.3)


def _assert_the_next_key_waits_for_company(q: WorkQueue, linger: float) -> None:
    q.put("c")
    started = time.monotonic()
    t, got = _get_in_thread(q, 10)
    q.put("d")
    t.join(timeout=10)
    assert got == [["c", "d"]]
    assert time.monotonic() - started >= linger - 0.01


def _one_arriving_during_the_other(q: WorkQueue, running: str, arriving: str) -> None:
    """``arriving`` comes while ``running`` is handled, and goes alone once that ends."""
    q.put(arriving)
    q.done_many([running])
    assert q.get_batch(10) == [arriving]


def test_one_key_that_arrived_while_another_batch_ran_shows_no_stream() -> None:
    # It may be a lone write that came just as the batch before finished: the next key goes
    # at once (held, the join below would give up long before the minute).
    q = _handling_a(linger=60.0)
    _one_arriving_during_the_other(q, "a", "b")
    q.done_many(["b"])
    _assert_goes_at_once(q, "c")


def test_two_batches_in_a_row_with_keys_that_arrived_while_another_ran_show_a_stream() -> None:
    # The trickle's usual case: each key came while its predecessor was replicated, then went
    # alone. The keys behind them wait for company.
    q = _handling_a(linger=0.3)
    _one_arriving_during_the_other(q, "a", "b")
    _one_arriving_during_the_other(q, "b", "y")
    q.done_many(["y"])
    _assert_the_next_key_waits_for_company(q, 0.3)


def test_right_after_a_lone_batch_a_key_goes_at_once() -> None:
    # A client that waits for each write's copies before the next: no company ever comes.
    q = _after_a_batch_of(["a"], linger=60.0)
    _assert_goes_at_once(q, "b")


def test_once_the_stream_has_paused_for_the_linger_a_key_goes_at_once(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    q = _after_a_batch_of(["a", "b"], linger=60.0)
    real = time.monotonic
    # The clock moves past the linger since that batch ended, without the test waiting.
    monkeypatch.setattr(workqueue.time, "monotonic", lambda: real() + 61.0)
    _assert_goes_at_once(q, "c")


def test_batches_and_their_keys_are_counted() -> None:
    q = WorkQueue()
    q.put_many(["a", "b", "c"])
    assert q.get_batch(2) == ["a", "b"]
    assert q.get_batch(2) == ["c"]
    assert (q.batches, q.batched_keys) == (2, 3)


def test_a_negative_linger_is_refused() -> None:
    with pytest.raises(ValueError, match="linger"):
        WorkQueue(linger=-1.0)
