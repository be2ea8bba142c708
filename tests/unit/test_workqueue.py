"""The synchroniser's keyed work queue: batches, exclusivity, re-queueing while running."""

from __future__ import annotations

import threading

from blobha.sync.workqueue import WorkQueue


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
