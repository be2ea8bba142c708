"""SessionRecord: the data directory's record of its master's ZooKeeper session."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from blobha.sync import SessionRecord


class Ender:
    def __init__(self, error: Exception | None = None) -> None:
        self.ended: list[tuple[int, bytes]] = []
        self.error = error

    def __call__(self, session: int, password: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.ended.append((session, password))


def test_a_saved_session_is_private_and_loads_back(tmp_path: Path) -> None:
    record = SessionRecord(tmp_path, Ender())
    record.save((0x1234, b"\x00secret\xff"))
    assert record.load() == (0x1234, b"\x00secret\xff")
    assert stat.S_IMODE(record.path.stat().st_mode) == 0o600, "it holds the session's password"
    assert [p.name for p in tmp_path.iterdir()] == ["zk-session"], "no temporary file left"


def test_a_missing_or_damaged_record_is_no_record(tmp_path: Path) -> None:
    record = SessionRecord(tmp_path, Ender())
    assert record.load() is None
    for text in ("", "{", '{"session": 1}', '{"session": 1, "password": "zz"}', "[]"):
        record.path.write_text(text)
        assert record.load() is None, text


def test_only_the_recorded_predecessors_session_is_ended(tmp_path: Path) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))  # the process before this one
    ender = Ender()
    successor = SessionRecord(tmp_path, ender)
    successor.save((8, b"new"))  # its own first session, recorded before it registers
    assert not successor.end_if_predecessors(8), "its own session"
    assert not successor.end_if_predecessors(6), "another session: maybe a live twin's"
    assert ender.ended == []
    assert successor.end_if_predecessors(7)
    assert ender.ended == [(7, b"pw")]


def test_a_process_never_ends_its_own_session(tmp_path: Path) -> None:
    ender = Ender()
    record = SessionRecord(tmp_path, ender)
    record.save((9, b"mine"))
    assert not record.end_if_predecessors(9)
    assert ender.ended == []


def test_the_record_follows_the_current_session(tmp_path: Path) -> None:
    record = SessionRecord(tmp_path, Ender())
    record.save((1, b"a"))
    record.save((2, b"b"))  # a new session after an expiry
    assert json.loads(record.path.read_text()) == {"session": 2, "password": b"b".hex()}


def test_when_ending_fails_the_caller_waits_as_before(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    successor = SessionRecord(tmp_path, Ender(OSError("connection refused")))
    assert not successor.end_if_predecessors(7)
    assert "could not end session 0x7" in caplog.text


def test_an_unwritable_directory_only_costs_the_wait(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    record = SessionRecord(tmp_path / "missing", Ender())
    record.save((5, b"x"))
    assert record.load() is None
    assert "cannot record the ZooKeeper session" in caplog.text
