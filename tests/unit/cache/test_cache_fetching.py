"""The node-local cache (blobha.cache) fetching a blob once per node, checking the cached
copy's integrity, and rebuilding its index after a restart."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import (
    Clock,
    FakeCluster,
    _tar,
    scratch_files,
    version_dirs,
)
from support.waiting import wait_until

from blobha.cache import CachedBlob
from blobha.cache import refs as refs_mod
from blobha.cache import verify as verify_mod
from blobha.core.digest import digest_bytes
from blobha.core.errors import Unavailable


def settle(path: Path) -> None:
    """Wait until the file system's clock has moved past ``path``'s last change.

    Verification records made in the same clock tick as a file's last change are not trusted
    (file systems with coarse timestamps could hide a change within that tick); after this,
    a record made or a change done is in a later tick."""
    probe = path.parent.parent / "settle-probe"

    def moved() -> bool:
        probe.touch()
        return probe.stat().st_mtime_ns > path.stat().st_ctime_ns

    wait_until(moved, timeout=5, what=f"the file system clock to pass {path}'s change time",
               interval=0.001)
    probe.unlink()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files the caches hash from now on."""
    seen: list[Path] = []
    real_hash = verify_mod._hash_file

    def counting(path: Path) -> tuple[str, int, os.stat_result]:
        seen.append(path)
        return real_hash(path)

    monkeypatch.setattr(verify_mod, "_hash_file", counting)
    return seen


def test_get_downloads_once_then_serves_the_cached_copy(fake: FakeCluster, make: Any,
                                                       cache_dir: Path) -> None:
    fake.put("model.bin", b"weights" * 100)
    cache = make()
    first = cache.get("model.bin")
    second = cache.get("model.bin")
    assert first == second
    assert first == CachedBlob("model.bin", 1, 700, digest_bytes(b"weights" * 100), first.path)
    assert first.path == cache_dir / "blobs" / "model.bin" / "v1" / "file" / "model.bin"
    assert first.path.read_bytes() == b"weights" * 100
    assert not first.path.stat().st_mode & 0o222, "cached files are read-only"
    assert fake.downloads == 1
    stats = cache.stats()
    assert (stats.downloads, stats.hits, stats.entries, stats.bytes) == (1, 1, 1, 700)
    assert stats.bytes_downloaded == 700
    assert cache.version("model.bin") == 1
    assert cache.version("other") is None


def test_batched_gets_write_the_counters_once(fake: FakeCluster, make: Any, cache_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("a", b"1")
    fake.put("b", b"2")
    cache = make()
    cache.get("a")
    written: list[Path] = []
    write_atomic = cache._layout.write_atomic

    def recording(path: Path, data: bytes) -> None:
        written.append(path)
        write_atomic(path, data)

    monkeypatch.setattr(cache._layout, "write_atomic", recording)
    with cache.batched_counters():
        with cache.batched_counters():  # nested: the outer one writes
            cache.get("a")
            cache.get("b")
        cache.get("a")
        assert cache.stats().hits == 0, "held until the batch ends"
    assert written.count(cache_dir / "stats.json") == 1
    stats = cache.stats()
    assert (stats.downloads, stats.hits) == (2, 2)
    cache.get("a")  # after the batch: written at once again
    assert cache.stats().hits == 3 and written.count(cache_dir / "stats.json") == 2


def test_threads_asking_at_once_share_one_download(fake: FakeCluster, make: Any) -> None:
    fake.put("big", os.urandom(100_000))
    fake.gate = threading.Event()
    cache = make()
    results: list[CachedBlob] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            results.append(cache.get("big"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: fake.started == 1, what="the first download to start")
    fake.gate.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert fake.started == 1 and fake.downloads == 1
    assert len({r.path for r in results}) == 1 and len(results) == 8
    assert cache.stats().downloads == 1 and cache.stats().hits == 7


def test_two_caches_on_one_directory_share_one_download(fake: FakeCluster, make: Any) -> None:
    # Two instances hold separate flock descriptions, exactly like two processes.
    fake.put("k", b"x" * 5000)
    fake.gate = threading.Event()
    a, b = make(), make()
    got: dict[str, CachedBlob] = {}
    ta = threading.Thread(target=lambda: got.setdefault("a", a.get("k")))
    ta.start()
    wait_until(lambda: fake.started == 1, what="a's download to start")
    tb = threading.Thread(target=lambda: got.setdefault("b", b.get("k")))
    tb.start()
    fake.gate.set()
    ta.join(30)
    tb.join(30)
    assert got["a"].path == got["b"].path
    assert fake.downloads == 1
    assert a.stats().downloads == 1 and b.stats().hits == 1


def test_a_failed_download_leaves_nothing_in_view(fake: FakeCluster, make: Any,
                                                 cache_dir: Path) -> None:
    fake.put("k", b"abcdef" * 1000)
    fake.fail_next = Unavailable("master went away")
    cache = make()
    with pytest.raises(Unavailable):
        cache.get("k")
    assert version_dirs(cache_dir, "k") == []
    assert scratch_files(cache_dir) == []
    assert cache.version("k") is None
    assert cache.get("k").path.read_bytes() == b"abcdef" * 1000


def test_stale_temporaries_of_dead_processes_are_removed_at_start(fake: FakeCluster, make: Any,
                                                                  cache_dir: Path) -> None:
    live = make()
    me = refs_mod.Process.me()
    dead = cache_dir / "tmp" / f"{me.boot[:8]}-{me.pid}-{me.start + 1}-dead"
    (dead / "d-x" / "file").mkdir(parents=True)
    (dead / "d-x" / "file" / ".k.part").write_bytes(b"half")
    junk = cache_dir / "tmp" / "not-a-process"
    junk.write_bytes(b"?")
    live_tmp = live._layout.tmp
    (live_tmp / "d-live").mkdir()
    make()
    assert not dead.exists() and not junk.exists()
    assert (live_tmp / "d-live").exists(), "a live instance's scratch space is left alone"


def test_a_newer_version_committed_during_the_download_is_served(fake: FakeCluster,
                                                                make: Any) -> None:
    fake.put("k", b"one")
    fake.update_during_download = b"two"
    blob = make().get("k")
    assert (blob.version, blob.path.read_bytes()) == (2, b"two")


def test_a_corrupt_cached_file_is_caught_on_first_use_and_fetched_again(
    fake: FakeCluster, make: Any, hashed: list[Path]
) -> None:
    fake.put("k", b"good data" * 100)
    path = make().get("k").path
    path.chmod(0o644)
    path.write_bytes(b"bad data!" * 100)  # same size, other bytes

    other = make()
    blob = other.get("k")
    assert blob.path.read_bytes() == b"good data" * 100
    assert fake.downloads == 2 and len(hashed) == 1
    stats = other.stats()
    assert stats.corrupt == 1 and stats.downloads == 2
    hashed.clear()
    other.get("k")
    assert hashed == [], "a file is verified once per instance"
    assert make().get("k").path.read_bytes() == b"good data" * 100
    assert fake.downloads == 2


def test_a_file_checked_on_the_node_is_not_hashed_again_by_later_instances(
    fake: FakeCluster, make: Any, hashed: list[Path], cache_dir: Path
) -> None:
    fake.put("k", os.urandom(50_000))
    path = make().get("k").path
    assert (path.parent.parent / "verified").exists(), "the download is recorded as checked"
    settle(path)
    make().get("k")  # hashes only if the download's record was made in the change's tick
    hashed.clear()
    for _ in range(3):
        assert make().get("k").path == path
    assert hashed == [], "later instances trust the node's record"
    stats = make().stats()
    assert fake.downloads == 1 and stats.corrupt == 0
    assert stats.verifications <= 1 and stats.hits == 4


def test_a_file_changed_behind_the_records_back_is_verified_again(
    fake: FakeCluster, make: Any, hashed: list[Path]
) -> None:
    good = os.urandom(50_000)
    fake.put("k", good)
    path = make().get("k").path
    settle(path)
    make().get("k")
    settle(path)
    # Same size, and the modification time set back: only the change time (which no program
    # can set) and the content tell.
    before = path.stat()
    path.chmod(0o644)
    path.write_bytes(bytes(b ^ 1 for b in good))
    path.chmod(0o444)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    hashed.clear()

    cache = make()
    assert cache.get("k").path.read_bytes() == good
    assert hashed == [path], "the changed file was hashed, found corrupt and fetched again"
    stats = cache.stats()
    assert (stats.corrupt, stats.downloads, fake.downloads) == (1, 2, 2)
    assert stats.verifications >= 1


def test_the_first_use_after_the_node_restarts_verifies_again(
    fake: FakeCluster, make: Any, hashed: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.put("k", os.urandom(50_000))
    path = make().get("k").path
    settle(path)
    make().get("k")
    hashed.clear()
    make().get("k")
    assert hashed == []
    # Another boot: the records of the previous one prove nothing about the disk now.
    monkeypatch.setattr(verify_mod, "_BOOT_ID", "0123abcd-0000-4000-8000-000000000000")
    assert make().get("k").path == path
    assert hashed == [path]
    settle(path)
    hashed.clear()
    make().get("k")
    assert hashed == [], "recorded again, for this boot"
    assert fake.downloads == 1


def test_a_missing_cached_file_is_fetched_again(fake: FakeCluster, make: Any) -> None:
    fake.put("k", b"data")
    blob = make().get("k")
    blob.path.unlink()
    assert make().get("k").path.read_bytes() == b"data"
    assert fake.downloads == 2


def test_a_key_created_again_with_the_same_version_number_is_fetched_again(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"first life")
    cache = make(update_interval_secs=10)
    assert cache.get("k").path.read_bytes() == b"first life"
    fake.delete("k")
    fake.put("k", b"second life")
    clock.advance(10)
    blob = cache.get("k")
    assert (blob.version, blob.path.read_bytes()) == (1, b"second life")
    assert fake.downloads == 2


def test_a_new_instance_rebuilds_the_index_from_disk(fake: FakeCluster, make: Any,
                                                    cache_dir: Path) -> None:
    fake.put("a", b"a" * 10)
    fake.put("b.tgz", _tar({"x": b"1"}, "w:gz"))
    first = make()
    first.get("a", owner="app")
    first.get("b.tgz", uncompress=True, owner="app")
    before = first.entries()
    first.close()

    again = make()
    assert again.entries() == before
    assert again.version("a") == 1 and again.version("b.tgz") == 1
    assert again.get("a").path.read_bytes() == b"a" * 10
    assert (again.get("b.tgz", uncompress=True).path / "x").read_bytes() == b"1"
    assert fake.downloads == 2
    stats = again.stats()
    assert (stats.downloads, stats.hits, stats.entries) == (2, 2, 2)
    assert again.release("app") == 2
