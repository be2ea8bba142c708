"""SessionRecord: the data directory's record of its master's ZooKeeper session, and how
Membership.register uses it to end a dead predecessor's session."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.exceptions import NodeExistsError, NoNodeError

from blobha.sync import IdentityInUse, Membership, SessionRecord
from blobha.sync import membership as membership_mod

ME = "m1:6627"


class Ender:
    """Stands for Master._end_session."""

    def __init__(self, error: Exception | None = None, expired: bool = False,
                 zk: FakeZk | None = None) -> None:
        self.ended: list[tuple[int, bytes]] = []
        self.error = error
        self.expired = expired
        self.zk = zk

    def __call__(self, session: int, password: bytes) -> bool:
        self.ended.append((session, password))
        if self.error is not None:
            raise self.error
        if self.zk is not None:  # closing the session removes its ephemeral nodes
            self.zk.nodes = {p: n for p, n in self.zk.nodes.items() if n[1] != session}
        return not self.expired


def test_a_saved_session_is_private_and_loads_back(tmp_path: Path) -> None:
    record = SessionRecord(tmp_path, Ender())
    record.save((0x1234, b"\x00secret\xff"))
    assert record.load() == (0x1234, b"\x00secret\xff")
    assert stat.S_IMODE(record.path.stat().st_mode) == 0o600, "it holds the session's password"
    assert [p.name for p in tmp_path.iterdir()] == ["zk-session"], "no temporary file left"


def test_a_leftover_temporary_file_does_not_lend_its_mode(tmp_path: Path) -> None:
    leftover = tmp_path / ".zk-session.tmp"
    leftover.write_text("half")
    leftover.chmod(0o644)
    record = SessionRecord(tmp_path, Ender())
    record.save((3, b"pw"))
    assert stat.S_IMODE(record.path.stat().st_mode) == 0o600


def test_a_missing_or_damaged_record_is_no_record(tmp_path: Path) -> None:
    record = SessionRecord(tmp_path, Ender())
    assert record.load() is None
    SessionRecord(tmp_path, Ender()).save((1, b"a"))
    place = json.loads(record.path.read_text())["place"]
    assert record.load() == (1, b"a")
    for text in ("", "{", '{"session": 1}', '{"session": 1, "password": "zz"}', "[]",
                 json.dumps({"session": 1, "password": "61"}),  # no place: written elsewhere
                 json.dumps({"session": "x", "password": "61", "place": place})):
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
    assert not successor.end_if_predecessors(7), "tried once"
    assert ender.ended == [(7, b"pw")]


def test_a_process_never_ends_its_own_session(tmp_path: Path) -> None:
    # The record names session 9 when this process starts, and this process gets session 9 back
    # (a record written by this very process, read again): never closed under its own feet.
    SessionRecord(tmp_path, Ender()).save((9, b"mine"))
    ender = Ender()
    record = SessionRecord(tmp_path, ender)
    record.save((9, b"mine"))
    assert not record.end_if_predecessors(9)
    assert ender.ended == []


def test_the_record_follows_the_current_session(tmp_path: Path) -> None:
    record = SessionRecord(tmp_path, Ender())
    record.save((1, b"a"))
    record.save((2, b"b"))  # a new session after an expiry
    assert SessionRecord(tmp_path, Ender()).load() == (2, b"b")


def test_a_copied_directory_does_not_name_a_predecessor(tmp_path: Path) -> None:
    # A restored backup or a cloned machine started with the same address as a running master:
    # the session recorded in the copy is the running master's, which must not be ended.
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    SessionRecord(original, Ender()).save((7, b"pw"))
    shutil.copytree(original, copy)
    ender = Ender()
    twin = SessionRecord(copy, ender)
    assert twin.load() is None
    assert not twin.end_if_predecessors(7)
    assert ender.ended == []
    assert SessionRecord(original, Ender()).load() == (7, b"pw"), "valid where it was written"


def test_a_record_from_another_boot_names_no_predecessor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another running kernel (a cloned machine, or this one rebooted): the directory's lock
    # says nothing about the process that wrote it.
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    monkeypatch.setattr(membership_mod, "boot_id", lambda: "another-boot")
    assert SessionRecord(tmp_path, Ender()).load() is None


def test_when_ending_fails_the_caller_waits_as_before(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    successor = SessionRecord(tmp_path, Ender(OSError("connection refused")))
    assert not successor.end_if_predecessors(7)
    assert "could not end session 0x7" in caplog.text


def test_a_record_that_cannot_be_written_only_costs_the_wait(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    record = SessionRecord(tmp_path, Ender())
    record.path.mkdir()  # in the way of the rename
    record.save((5, b"x"))
    assert record.load() is None
    assert "cannot record the ZooKeeper session" in caplog.text
    assert not SessionRecord(tmp_path / "missing", Ender()).end_if_predecessors(5)


# --------------------------------------------------------------------------------------------
# Membership.register with a record
# --------------------------------------------------------------------------------------------


class FakeZk:
    """Ephemeral nodes by path: (data, owning session)."""

    def __init__(self, session: int) -> None:
        self.client_id = (session, b"now")
        self.nodes: dict[str, tuple[bytes, int]] = {}
        self.synced: list[str] = []

    def create(self, path: str, data: bytes, ephemeral: bool = False,
               makepath: bool = False) -> str:
        if path in self.nodes:
            raise NodeExistsError()
        self.nodes[path] = (data, self.client_id[0])
        return path

    def get(self, path: str, watch: Any = None) -> tuple[bytes, Any]:
        if path not in self.nodes:
            raise NoNodeError()
        data, owner = self.nodes[path]
        return data, SimpleNamespace(ephemeralOwner=owner, version=0)

    def sync(self, path: str) -> None:
        self.synced.append(path)

    def get_children_async(self, path: str, watch: Any = None) -> Any:
        names = [p.rsplit("/", 1)[1] for p in self.nodes]
        return SimpleNamespace(get=lambda timeout=None: names)


def _membership(zk: FakeZk, record: SessionRecord) -> Membership:
    return Membership(zk, ME, grace_secs=30, on_change=lambda: None,  # type: ignore[arg-type]
                      info={}, record=record)


def test_register_ends_the_predecessors_session_and_takes_the_name(tmp_path: Path) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))  # the crashed process's
    zk = FakeZk(session=8)
    zk.nodes[f"/masters/{ME}"] = (b"old", 7)
    ender = Ender(zk=zk)
    _membership(zk, SessionRecord(tmp_path, ender)).register(wait=False)
    assert ender.ended == [(7, b"pw")]
    assert zk.nodes[f"/masters/{ME}"][1] == 8
    assert zk.synced == [f"/masters/{ME}"]
    assert SessionRecord(tmp_path, Ender()).load() == (8, b"now"), "recorded before registering"


def test_register_never_ends_a_session_it_has_no_record_of(tmp_path: Path) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    zk = FakeZk(session=8)
    zk.nodes[f"/masters/{ME}"] = (b'{"pid": 1, "host": "h"}', 5)  # a live twin's, say
    ender = Ender(zk=zk)
    with pytest.raises(IdentityInUse, match="another master"):
        _membership(zk, SessionRecord(tmp_path, ender)).register(wait=False)
    assert ender.ended == []
    assert zk.nodes[f"/masters/{ME}"][1] == 5


def test_register_tries_ending_once_and_then_waits_as_before(tmp_path: Path) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    zk = FakeZk(session=8)
    zk.nodes[f"/masters/{ME}"] = (b"old", 7)
    ender = Ender(OSError("ZooKeeper went away"))
    with pytest.raises(IdentityInUse):
        _membership(zk, SessionRecord(tmp_path, ender)).register(wait=False)
    assert ender.ended == [(7, b"pw")]


def test_the_predecessor_is_ended_before_this_process_has_a_session(tmp_path: Path) -> None:
    # At start-up, once the directory's lock is held and before the store loads: no owner to
    # compare with yet, and none needed (the lock proves the recorder gone).
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    ender = Ender()
    successor = SessionRecord(tmp_path, ender)
    successor.end_predecessor()
    assert ender.ended == [(7, b"pw")]
    successor.save((8, b"new"))
    assert not successor.end_if_predecessors(7), "already ended: not tried again"
    assert ender.ended == [(7, b"pw")]


def test_a_predecessor_not_reached_at_start_up_is_tried_again_at_registration(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    SessionRecord(tmp_path, Ender()).save((7, b"pw"))
    ender = Ender(OSError("connection refused"))
    successor = SessionRecord(tmp_path, ender)
    successor.end_predecessor()
    assert "could not end session 0x7" in caplog.text
    ender.error = None  # ZooKeeper is back
    assert successor.end_if_predecessors(7)
    assert ender.ended == [(7, b"pw"), (7, b"pw")]


def test_without_a_record_nothing_is_ended_at_start_up(tmp_path: Path) -> None:
    ender = Ender()
    SessionRecord(tmp_path, ender).end_predecessor()
    assert ender.ended == []
