"""Small versions as records of shared segment files: crash debris, restarts, compaction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.threads import run_in_threads
from support.waiting import wait_until

from blobha.core.digest import chunk_digest, digest_bytes
from blobha.core.errors import ChecksumMismatch
from blobha.store import files as files_module
from blobha.store import segments as segments_module
from blobha.store.local import LocalStore, VersionInfo
from blobha.store.segments import HEADER_SIZE, MAGIC, scan, segment_path


def _data(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def _install(store: LocalStore, *entries: tuple[str, int, bytes]) -> list[VersionInfo]:
    out = store.install_many([(k, s, d, len(d), digest_bytes(d)) for k, s, d in entries])
    assert all(isinstance(o, VersionInfo) for o in out)
    return [o for o in out if isinstance(o, VersionInfo)]


def _read(store: LocalStore, key: str, seq: int) -> bytes:
    return b"".join(store.read(key, seq))


def _segments(store: LocalStore) -> list[Path]:
    return sorted(store.segments_dir.glob("*.seg"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_versions_survive_a_restart_and_deleted_ones_stay_deleted(root: Path) -> None:
    store = LocalStore(root)
    _install(store, ("a", 1, b"one"), ("b", 1, b"two"))
    _install(store, ("a", 2, b"three"))
    store.delete_version("b", 1)
    store.close()
    store = LocalStore(root)
    assert sorted(store.keys()) == ["a"] and store.versions("a") == [1, 2]
    assert _read(store, "a", 1) == b"one" and _read(store, "a", 2) == b"three"
    assert store.counted_usage() == store.usage() and store.usage()[0] == 1
    # Each run appends to a segment of its own; the first run's still holds a and a's v2.
    assert len(_segments(store)) == 2
    store.close()


def test_a_torn_record_at_a_segments_end_is_passed_over(root: Path) -> None:
    # A crash in the middle of a batch's write: the records before it are whole and were
    # acknowledged; the torn one never was.
    store = LocalStore(root)
    _install(store, ("whole", 1, _data(3000)))
    [torn] = _install(store, ("torn", 1, _data(3000, seed=1)))
    path = segment_path(store.segments_dir, torn.segment)
    store.close()
    os.truncate(path, path.stat().st_size - 100)
    store = LocalStore(root)
    assert store.keys() == ["whole"] and _read(store, "whole", 1) == _data(3000)
    _install(store, ("after", 1, b"new"))
    assert sorted(store.keys()) == ["after", "whole"]
    store.close()


def test_a_damaged_header_ends_its_segments_scan(root: Path) -> None:
    store = LocalStore(root)
    # The data of "a" holds a record of "victim", whole and valid: the scan must never take
    # it for one, whatever damage comes before it.
    forged = b"".join(segments_module.encode(
        {"key": "victim", "seq": 1, "size": 4, "digest": digest_bytes(b"evil"),
         "chunk_size": 1 << 20, "chunks": [chunk_digest(b"evil")]}, b"evil"))
    alone = root.parent / "forged.seg"
    alone.write_bytes(forged)
    assert [rec["key"] for _, _, rec in scan(alone) if rec] == ["victim"]  # a valid record
    infos = _install(store, ("a", 1, b"x" * 50 + forged), ("b", 1, _data(2000, seed=1)),
                     ("c", 1, _data(2000, seed=2)))
    path = segment_path(store.segments_dir, infos[1].segment)
    store.close()
    a_header = next(off for off, _, rec in scan(path) if rec and rec["key"] == "a")
    with open(path, "r+b") as f:
        f.seek(a_header + 9)  # inside the lengths the header's check covers
        f.write(b"\xff\xff")
    store = LocalStore(root)
    # Nothing from the damage on: the synchroniser fetches a, b and c again from replicas.
    assert store.keys() == []
    store.close()


def test_of_two_copies_of_a_version_the_later_wins(root: Path) -> None:
    # A key deleted and created again reuses its version numbers; the dead mark of the first
    # copy is not synced, so a crash can leave both live on disk.
    store = LocalStore(root)
    [first, _] = _install(store, ("k", 1, b"first"), ("other", 1, b"keeps the segment"))
    store.close()
    store = LocalStore(root)
    _install(store, ("k", 1, b"second"))
    store.close()
    path = segment_path(root / "segments", first.segment)
    with open(path, "r+b") as f:  # the dead mark lost in the crash
        f.seek(20)
        f.write(b"\x01")
    store = LocalStore(root)
    assert store.versions("k") == [1] and _read(store, "k", 1) == b"second"
    assert _read(store, "other", 1) == b"keeps the segment"
    store.close()


def test_sparse_segments_are_compacted_and_removed(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 20_000)
    store = LocalStore(root)
    for i in range(12):  # 4 KiB each: a new segment about every five
        _install(store, (f"k{i}", 1, _data(4096, seed=i)))
    first = _segments(store)
    assert len(first) >= 3
    kept = {"k0", "k6", "k11"}
    held = store.info("k0", 1)  # as a reader holds it while compaction moves the bytes
    assert held is not None
    for i in range(12):
        if f"k{i}" not in kept:
            store.delete_version(f"k{i}", 1)
    # Emptied segments go at once; sparse ones are copied forward in the background.
    wait_until(lambda: not store.segments.sparse(), 10,
               "compaction")
    assert sorted(store.keys()) == sorted(kept)
    assert len(_segments(store)) < len(first)
    for key in kept:
        assert _read(store, key, 1) == _data(4096, seed=int(key[1:]))
    # The reader's record names a removed segment: it is sent to where the bytes went.
    f, moved = store.reads.open_version(held)
    with f:
        f.seek(moved.offset)
        assert f.read(moved.size) == _data(4096)
    assert moved.segment != held.segment and moved.digest == held.digest
    assert store.counted_usage() == store.usage()
    store.close()
    store = LocalStore(root)
    assert sorted(store.keys()) == sorted(kept)
    for key in kept:
        assert _read(store, key, 1) == _data(4096, seed=int(key[1:]))
    store.close()


def test_compaction_copies_no_corrupt_record(root: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 10_000)
    store = LocalStore(root)
    infos = [_install(store, (f"k{i}", 1, _data(4096, seed=i)))[0] for i in range(6)]
    rot = infos[1]
    with open(segment_path(store.segments_dir, rot.segment), "r+b") as f:
        f.seek(rot.offset + 7)
        f.write(b"\x00\x01")
    assert infos[0].segment == rot.segment == infos[2].segment
    store.delete_version("k0", 1)
    store.delete_version("k2", 1)  # the segment is sparse now: k1 is to be copied forward
    wait_until(lambda: not store.segments.sparse(), 10,
               "compaction")
    # The compactor read k1 through its digests, found it corrupt and removed it.
    assert store.versions("k1") == []
    with pytest.raises(Exception):  # noqa: B017 - KeyNotFound or ChecksumMismatch
        _read(store, "k1", 1)
    store.close()


def test_a_flipped_byte_of_a_record_is_caught_on_read(root: Path) -> None:
    store = LocalStore(root)
    [info] = _install(store, ("k", 1, _data(5000)))
    with open(segment_path(store.segments_dir, info.segment), "r+b") as f:
        f.seek(info.offset + 4999)
        f.write(b"\x00" if _data(5000)[4999] else b"\x01")
    with pytest.raises(ChecksumMismatch):
        _read(store, "k", 1)
    assert store.versions("k") == []
    store.close()


def test_a_record_is_its_header_its_record_and_its_bytes(root: Path) -> None:
    store = LocalStore(root)
    [info] = _install(store, ("k", 7, b"payload"))
    raw = segment_path(store.segments_dir, info.segment).read_bytes()
    assert raw.startswith(MAGIC) and raw.endswith(b"payload")
    assert info.offset == len(raw) - len(b"payload") and info.offset > HEADER_SIZE
    [(offset, length, record)] = list(scan(segment_path(store.segments_dir, info.segment)))
    assert (offset, length) == (0, len(raw))
    assert record is not None and (record["key"], record["seq"]) == ("k", 7)
    store.close()


def test_a_segment_that_cannot_be_made_fails_its_batch_only(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 5_000)
    store = LocalStore(root)
    _install(store, ("a", 1, _data(6000)))  # fills the first segment: the next batch rolls
    real = files_module.fsync_dir

    def full(path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_module, "fsync_dir", full)
    with pytest.raises(OSError, match="No space"):
        store.install_many([("b", 1, b"bee", 3, digest_bytes(b"bee"))])
    assert len(_segments(store)) == 1  # the half-made one is gone
    monkeypatch.setattr(files_module, "fsync_dir", real)
    _install(store, ("b", 1, b"bee"))  # space again: the roll is tried once more
    assert len(_segments(store)) == 2
    assert _read(store, "a", 1) == _data(6000) and _read(store, "b", 1) == b"bee"
    store.close()


def test_installs_deletes_reads_and_compaction_together_lose_nothing(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setattr(segments_module, "SEGMENT_BYTES", 16_000)  # rolls and compactions
    store = LocalStore(root)
    kept: dict[tuple[str, int], bytes] = {}
    kept_lock = threading.Lock()

    def churn(worker: int) -> None:
        for i in range(60):
            key = f"w{worker}-{i % 9}"
            data = _data(900 + i, seed=worker * 100 + i)
            _install(store, (key, i + 1, data))
            with kept_lock:
                kept[(key, i + 1)] = data
            if i % 3:  # most go again: segments empty out and get compacted meanwhile
                store.delete_version(key, i + 1)
                with kept_lock:
                    del kept[(key, i + 1)]
            for (k, seq), expected in list(kept.items())[-5:]:
                try:
                    got = _read(store, k, seq)
                except Exception:
                    continue  # its own worker deleted it meanwhile
                assert got == expected, (k, seq)

    assert run_in_threads(churn, 4) == []
    # The compactor counts its last copy just after the index shows it: waited for as well.
    wait_until(lambda: not store.segments.sparse()
               and store.counted_usage() == store.usage(), 10, "compaction")
    held = {(k, s) for k in store.keys() for s in store.versions(k)}  # noqa: SIM118
    assert held == set(kept)
    for (k, seq), data in kept.items():
        assert _read(store, k, seq) == data
    store.close()
    store = LocalStore(root)
    assert {(k, s) for k in store.keys() for s in store.versions(k)} == set(kept)  # noqa: SIM118
    for (k, seq), data in kept.items():
        assert _read(store, k, seq) == data
    store.close()
