"""The masters' SHA-256 of each chunk: computed once per version however many plans ask at
the same time, from verified reads only, and kept within a bound."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import pytest

from blobha.core.errors import ChecksumMismatch, ResourceExhausted
from blobha.master.chunkhashes import ChunkHashes


class Store:
    def __init__(self) -> None:
        self.versions: dict[tuple[str, int], list[bytes]] = {}
        self.reads = 0
        self.gate = threading.Event()
        self.gate.set()

    def read(self, key: str, seq: int) -> Iterator[bytes]:
        self.reads += 1
        self.gate.wait(10)
        chunks = self.versions[(key, seq)]
        for c in chunks:
            if c == b"rot":
                raise ChecksumMismatch("corrupt")
            yield c


def test_each_chunk_is_hashed_with_sha256() -> None:
    store = Store()
    store.versions[("k", 1)] = [b"a" * 10, b"b" * 3]
    hashes = ChunkHashes(store.read)
    assert hashes.get("k", 1, "d") == (hashlib.sha256(b"a" * 10).digest(),
                                       hashlib.sha256(b"b" * 3).digest())
    assert hashes.get("k", 1, "d") == hashes.get("k", 1, "d")
    assert store.reads == 1


def test_concurrent_plans_share_one_computation() -> None:
    store = Store()
    store.versions[("k", 1)] = [b"x" * 100]
    store.gate.clear()
    hashes = ChunkHashes(store.read)
    results: list[tuple[bytes, ...]] = []
    threads = [threading.Thread(target=lambda: results.append(hashes.get("k", 1, "d")))
               for _ in range(8)]
    for t in threads:
        t.start()
    store.gate.set()
    for t in threads:
        t.join(10)
    assert len(results) == 8 and len(set(results)) == 1
    assert store.reads == 1


def test_a_version_made_again_under_its_number_is_hashed_anew() -> None:
    store = Store()
    store.versions[("k", 1)] = [b"old"]
    hashes = ChunkHashes(store.read)
    old = hashes.get("k", 1, "digest-old")
    store.versions[("k", 1)] = [b"new"]
    assert hashes.get("k", 1, "digest-new") == (hashlib.sha256(b"new").digest(),)
    assert old != hashes.get("k", 1, "digest-new")


def test_a_corrupt_read_is_not_kept_and_every_waiter_hears_of_it() -> None:
    store = Store()
    store.versions[("k", 1)] = [b"ok", b"rot"]
    hashes = ChunkHashes(store.read)
    with pytest.raises(ChecksumMismatch):
        hashes.get("k", 1, "d")
    store.versions[("k", 1)] = [b"ok", b"fine"]
    assert len(hashes.get("k", 1, "d")) == 2
    assert store.reads == 2


def test_the_memory_is_bounded() -> None:
    store = Store()
    for seq in range(10):
        store.versions[("k", seq)] = [bytes([seq])] * 4
    hashes = ChunkHashes(store.read, max_digests=8)
    for seq in range(10):
        hashes.get("k", seq, "d")
    reads = store.reads
    hashes.get("k", 9, "d")  # the newest is kept
    assert store.reads == reads
    hashes.get("k", 0, "d")  # the oldest is not
    assert store.reads == reads + 1


def test_empty_versions_count_towards_the_bound() -> None:
    store = Store()
    for seq in range(20):
        store.versions[("k", seq)] = []
    hashes = ChunkHashes(store.read, max_digests=5)
    for seq in range(20):
        hashes.get("k", seq, "d")
    reads = store.reads
    hashes.get("k", 0, "d")
    assert store.reads == reads + 1  # evicted: empty versions are not kept without bound


def test_versions_hashed_at_once_are_bounded() -> None:
    store = Store()
    for seq in range(3):
        store.versions[("k", seq)] = [b"x"]
    store.gate.clear()
    hashes = ChunkHashes(store.read, max_hashing=2)
    threads = [threading.Thread(target=hashes.get, args=("k", seq, "d")) for seq in range(2)]
    for t in threads:
        t.start()
    from support.waiting import wait_until

    wait_until(lambda: store.reads == 2, 10)
    with pytest.raises(ResourceExhausted, match="hashing other versions"):
        hashes.get("k", 2, "d")
    store.gate.set()
    for t in threads:
        t.join(10)
    assert hashes.get("k", 2, "d") == (hashlib.sha256(b"x").digest(),)
