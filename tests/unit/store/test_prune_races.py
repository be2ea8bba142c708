"""Pruning against readers (issue 44): a record pruned or compacted away between a reader's
index lookup and its read is "not held here", never an error and never a reason to remove
anything; a live record that is damaged still is one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support.threads import run_in_threads

from blobha.core.digest import digest_bytes
from blobha.core.errors import KeyNotFound
from blobha.store import segments as segments_module
from blobha.store.local import LocalStore, VersionInfo
from blobha.store.segments import HEADER_SIZE, segment_path

VERSIONS = 1500
READERS = 3


def _data(seq: int) -> bytes:
    return b"%08d" % seq * 64


def _install(store: LocalStore, key: str, seq: int, data: bytes) -> VersionInfo:
    [info] = store.install_many([(key, seq, data, len(data), digest_bytes(data))])
    assert isinstance(info, VersionInfo)
    return info


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_pruning_under_readers_of_the_current_version_removes_nothing_current(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small segments: they roll often, and the compactor moves live (current) records while
    # the readers read them.
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 16 * 1024)
    caplog.set_level(logging.DEBUG)
    store = LocalStore(tmp_path / "store")
    current = [1]
    _install(store, "k", 1, _data(1))
    lost: list[int] = []

    def work(worker: int) -> None:
        if worker == 0:  # the synchroniser: install the next version, prune the one before
            for seq in range(2, VERSIONS + 1):
                _install(store, "k", seq, _data(seq))
                current[0] = seq
                store.delete_version("k", seq - 1)  # sync/apply.py prune, one retained
                if store.info("k", seq) is None:
                    lost.append(seq)
            current[0] = -1
            return
        while current[0] > 0:  # readers: every version listed, and the current one's bytes
            seq = current[0]
            for listed in store.versions("k"):
                store.info("k", listed)
            try:
                if b"".join(store.read("k", seq)) != _data(seq):
                    raise AssertionError(f"v{seq} read back wrong")
            except KeyNotFound:
                pass  # pruned between the two lines: the next version is current now

    assert run_in_threads(work, 1 + READERS) == []
    assert lost == [], f"current versions removed: {lost[:5]}"
    assert store.versions("k") == [VERSIONS]
    assert b"".join(store.read("k", VERSIONS)) == _data(VERSIONS)
    assert _errors(caplog) == []
    store.close()


def test_a_damaged_live_record_is_still_caught_and_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LocalStore(tmp_path / "store")
    info = _install(store, "k", 1, _data(1))
    _install(store, "other", 1, _data(2))
    slot = store.segments.slot("k", 1)
    assert slot is not None
    with open(segment_path(store.segments_dir, slot.segment), "r+b") as f:
        f.seek(slot.offset + HEADER_SIZE + 2)  # inside the record: its check fails
        f.write(b"#")
    caplog.set_level(logging.DEBUG)
    assert store.info("k", 1) is None
    assert store.versions("k") == []
    assert any("unreadable record of 'k' v1" in e for e in _errors(caplog))
    assert store.info("other", 1) is not None and info.segment == slot.segment
    store.close()


def test_a_record_marked_dead_while_still_indexed_is_damage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Only a removal marks a record dead, and it takes the record out of the index first: a
    # dead mark on an indexed record was written by something else.
    store = LocalStore(tmp_path / "store")
    _install(store, "k", 1, _data(1))
    slot = store.segments.slot("k", 1)
    assert slot is not None
    store.segments.discard(slot)
    caplog.set_level(logging.DEBUG)
    assert store.info("k", 1) is None
    assert store.versions("k") == []
    assert any("unreadable record of 'k' v1" in e for e in _errors(caplog))
    store.close()
