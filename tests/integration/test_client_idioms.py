"""The Python client's idioms on a real cluster: put (create or update), exists, stat and a
detailed listing, a blob as a file object, and a blob in pieces."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from support.harness import client_for

from blobha.client import Client
from blobha.core.errors import BlobError, ChecksumMismatch, KeyNotFound
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration


def test_put_creates_then_updates(alice: Client, unique_key: str, tmp_path: Path) -> None:
    first = alice.put(unique_key, b"one", acl="u:alice:rwa,o::r")
    assert first.version == 1
    body = tmp_path / "two"
    body.write_bytes(b"two")
    second = alice.put(unique_key, body)
    assert second.version == 2 and alice.read(unique_key) == b"two"


def test_racing_puts_of_a_new_key_both_succeed_one_after_the_other(
        cluster: LocalCluster, unique_key: str) -> None:
    # Both find no key and create; the loser finds it created and writes the next version.
    # File object bodies: the loser's create has read its body, which the update reads again.
    bodies = [os.urandom(4096), os.urandom(4096)]
    start = threading.Barrier(2)
    results: list[int] = []
    errors: list[BaseException] = []

    def writer(body: bytes) -> None:
        with client_for(cluster) as c:
            start.wait()
            try:
                results.append(c.put(unique_key, io.BytesIO(body)).version)
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == [1, 2]
    with client_for(cluster) as c:
        meta = c.stat(unique_key)
        assert meta.version == 2
        assert c.read(unique_key) in bodies
        assert c.read(unique_key, version=1) in bodies


def test_exists_stat_and_a_detailed_listing(alice: Client, unique_key: str) -> None:
    assert not alice.exists(unique_key + "-a")
    a = alice.create(unique_key + "-a", b"a" * 10)
    alice.update(unique_key + "-a", b"a" * 12)
    b = alice.create(unique_key + "-b", b"b" * 5)
    assert alice.exists(unique_key + "-a")
    meta = alice.stat(unique_key + "-a")
    assert (meta.key, meta.version, meta.size) == (unique_key + "-a", 2, 12)
    assert meta.digest and meta.created_at == a.created_at and meta.updated_at >= a.updated_at
    assert meta.replication >= 1
    info = alice.info(unique_key + "-b")  # the alias; replication may grow meanwhile
    assert (info.key, info.version, info.size, info.digest) == (b.key, 1, 5, b.digest)
    listed = list(alice.list(unique_key + "-", detail=True))
    assert [(m.key, m.version, m.size) for m in listed] == [
        (unique_key + "-a", 2, 12), (b.key, 1, 5)]
    assert list(alice.list(unique_key + "-")) == [m.key for m in listed]
    with pytest.raises(KeyNotFound):
        alice.stat(unique_key + "-c")


def test_open_reads_ranges_and_seeks_pinned_to_the_version_open(
        alice: Client, unique_key: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    alice.create(unique_key, data)
    with alice.open(unique_key) as f:
        assert f.seekable() and f.readable() and not f.writable()
        assert f.read(10) == data[:10]
        f.seek(2 * 1024 * 1024)
        assert f.read(100) == data[2 * 1024 * 1024:2 * 1024 * 1024 + 100]
        f.seek(-7, io.SEEK_END)
        assert f.read() == data[-7:]
        assert f.read(5) == b""
        alice.update(unique_key, b"newer")  # the open file keeps to its version
        f.seek(0)
        assert f.read() == data
        assert f.tell() == len(data)
    with alice.open(unique_key, version=1) as f:
        f.seek(5)
        assert f.read(5) == data[5:10]
    with alice.open(unique_key) as f:
        assert f.read() == b"newer"


def test_iter_chunks_yields_one_pinned_version_in_pieces(alice: Client, unique_key: str) -> None:
    data = os.urandom(1024 * 1024 + 5)
    alice.create(unique_key, data)
    pieces = list(alice.iter_chunks(unique_key, chunk_size=256 * 1024))
    assert [len(p) for p in pieces] == [256 * 1024] * 4 + [5]
    assert b"".join(pieces) == data
    chunks = alice.iter_chunks(unique_key, chunk_size=512 * 1024)
    first = next(chunks)
    alice.update(unique_key, b"other")
    assert first + b"".join(chunks) == data  # still the version the iteration began with
    assert list(alice.iter_chunks(unique_key)) == [b"other"]
    assert b"".join(alice.iter_chunks(unique_key, version=1)) == data


def test_a_whole_read_is_checked_against_the_digest(
        alice: Client, unique_key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from blobha.client import reads

    data = os.urandom(100_000)
    alice.create(unique_key, data)
    fetch = reads.fetch_range

    def flipped(*args: object) -> bytes:
        piece = fetch(*args)  # type: ignore[arg-type]
        return bytes([piece[0] ^ 1]) + piece[1:]

    monkeypatch.setattr(reads, "fetch_range", flipped)
    with alice.open(unique_key) as f, pytest.raises(ChecksumMismatch):
        f.read()
    with pytest.raises(ChecksumMismatch):
        list(alice.iter_chunks(unique_key, chunk_size=30_000))
    with alice.open(unique_key) as f:  # a range alone has no whole digest to meet
        f.seek(10)
        assert len(f.read(10)) == 10


def test_errors_read_as_the_matching_built_ins(alice: Client, unique_key: str) -> None:
    with pytest.raises(FileNotFoundError):
        alice.read(unique_key)
    alice.create(unique_key, b"x")
    with pytest.raises(FileExistsError) as exc:
        alice.create(unique_key, b"x")
    assert isinstance(exc.value, BlobError) and str(exc.value) == (
        f"key {unique_key!r} already exists")
