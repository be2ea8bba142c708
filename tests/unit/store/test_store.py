"""The local blob store: durable install, verified reads, housekeeping."""

from __future__ import annotations

import errno
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.threads import run_in_threads

from blobha.core.digest import CHUNK_SIZE, EMPTY_DIGEST, chunk_digest, digest_bytes
from blobha.core.errors import ChecksumMismatch, InvalidArgument, KeyNotFound, ResourceExhausted
from blobha.core.keys import key_dirname
from blobha.store import files as files_module
from blobha.store import segments as segments_module
from blobha.store.local import DataDirInUse, LocalStore, TempBlob, VersionInfo
from blobha.store.segments import segment_path

MiB = 1024 * 1024


def _data(size: int, seed: int = 0) -> bytes:
    # Position-dependent bytes, so a chunk served from the wrong offset cannot look right.
    block = bytes((i * 31 + seed) % 251 for i in range(251 * 16))
    return (block * (size // len(block) + 1))[:size]


def _put(store: LocalStore, key: str, seq: int, data: bytes) -> VersionInfo:
    temp = store.new_temp("upload")
    for start in range(0, len(data), 300_000):
        temp.write_at(start, data[start:start + 300_000])
    return store.install(key, seq, temp, len(data), digest_bytes(data))


def _read(store: LocalStore, key: str, seq: int, offset: int = 0, length: int = 0) -> bytes:
    return b"".join(store.read(key, seq, offset, length))


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.mark.parametrize(
    "size", [0, 1, 4096, MiB - 1, MiB, MiB + 1, 2 * MiB, 3 * MiB + MiB // 2]
)
def test_install_and_read_back(store: LocalStore, size: int) -> None:
    data = _data(size)
    info = _put(store, "k", 1, data)
    assert info.size == size
    assert info.digest == digest_bytes(data)
    assert len(info.chunks) == -(-size // CHUNK_SIZE)
    assert _read(store, "k", 1) == data
    assert store.info("k", 1) == info
    assert store.latest("k") == info
    assert store.verify("k", 1)
    assert os.listdir(store.tmp_dir) == []


def test_empty_blob_has_the_empty_digest(store: LocalStore) -> None:
    info = _put(store, "empty", 1, b"")
    assert info.digest == EMPTY_DIGEST
    assert list(store.read("empty", 1)) == []


def test_reads_come_in_chunks_of_at_most_chunk_size(store: LocalStore) -> None:
    _put(store, "k", 1, _data(3 * MiB + 5))
    sizes = [len(c) for c in store.read("k", 1)]
    assert sizes == [MiB, MiB, MiB, 5]


@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (0, 1),
        (0, MiB),
        (MiB - 1, 2),
        (MiB - 10, MiB + 20),
        (MiB, MiB),
        (MiB + 1, 0),
        (3 * MiB, 0),
        (3 * MiB + MiB // 2 - 1, 0),
        (3 * MiB + MiB // 2, 0),
        (12345, 3 * MiB),
        (100, 10 * MiB),
    ],
)
def test_ranged_reads(store: LocalStore, offset: int, length: int) -> None:
    data = _data(3 * MiB + MiB // 2, seed=7)
    _put(store, "k", 1, data)
    end = len(data) if length == 0 else offset + length
    assert _read(store, "k", 1, offset, length) == data[offset:end]


def test_offset_past_the_end_is_invalid(store: LocalStore) -> None:
    _put(store, "k", 1, b"abc")
    with pytest.raises(InvalidArgument, match="past the end"):
        _read(store, "k", 1, 4)


def test_reading_a_missing_version_is_key_not_found(store: LocalStore) -> None:
    with pytest.raises(KeyNotFound):
        _read(store, "nothing", 1)
    _put(store, "k", 1, b"abc")
    with pytest.raises(KeyNotFound):
        _read(store, "k", 2)


def test_a_version_removed_before_its_stream_starts_is_not_held_here(store: LocalStore) -> None:
    # The master found the version, then dropped its copy (held by all the chosen masters)
    # before the stream's first read: the client must hear "not held here" and read from
    # another replica, not be told the blob is gone.
    from blobha.master.reads import _read_held

    _put(store, "k", 1, b"committed")
    stream = _read_held(store, "m1:6627", "k", 1, 0, 0)
    store.delete_version("k", 1)
    with pytest.raises(KeyNotFound, match=r"^not held here: m1:6627 no longer holds v1 of 'k'"):
        next(stream)
    _put(store, "k", 2, b"served")
    assert b"".join(_read_held(store, "m1:6627", "k", 2, 0, 0)) == b"served"


@pytest.mark.parametrize("wrong", ["digest", "size"])
def test_digest_mismatch_on_install_leaves_nothing(store: LocalStore, wrong: str) -> None:
    data = _data(MiB + 3)
    temp = store.new_temp("upload")
    temp.write_at(0, data)
    size = len(data) + (1 if wrong == "size" else 0)
    digest = digest_bytes(data[:-1]) if wrong == "digest" else digest_bytes(data)
    with pytest.raises(ChecksumMismatch, match="does not match"):
        store.install("k", 1, temp, size, digest)
    assert store.versions("k") == []
    assert store.latest("k") is None
    assert store.keys() == []
    assert os.listdir(store.tmp_dir) == []


def test_write_at_skips_retried_bytes_and_refuses_gaps(tmp_path: Path) -> None:
    temp = TempBlob(tmp_path / "t.part")
    assert temp.write_at(0, b"hello") == 5
    # A retried chunk: already received in full.
    assert temp.write_at(0, b"hello") == 0
    # A retried chunk that overlaps: only the new tail is written.
    assert temp.write_at(3, b"lo world") == 6
    assert temp.size == 11
    with pytest.raises(InvalidArgument, match="gap"):
        temp.write_at(12, b"!")
    assert temp.size == 11
    assert temp.write_at(11, b"!") == 1
    assert temp.finish() == (digest_bytes(b"hello world!"), [chunk_digest(b"hello world!")], 12)
    assert (tmp_path / "t.part").read_bytes() == b"hello world!"


def test_chunk_digests_do_not_depend_on_how_the_bytes_arrive(tmp_path: Path) -> None:
    data = os.urandom(2 * CHUNK_SIZE + 12345)
    expected = [chunk_digest(data[i:i + CHUNK_SIZE]) for i in range(0, len(data), CHUNK_SIZE)]
    for piece in (1000, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 7, len(data)):
        temp = TempBlob(tmp_path / f"p{piece}.part")
        for i in range(0, len(data), piece):
            temp.write_at(i, data[i:i + piece])
        assert temp.finish() == (digest_bytes(data), expected, len(data))


@pytest.fixture
def counted_flushes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every background flush counted (see _flushing_temp)."""
    flushes: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        flushes.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    return flushes


def _flushing_temp(path: Path) -> TempBlob:
    """A temp file flushed in the background every 8 KiB, so small files run flushes."""
    return TempBlob(path, flush_bytes=8192, writeback_bytes=4096)


def _write_in_odd_pieces(temp: TempBlob, data: bytes) -> None:
    """Pieces of odd sizes, each re-sending two bytes already received (a retried chunk's
    overlap)."""
    pos = 0
    for n in (1, 4095, 3, 8192, 10_000, 7):
        start = max(pos - 2, 0)
        temp.write_at(start, data[start:pos + n])
        pos = min(pos + n, len(data))
    temp.write_at(pos, data[pos:])


@pytest.mark.parametrize("size", [0, 1, 8191, 8192, 22_301, 123_457])
def test_temp_file_flushed_in_the_background_holds_exactly_the_bytes(
        tmp_path: Path, counted_flushes: list[int], size: int) -> None:
    data = os.urandom(size)
    temp = _flushing_temp(tmp_path / "t.part")
    _write_in_odd_pieces(temp, data)
    assert temp.size == size
    expected = [chunk_digest(data[i:i + CHUNK_SIZE]) for i in range(0, size, CHUNK_SIZE)]
    assert temp.finish() == (digest_bytes(data), expected, size)
    assert (tmp_path / "t.part").read_bytes() == data
    if size >= 2 * 8192:
        assert counted_flushes, "no flush ran while the bytes arrived"
    with pytest.raises(ValueError, match="discarded"):
        temp.write_at(size, b"late")
    assert not [t for t in threading.enumerate() if t.name.startswith("blob-flush")]


def test_a_failed_background_flush_fails_the_temp_file(
        tmp_path: Path, counted_flushes: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int) -> None:
        counted_flushes.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    temp = _flushing_temp(tmp_path / "t.part")
    data = os.urandom(64 * 1024)
    # It surfaces in a later write or in the finish: never a file that installs as if whole.
    with pytest.raises(OSError, match="Input/output error"):
        for start in range(0, len(data), 1000):
            temp.write_at(start, data[start:start + 1000])
        temp.finish()
    assert counted_flushes
    temp.discard()
    assert not (tmp_path / "t.part").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("blob-flush")]


def test_discard_from_another_thread_while_a_stream_writes(
        tmp_path: Path, counted_flushes: list[int]) -> None:
    """An expired upload is discarded by the reaper while its stream may still write: the
    stream gets ValueError (the upload is gone), and the file and its flusher go away."""
    temp = _flushing_temp(tmp_path / "t.part")
    block = os.urandom(1000)
    errors: list[BaseException] = []
    flushing = threading.Event()

    def stream() -> None:
        try:
            while True:
                temp.write_at(temp.size, block)
                if counted_flushes:
                    flushing.set()
        except BaseException as e:
            errors.append(e)

    writer = threading.Thread(target=stream)
    writer.start()
    assert flushing.wait(10)
    temp.discard()
    writer.join(10)
    assert not writer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert not (tmp_path / "t.part").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("blob-flush")]


def test_discarded_temp_is_removed(store: LocalStore) -> None:
    temp = store.new_temp("upload")
    temp.write_at(0, b"abc")
    temp.discard()
    temp.discard()
    assert os.listdir(store.tmp_dir) == []


def _version_place(store: LocalStore, key: str, seq: int) -> tuple[Path, int]:
    """The file holding a version's bytes, and where they start in it: a segment, or a
    ``.blob`` beside its record."""
    info = store.info(key, seq)
    assert info is not None
    if info.segment >= 0:
        return segment_path(store.segments_dir, info.segment), info.offset
    return store.keys_dir / key_dirname(key) / f"v{seq}.blob", 0


def _stored_size(store: LocalStore, key: str, seq: int) -> int:
    """What a small version counts for in the usage: its whole record in its segment."""
    slot = store.segments.slot(key, seq)
    assert slot is not None
    return slot.length


def _flip_byte(store: LocalStore, key: str, seq: int, offset: int) -> None:
    path, base = _version_place(store, key, seq)
    offset += base
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_chunk_is_never_yielded_and_the_version_is_removed(store: LocalStore) -> None:
    data = _data(3 * MiB)
    _put(store, "k", 1, data)
    _flip_byte(store, "k", 1, MiB + 17)
    chunks = store.read("k", 1)
    # The first chunk is intact and served; the second is checked before anything of it leaves.
    assert next(chunks) == data[:MiB]
    with pytest.raises(ChecksumMismatch, match="corrupt"):
        next(chunks)
    assert store.versions("k") == []
    assert store.info("k", 1) is None
    with pytest.raises(KeyNotFound):
        _read(store, "k", 1)


def test_corruption_in_the_first_chunk_yields_nothing(store: LocalStore) -> None:
    _put(store, "k", 1, _data(1000))
    _flip_byte(store, "k", 1, 999)
    received: list[bytes] = []
    with pytest.raises(ChecksumMismatch):
        received.extend(store.read("k", 1))
    assert received == []


def test_ranged_read_checks_the_whole_chunk_it_serves_from(store: LocalStore) -> None:
    _put(store, "k", 1, _data(2 * MiB))
    _flip_byte(store, "k", 1, MiB + MiB // 2)
    with pytest.raises(ChecksumMismatch):
        _read(store, "k", 1, MiB, 10)


def test_truncated_blob_is_detected(store: LocalStore) -> None:
    _put(store, "k", 1, _data(2 * MiB))
    path = store.keys_dir / key_dirname("k") / "v1.blob"
    os.truncate(path, MiB)
    assert not store.verify("k", 1)
    assert store.versions("k") == []


def test_verify_leaves_an_intact_version_alone(store: LocalStore) -> None:
    _put(store, "k", 1, _data(MiB + 1))
    assert store.verify("k", 1)
    assert store.versions("k") == [1]


def test_unreadable_record_removes_the_version(store: LocalStore) -> None:
    _put(store, "k", 1, b"abc")
    (store.keys_dir / key_dirname("k") / "v1.json").write_text("{not json", encoding="utf-8")
    assert store.info("k", 1) is None
    assert store.versions("k") == []


def test_start_up_removes_temp_files_and_half_installed_versions(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    _put(store, "k", 1, b"committed")
    d = store.keys_dir / key_dirname("k")
    (store.tmp_dir / "upload-dead.part").write_bytes(b"partial")
    (store.tmp_dir / "nested").mkdir()
    (store.tmp_dir / "nested" / "x").write_bytes(b"x")
    (d / "v2.blob").write_bytes(b"renamed in, record never written")
    (d / "v2.json.tmp-abc").write_text("{}", encoding="utf-8")
    store.close()  # the process stops (a crash lets the lock go too)
    restarted = LocalStore(root)
    assert os.listdir(restarted.tmp_dir) == []
    assert sorted(os.listdir(d)) == ["v1.blob", "v1.json"]
    assert restarted.versions("k") == [1]
    assert _read(restarted, "k", 1) == b"committed"
    assert restarted.clean_temp() == 0


def test_a_stray_temp_file_does_not_break_delete_key(store: LocalStore) -> None:
    _put(store, "k", 1, b"one")
    _put(store, "k", 2, b"two")
    d = store.keys_dir / key_dirname("k")
    (d / "v3.blob.tmp-123").write_bytes(b"stray")
    (store.tmp_dir / "upload-x.part").write_bytes(b"stray")
    store.delete_key("k")
    assert not d.exists()
    assert store.versions("k") == []
    assert store.keys() == []
    # The key can be created again afterwards (scenario 2).
    _put(store, "k", 3, b"again")
    assert _read(store, "k", 3) == b"again"


def test_prune_keeps_the_newest_versions(store: LocalStore) -> None:
    for seq in (1, 2, 5, 10):
        _put(store, "k", seq, f"v{seq}".encode())
    store.prune("k", 2)
    assert store.versions("k") == [5, 10]
    assert _read(store, "k", 10) == b"v10"
    store.prune("k", 5)
    assert store.versions("k") == [5, 10]
    store.prune("k", 0)
    assert store.versions("k") == []


def test_versions_sort_numerically(store: LocalStore) -> None:
    for seq in (10, 9, 100):
        _put(store, "k", seq, b"x")
    assert store.versions("k") == [9, 10, 100]
    latest = store.latest("k")
    assert latest is not None and latest.seq == 100


def test_find_by_digest(store: LocalStore) -> None:
    _put(store, "k", 1, b"alpha")
    _put(store, "k", 2, b"beta")
    found = store.find_by_digest("k", digest_bytes(b"alpha"), 5)
    assert found is not None and found.seq == 1
    assert store.find_by_digest("k", digest_bytes(b"gamma"), 5) is None


def test_install_copy_rolls_back_to_an_older_version(store: LocalStore) -> None:
    old = _put(store, "k", 1, _data(MiB + 9))
    _put(store, "k", 2, b"new")
    copy = store.install_copy("k", 3, old)
    assert copy.digest == old.digest and copy.seq == 3
    assert _read(store, "k", 3) == _data(MiB + 9)


def test_usage_counts_keys_once_and_every_retained_byte(store: LocalStore) -> None:
    assert store.usage() == (0, 0)
    _put(store, "a", 1, b"12345")
    _put(store, "a", 2, b"123")
    _put(store, "b", 1, b"")
    _put(store, "c", 1, _data(MiB + 1))
    assert store.usage() == (3, 5 + 3 + 0 + MiB + 1)
    store.delete_key("c")
    assert store.usage() == (2, 8)


def test_reserve(tmp_path: Path) -> None:
    plain = LocalStore(tmp_path / "s")
    plain.reserve(1)
    with pytest.raises(ResourceExhausted):
        plain.reserve(1 << 62)
    plain.close()
    huge = LocalStore(tmp_path / "s", reserved_bytes=1 << 62)
    with pytest.raises(ResourceExhausted, match=r"blobstore\.disk\.reserved\.bytes"):
        huge.reserve(1)


def test_a_copy_of_a_local_version_is_refused_where_it_would_eat_the_reservation(
        tmp_path: Path) -> None:
    # A roll-back restores an older version as a new one by copying it, and a sync installs
    # bytes it finds here already the same way: a second copy, which a disk at its reserve
    # must refuse before writing anything.
    store = LocalStore(tmp_path / "s")
    info = _put(store, "k", 1, _data(MiB))
    store.reserved_bytes = 1 << 62
    with pytest.raises(ResourceExhausted, match=r"blobstore\.disk\.reserved\.bytes"):
        store.install_copy("k", 2, info)
    assert store.versions("k") == [1]
    assert not any(store.tmp_dir.iterdir())
    store.reserved_bytes = 0
    assert store.install_copy("k", 2, info).digest == info.digest


def test_keys_lists_installed_keys_including_unicode(store: LocalStore) -> None:
    keys = ["plain", "données_2024", "日本語キー", "with space", "tab\tkey", ".dot", "z" * 300]
    for key in keys:
        _put(store, key, 1, key.encode())
    assert sorted(store.keys()) == sorted(keys)
    for key in keys:
        assert _read(store, key, 1) == key.encode()
    record = json.loads((store.keys_dir / key_dirname("日本語キー") / "v1.json").read_text("utf-8"))
    assert record["key"] == "日本語キー"


def test_keys_of_a_store_written_with_key_files_are_still_found(store: LocalStore) -> None:
    # Stores written before the key moved into the version records named it in a "key" file.
    _put(store, "z" * 300, 1, b"x")
    d = store.keys_dir / key_dirname("z" * 300)
    record = json.loads((d / "v1.json").read_text("utf-8"))
    del record["key"]
    (d / "v1.json").write_text(json.dumps(record), "utf-8")
    assert store.keys() == []
    (d / "key").write_text(json.dumps({"key": "z" * 300}), "utf-8")
    assert store.keys() == ["z" * 300]


def test_a_key_without_versions_is_not_listed(store: LocalStore) -> None:
    _put(store, "k", 1, b"x")
    store.delete_version("k", 1)
    assert store.keys() == []


def test_keys_sharing_a_prefix_with_hash_names_stay_apart(store: LocalStore) -> None:
    long_key = "q" * 300
    _put(store, long_key, 1, b"long")
    short_key = key_dirname(long_key)
    _put(store, short_key, 1, b"short")
    assert sorted(store.keys()) == sorted([long_key, short_key])
    assert _read(store, long_key, 1) == b"long"
    assert _read(store, short_key, 1) == b"short"


def test_keys_come_from_directory_names_without_reading_records(store: LocalStore) -> None:
    # A readable directory name is the key: a record that cannot be parsed does not hide the
    # key from the reconcile, which then finds the record unreadable and removes the version.
    _put(store, "plain key", 1, b"x")
    (store.keys_dir / key_dirname("plain key") / "v1.json").write_text("{torn", "utf-8")
    assert store.keys() == ["plain key"]
    assert store.info("plain key", 1) is None
    assert store.keys() == []


def test_delete_through_keeps_newer_versions_and_removes_an_emptied_key(
        store: LocalStore) -> None:
    for seq in (1, 2, 3):
        _put(store, "k", seq, b"v%d" % seq)
    store.delete_through("k", 2)
    assert store.versions("k") == [3]
    assert _read(store, "k", 3) == b"v3"
    store.delete_through("k", 3)
    assert store.keys() == [] and not (store.keys_dir / key_dirname("k")).exists()


def test_a_stray_file_among_the_key_directories_does_not_break_start_up(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    _put(store, "k", 1, b"kept")
    (store.keys_dir / "stray.tmp").write_bytes(b"left by someone else")
    store.close()
    restarted = LocalStore(root)
    assert restarted.keys() == ["k"]
    assert restarted.usage() == (1, 4)
    assert _read(restarted, "k", 1) == b"kept"


def test_install_many_installs_each_version_durably_and_readably(store: LocalStore) -> None:
    items = [(f"k{i}", 1, _data(100 + i, seed=i), 100 + i, digest_bytes(_data(100 + i, seed=i)))
             for i in range(5)]
    _put(store, "k0", 1, b"stale")  # an earlier copy is replaced, not kept
    out = store.install_many(items)
    assert [o.key for o in out if isinstance(o, VersionInfo)] == [f"k{i}" for i in range(5)]
    for key, seq, data, _, digest in items:
        assert _read(store, key, seq) == data
        info = store.info(key, seq)
        assert info is not None and info.digest == digest
    assert list(store.tmp_dir.iterdir()) == []


def test_versions_installed_together_are_records_of_one_segment(store: LocalStore) -> None:
    # No file, no directory, no inode per version: one shared segment takes them all.
    data = _data(CHUNK_SIZE + 1000, seed=3)  # two chunks: the last one ends at the next record
    [info, _] = _install_small(store, ("two chunks", 4, data), ("next", 1, b"after"))
    assert isinstance(info, VersionInfo) and info.packed and info.segment >= 0
    assert not (store.keys_dir / key_dirname("two chunks")).exists()
    assert [p.name for p in store.segments_dir.iterdir()] == [
        segment_path(store.segments_dir, info.segment).name]
    assert store.info("two chunks", 4) == info and store.versions("two chunks") == [4]
    assert store.has_version("two chunks", 4) and not store.has_version("two chunks", 3)
    assert _read(store, "two chunks", 4) == data
    assert _read(store, "two chunks", 4, CHUNK_SIZE + 990) == data[-10:]
    assert store.verify("two chunks", 4)
    sent = bytearray()

    def send(f: Any, pos: int, n: int) -> None:
        f.seek(pos)
        sent.extend(f.read(n))

    with ThreadPoolExecutor(1) as checker:
        store.send_verified(info, 10, info.size, lambda: None, send, checker)
    assert bytes(sent) == data[10:]


def test_packed_and_paired_versions_live_side_by_side(tmp_path: Path) -> None:
    # A store written before packing (a .blob and a .json per version) keeps working, with new
    # versions packed beside the old ones; a long key's hashed directory names its key in
    # either kind of record.
    long_key = "k" * 300
    assert key_dirname(long_key).startswith("h-")
    root = tmp_path / "store"
    store = LocalStore(root)
    _put(store, long_key, 1, b"paired")
    _install_small(store, (long_key, 2, b"packed"), ("other", 1, b"x"))
    store.close()
    store = LocalStore(root)
    assert sorted(store.keys()) == [long_key, "other"]
    assert store.versions(long_key) == [1, 2]
    assert _read(store, long_key, 1) == b"paired" and _read(store, long_key, 2) == b"packed"
    assert store.latest(long_key) == store.info(long_key, 2)
    d = store.keys_dir / key_dirname(long_key)
    (d / "v1.json").unlink()
    (d / "v1.blob").unlink()
    store.close()
    store = LocalStore(root)  # the key now read from its packed record alone
    assert sorted(store.keys()) == [long_key, "other"]
    store.prune(long_key, 0)
    assert store.keys() == ["other"] and not list(d.glob("v*"))


@pytest.mark.parametrize("damage", ["truncated", "record overwritten", "bytes appended"])
def test_a_packed_version_without_a_whole_record_is_removed(
        tmp_path: Path, damage: str) -> None:
    store = LocalStore(tmp_path / "store")
    path = _write_legacy_ver(store, "k", 1, _data(5000))
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:-3])
    elif damage == "record overwritten":
        path.write_bytes(raw[:5000] + b"\0" * (len(raw) - 5000))
    else:
        path.write_bytes(raw + b"more")
    store.close()
    store = LocalStore(tmp_path / "store")  # an earlier release's store, opened by this one
    assert store.info("k", 1) is None
    assert store.versions("k") == [] and not path.exists()
    store.close()


def test_a_paired_copy_replaced_by_a_packed_one_is_not_kept(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    _put(store, "k", 1, b"paired")
    _install_small(store, ("k", 1, b"packed"))
    d = store.keys_dir / key_dirname("k")
    assert list(d.iterdir()) == [] and _read(store, "k", 1) == b"packed"
    _put(store, "k", 1, b"paired again")  # and the other way round
    assert sorted(p.name for p in d.iterdir()) == ["v1.blob", "v1.json"]
    assert _read(store, "k", 1) == b"paired again"
    store.close()
    store = LocalStore(tmp_path / "store")  # the replaced record stays dead
    assert store.versions("k") == [1] and _read(store, "k", 1) == b"paired again"
    store.close()


def _write_legacy_ver(store: LocalStore, key: str, seq: int, data: bytes) -> Path:
    """A version as an earlier release packed it: one ``.ver`` file, its bytes then its
    record (stores keep reading those)."""
    chunks = tuple(chunk_digest(data[i:i + CHUNK_SIZE]) for i in range(0, len(data), CHUNK_SIZE))
    info = VersionInfo(key, seq, len(data), digest_bytes(data), CHUNK_SIZE, chunks, packed=True)
    d = store.keys_dir / key_dirname(key)
    d.mkdir(exist_ok=True)
    path = d / f"v{seq}.ver"
    record = json.dumps({"key": key, "seq": seq, "size": len(data), "digest": info.digest,
                         "chunk_size": CHUNK_SIZE, "chunks": list(chunks)}).encode()
    path.write_bytes(data + record + len(record).to_bytes(4, "little") + b"BLOBHAv1")
    return path


def _install_small(store: LocalStore, *entries: tuple[str, int, bytes]
                   ) -> list[VersionInfo | ChecksumMismatch]:
    return store.install_many([(key, seq, data, len(data), digest_bytes(data))
                               for key, seq, data in entries])


def test_versions_installed_together_are_remembered_until_removed(store: LocalStore) -> None:
    # The other masters fetch a new version right after its install: from memory, with the
    # record the disk holds, and never once the version is gone.
    a, b = _data(300), _data(500, seed=1)
    _install_small(store, ("a", 1, a), ("b", 2, b))
    for key, seq, data in (("a", 1, a), ("b", 2, b)):
        remembered = store.recent(key, seq)
        assert remembered == (store.info(key, seq), data)
    assert store.recent("a", 2) is None and store.recent("c", 1) is None
    store.delete_version("a", 1)
    assert store.recent("a", 1) is None
    store.prune("b", 0)
    assert store.recent("b", 2) is None
    # A key deleted and created again can reuse a version number: its new bytes, not the old.
    _install_small(store, ("b", 2, b))
    store.delete_key("b")
    assert store.recent("b", 2) is None
    new = _data(200, seed=2)
    _put(store, "b", 2, new)
    assert store.recent("b", 2) is None and _read(store, "b", 2) == new


def test_a_corrupt_version_is_forgotten_with_its_file(store: LocalStore) -> None:
    data = _data(CHUNK_SIZE + 10)
    _install_small(store, ("k", 1, data))
    _flip_byte(store, "k", 1, 5)
    with pytest.raises(ChecksumMismatch):
        _read(store, "k", 1)
    assert store.recent("k", 1) is None and store.versions("k") == []


def test_remembered_versions_are_bounded_oldest_first(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", recent_bytes=1000, recent_versions=3)
    _install_small(store, *[(f"k{i}", 1, _data(100, seed=i)) for i in range(5)])
    assert [k for k in ("k0", "k1", "k2", "k3", "k4") if store.recent(k, 1)] == ["k2", "k3", "k4"]
    _install_small(store, ("big", 1, _data(801)))  # 801 + only the newest 100 fit in 1,000
    assert [k for k in ("k2", "k3", "k4", "big") if store.recent(k, 1)] == ["k4", "big"]
    _install_small(store, ("huge", 1, _data(1001)))  # more than the bound: nothing stays
    assert [k for k in ("k4", "big", "huge") if store.recent(k, 1)] == []
    assert _read(store, "huge", 1) == _data(1001)  # installed all the same
    store.close()


def test_install_many_keeps_out_a_copy_that_does_not_match(store: LocalStore) -> None:
    good, bad = _data(64), _data(64, seed=1)
    out = store.install_many([
        ("good", 1, good, len(good), digest_bytes(good)),
        ("bad", 1, bad, len(bad), digest_bytes(good)),  # bytes that do not match the digest
        ("short", 1, good, len(good) + 1, digest_bytes(good)),
    ])
    assert isinstance(out[0], VersionInfo)
    assert isinstance(out[1], ChecksumMismatch) and isinstance(out[2], ChecksumMismatch)
    assert store.versions("bad") == [] and store.versions("short") == []
    assert _read(store, "good", 1) == good
    assert list(store.tmp_dir.iterdir()) == []


def test_a_failed_install_many_leaves_no_version_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "store")

    def failing_sync(fd: int) -> None:
        raise OSError(5, "I/O error")  # the sync that would make the records durable

    monkeypatch.setattr(segments_module.os, "fdatasync", failing_sync)
    data = _data(10)
    with pytest.raises(OSError):
        store.install_many([("a", 1, data, len(data), digest_bytes(data)),
                            ("b", 1, data, len(data), digest_bytes(data))])
    monkeypatch.undo()
    # Never made durable, so never left for a reconcile to register, nor served from memory;
    # the records written are marked dead, so a restart does not find them either.
    assert store.versions("a") == [] and store.versions("b") == []
    assert store.recent("a", 1) is None and store.recent("b", 1) is None
    _install_small(store, ("c", 1, b"later"))
    store.close()
    store = LocalStore(tmp_path / "store")
    assert store.keys() == ["c"] and _read(store, "c", 1) == b"later"
    store.close()


def test_install_many_that_finds_no_space_leaves_no_partial_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "store")
    real = os.pwritev

    def half_then_full(fd: int, buffers: list[Any], offset: int) -> int:
        if sum(len(b) for b in buffers) > 100:
            real(fd, [bytes(buffers[0])[:30]], offset)  # a torn header, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segments_module.os, "pwritev", half_then_full)
    data = _data(5000)
    with pytest.raises(OSError, match="No space"):
        store.install_many([("m", 1, data, len(data), digest_bytes(data))])
    monkeypatch.undo()
    assert store.versions("m") == [] and store.counted_usage() == (0, 0)
    assert [p.stat().st_size for p in store.segments_dir.iterdir()] == [0]  # cut off again
    _install_small(store, ("n", 1, b"fits"))  # the next batch goes where the failed one began
    store.close()
    store = LocalStore(tmp_path / "store")
    assert store.keys() == ["n"] and _read(store, "n", 1) == b"fits"
    store.close()


def test_blob_buffer_appends_like_a_temp_blob() -> None:
    from blobha.store.local import BlobBuffer

    buf = BlobBuffer()
    assert buf.write_at(0, b"abc") == 3
    assert buf.write_at(1, b"bcde") == 2  # a retried chunk: only the new bytes count
    assert buf.write_at(5, b"") == 0
    with pytest.raises(InvalidArgument):
        buf.write_at(9, b"gap")
    assert buf.value() == b"abcde" and buf.size == 5


def test_counted_usage_follows_every_change_the_store_makes(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:

    def agrees() -> bool:
        return store.counted_usage() == store.usage()

    assert store.counted_usage() == (0, 0)
    _put(store, "a", 1, b"12345")
    _put(store, "a", 2, b"123")
    _put(store, "b", 1, b"")
    assert store.counted_usage() == (2, 8) and agrees()
    small = _data(700)
    store.install_many([("c", 1, small, 700, digest_bytes(small)),
                        ("a", 3, small, 700, digest_bytes(small)),
                        ("d", 1, small, 700, "0" * 32)])  # refused: counts nothing
    # Versions installed together are records of a segment: their headers count too.
    c1, a3 = _stored_size(store, "c", 1), _stored_size(store, "a", 3)
    assert c1 > 700 and a3 > 700
    assert store.counted_usage() == (3, 8 + c1 + a3) and agrees()
    store.install_copy("e", 1, store.info("c", 1))  # type: ignore[arg-type]
    assert store.counted_usage() == (4, 8 + c1 + a3 + 700) and agrees()
    store.prune("a", 1)
    assert store.counted_usage() == (4, c1 + a3 + 700) and agrees()
    store.delete_version("b", 1)  # its last version: the key no longer counts
    assert store.counted_usage() == (3, c1 + a3 + 700) and agrees()
    store.delete_through("c", 1)
    store.delete_key("e")
    store.delete_key("never-there")
    assert store.counted_usage() == (1, a3) and agrees()
    # A corrupt copy found on read is removed, and uncounted.
    _put(store, "rot", 1, _data(3000))
    path = store.keys_dir / key_dirname("rot") / "v1.blob"
    path.write_bytes(b"x" * 3000)
    with pytest.raises(ChecksumMismatch):
        _read(store, "rot", 1)
    assert store.counted_usage() == (1, a3) and agrees()
    # A batch whose sync fails counts nothing.
    def failing_sync(fd: int) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(segments_module.os, "fdatasync", failing_sync)
    with pytest.raises(OSError):
        store.install_many([("f", 1, small, 700, digest_bytes(small))])
    assert store.counted_usage() == (1, a3) and agrees()


def test_counted_usage_is_exact_under_concurrent_changes(store: LocalStore) -> None:
    def churn(worker: int) -> None:
        for i in range(40):
            # Shared keys as well as own ones: changes of one key are serialised.
            key = f"shared-{i % 5}" if i % 2 else f"own-{worker}-{i % 7}"
            data = _data(100 + worker * 10 + i, seed=worker)
            seq = worker * 1000 + i + 1
            if i % 3 == 2:
                store.delete_key(key)
            elif i % 3 == 1:
                store.install_many([(key, seq, data, len(data), digest_bytes(data))])
            else:
                _put(store, key, seq, data)
                store.prune(key, 2)

    assert run_in_threads(churn, 4) == []
    assert store.counted_usage() == store.usage() != (0, 0)


def test_counted_usage_starts_from_what_is_on_disk(tmp_path: Path) -> None:
    first = LocalStore(tmp_path / "s")
    _put(first, "a", 1, b"xyz")
    _put(first, "b", 2, b"12")
    # Changed behind the store's back: counted again at the next start.
    (first.keys_dir / key_dirname("b") / "v2.blob").unlink()
    first.close()
    assert LocalStore(tmp_path / "s").counted_usage() == (1, 3)


def test_a_second_store_on_the_same_directory_is_refused_and_touches_nothing(
        tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = LocalStore(root)
    _put(first, "k", 1, b"kept")
    upload = first.new_temp("upload")
    upload.write_at(0, b"an upload in progress")
    with pytest.raises(DataDirInUse, match=rf"{root}.*in use by another blobha master"
                                           rf" \(pid {os.getpid()}\).*blobstore\.dir"):
        LocalStore(root)
    # The refused one cleaned nothing up: the first store's upload and blob are intact.
    assert upload.path.exists()
    assert b"".join(first.read("k", 1)) == b"kept"
    upload.discard()
    first.close()
    first.close()  # idempotent
    second = LocalStore(root)  # the directory is free once the first lets it go
    assert second.keys() == ["k"]
    second.close()


def test_the_directory_lock_is_released_when_its_process_dies(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "s"
    code = ("import sys, pathlib; from blobha.store.local import LocalStore;"
            " LocalStore(pathlib.Path(sys.argv[1])); print('locked', flush=True);"
            " sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code, str(root)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "locked\n"
        with pytest.raises(DataDirInUse, match=rf"pid {child.pid}\)"):
            LocalStore(root)
    finally:
        child.kill()
        child.wait()
    LocalStore(root).close()  # SIGKILL left no lock behind


def test_a_chunk_resumed_after_a_write_that_failed_part_way_lands_where_it_belongs(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # The disk fills during a chunk: the kernel stores part of it, then refuses the rest. The
    # client resumes from the size the master reports, as documented. Written at the file's
    # position, the resumed bytes landed after the stored part a second time: a shifted file
    # whose digests (kept from the bytes received) matched, so it was committed, then failed
    # its first read and was deleted, the only copy.
    data = _data(3 * 4096 + 100)
    temp = store.new_temp("up")
    temp.write_at(0, data[:4096])
    real_pwrite = os.pwrite
    calls = {"n": 0}

    def full_disk(fd: int, buf: bytes | memoryview, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_pwrite(fd, memoryview(buf)[:1000], offset)  # part of it, then
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_module.os, "pwrite", full_disk)
    with pytest.raises(OSError):
        temp.write_at(4096, data[4096:])
    monkeypatch.setattr(files_module.os, "pwrite", real_pwrite)
    assert temp.size == 4096  # what GetUploadStatus reports
    temp.write_at(temp.size, data[temp.size:])
    info = store.install("k", 1, temp, len(data), digest_bytes(data))
    assert _read(store, "k", 1) == data and info.size == len(data)


def test_finish_drops_bytes_past_the_size_received(store: LocalStore) -> None:
    data = _data(5000)
    temp = store.new_temp("up")
    temp.write_at(0, data)
    os.pwrite(temp._fd, b"stray bytes of a failed write", len(data))
    store.install("k", 1, temp, len(data), digest_bytes(data))
    blob = store.keys_dir / key_dirname("k") / "v1.blob"
    assert blob.stat().st_size == len(data) and _read(store, "k", 1) == data


def test_an_install_whose_record_cannot_be_written_leaves_no_blob_file(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_module, "write_json_atomic", no_space)
    data = _data(5000)
    temp = store.new_temp("up")
    temp.write_at(0, data)
    with pytest.raises(OSError):
        store.install("k", 1, temp, len(data), digest_bytes(data))
    d = store.keys_dir / key_dirname("k")
    assert store.versions("k") == [] and not list(d.glob("v*"))
    assert store.counted_usage()[1] == 0


def test_a_version_replaced_while_read_is_not_taken_for_corrupt(store: LocalStore) -> None:
    # A reader loads v1's record, then the key is deleted and created again at v1 with other
    # bytes before it opens the file: the new bytes fail the old digests. Taken for corruption,
    # the new version (perhaps its only copy) was deleted.
    old, new = _data(3 * CHUNK_SIZE // 2, seed=1), _data(3 * CHUNK_SIZE // 2, seed=2)
    _put(store, "k", 1, old)
    info = store.info("k", 1)  # as the data channel's offer holds it
    assert info is not None
    store.delete_version("k", 1)
    _put(store, "k", 1, new)
    sent: list[int] = []
    with ThreadPoolExecutor(1) as checker, pytest.raises(
            ChecksumMismatch, match="replaced while it was read"):
        store.send_verified(info, 0, info.size, lambda: None,
                            lambda f, pos, n: sent.append(n), checker)
    assert sent == [] and _read(store, "k", 1) == new


def test_on_locked_runs_with_the_lock_held_and_before_anything_is_read(
        tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = LocalStore(root)
    _put(first, "k", 1, b"kept")
    first.close()
    seen: list[object] = []

    def locked() -> None:
        with pytest.raises(DataDirInUse):
            LocalStore(root)  # held already
        seen.append((root / "tmp" / "debris").exists())

    (root / "tmp" / "debris").write_bytes(b"a crashed write's")
    store = LocalStore(root, on_locked=locked)
    assert seen == [True], "called once, before start-up cleaned tmp/"
    assert not (root / "tmp" / "debris").exists()
    assert store.keys() == ["k"]
    store.close()


def test_a_refused_directory_does_not_call_on_locked(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = LocalStore(root)
    called: list[bool] = []
    with pytest.raises(DataDirInUse):
        LocalStore(root, on_locked=lambda: called.append(True))
    assert called == []
    first.close()
