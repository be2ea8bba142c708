"""The change journal's record and the leader's ring of entries."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kazoo.exceptions import NoNodeError

from blobha.leader.journal import JOURNAL_ENTRIES, JOURNAL_MAX_BYTES, ChangeJournal
from blobha.zk.layout import JournalRecord


def test_since_returns_the_entries_after_the_one_seen() -> None:
    r = JournalRecord(10, ("a", "b", "c"))  # entries 8, 9, 10
    assert r.first == 8
    assert r.since(10) == ()
    assert r.since(9) == ("c",)
    assert r.since(7) == ("a", "b", "c")


def test_since_reports_a_gap_or_a_restart_as_none() -> None:
    r = JournalRecord(10, ("a", "b", "c"))
    assert r.since(6) is None  # entry 7 is gone from the record
    assert r.since(11) is None  # numbers went backwards: a new journal
    assert JournalRecord(0, ()).since(0) == ()


def test_decode_round_trips_and_refuses_garbage_as_empty() -> None:
    r = JournalRecord(5, ("k/1", "ünï"))
    assert JournalRecord.decode(r.encode()) == r
    for bad in (b"", b"nonsense", b"[1, 2]", b'{"last": "x", "keys": []}',
                b'{"last": 3, "keys": "abc"}', b'{"last": 3, "keys": [1]}'):
        assert JournalRecord.decode(bad) == JournalRecord(0, ())


class _FakeZk:
    def __init__(self, data: bytes | None) -> None:
        self.data = data
        self.gets = 0

    def get_async(self, path: str) -> Any:
        self.gets += 1
        data = self.data

        def answer(timeout: float | None = None) -> tuple[bytes, Any]:
            if data is None:
                raise NoNodeError()
            return data, None
        return SimpleNamespace(get=answer)


def test_a_new_term_continues_from_the_record_in_zookeeper() -> None:
    zk = _FakeZk(JournalRecord(41, ("x", "y")).encode())
    j = ChangeJournal(zk)  # type: ignore[arg-type]
    r = JournalRecord.decode(j.record_for(7, ["k1"]))
    assert r == JournalRecord(42, ("x", "y", "k1"))
    r = JournalRecord.decode(j.record_for(7, ["k2", "k3"]))
    assert r.last == 44 and r.keys[-2:] == ("k2", "k3")
    assert zk.gets == 1  # loaded once per term
    zk.data = JournalRecord(100, ("z",)).encode()  # written by another leader meanwhile
    assert JournalRecord.decode(j.record_for(8, ["k4"])).since(100) == ("k4",)
    fresh = ChangeJournal(_FakeZk(None))  # type: ignore[arg-type]
    assert JournalRecord.decode(fresh.record_for(1, ["a"])) == JournalRecord(1, ("a",))


def test_the_ring_is_bounded_in_entries_and_bytes() -> None:
    j = ChangeJournal(_FakeZk(None))  # type: ignore[arg-type]
    for i in range(JOURNAL_ENTRIES * 3):
        data = j.record_for(1, [f"key-{i}"])
    r = JournalRecord.decode(data)
    assert r.last == JOURNAL_ENTRIES * 3 and len(r.keys) == JOURNAL_ENTRIES
    assert r.keys[-1] == f"key-{JOURNAL_ENTRIES * 3 - 1}"
    for i in range(40):
        data = j.record_for(1, ["k" * 500 + str(i)])
    r = JournalRecord.decode(data)
    assert len(data) <= JOURNAL_MAX_BYTES + 600 and r.keys[-1].endswith("39")
    assert r.since(r.last - len(r.keys)) == r.keys


def test_the_byte_bound_counts_the_encoded_size_of_non_ascii_keys() -> None:
    j = ChangeJournal(_FakeZk(None))  # type: ignore[arg-type]
    key = "ü" * 200  # 400 bytes of UTF-8
    for i in range(100):
        data = j.record_for(1, [f"{key}{i}"])
    assert len(data) <= JOURNAL_MAX_BYTES + 450
    assert JournalRecord.decode(data).keys[-1] == f"{key}99"
