"""The bounded history of leadership terms a master has seen."""

from __future__ import annotations

from blobha.leader import LeaderHistory
from blobha.zk.layout import EpochRecord


def test_terms_are_newest_first_and_the_first_one_is_not_a_change() -> None:
    h = LeaderHistory()
    assert h.current is None and h.terms() == [] and h.changes == 0
    h.observe(4, "m1:6627", at=100.0)
    h.observe(5, "m2:6627", at=110.0)
    h.observe(7, "m3:6627", at=120.0)
    assert [(t.epoch, t.leader, t.observed_at, t.at_start) for t in h.terms()] == [
        (7, "m3:6627", 120.0, False), (5, "m2:6627", 110.0, False), (4, "m1:6627", 100.0, True),
    ]
    assert h.changes == 2
    assert h.current is not None and h.current.epoch == 7


def test_repeats_older_epochs_and_the_empty_epoch_are_ignored() -> None:
    h = LeaderHistory()
    h.observe(0, "")  # /epoch before any election
    h.observe(3, "a:1")
    h.observe(3, "a:1")  # a DataWatch firing again after a reconnect
    h.observe(2, "b:1")  # late, out of order
    assert [t.epoch for t in h.terms()] == [3] and h.changes == 0


def test_history_is_bounded_but_keeps_counting() -> None:
    h = LeaderHistory(max_terms=3)
    for epoch in range(1, 11):
        h.observe(epoch, f"m{epoch}:1")
    assert [t.epoch for t in h.terms()] == [10, 9, 8]
    assert h.changes == 9


def test_epoch_znode_data_is_decoded_and_garbage_ignored() -> None:
    h = LeaderHistory()
    h._on_epoch(EpochRecord(6, "m:1").encode(), None)
    h._on_epoch(b"not json", None)
    h._on_epoch(b'{"epoch": "x"}', None)
    h._on_epoch(None, None)  # the znode does not exist (yet)
    assert [(t.epoch, t.leader) for t in h.terms()] == [(6, "m:1")]
