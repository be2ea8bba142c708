"""The node-local cache's updates (scenario 20), references, staged cleanup and eviction
(scenario 19), and making room on a full disk."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import (
    TREE,
    Clock,
    FakeCluster,
    _read_tree,
    _tar,
    scratch_files,
    version_dirs,
)

from blobha.cache import CleanupReport
from blobha.cache import install as install_mod
from blobha.core.errors import (
    InvalidArgument,
    KeyNotFound,
    ResourceExhausted,
)


def test_a_new_version_is_picked_up_and_the_old_one_removed(fake: FakeCluster, make: Any,
                                                           clock: Clock, cache_dir: Path) -> None:
    fake.put("k", b"v1")
    cache = make(update_interval_secs=30)
    assert cache.get("k", owner="job").version == 1
    fake.put("k", b"v2")
    assert cache.get("k", owner="job").version == 1, "not asked again within the interval"
    clock.advance(30)
    blob = cache.get("k", owner="job")
    assert (blob.version, blob.path.read_bytes()) == (2, b"v2")
    assert version_dirs(cache_dir, "k") == ["v2"]
    fake.put("k", b"v3")
    clock.advance(30)
    assert cache.get("k", owner="job").path.read_bytes() == b"v3"
    assert version_dirs(cache_dir, "k") == ["v3"]
    assert cache.stats().removed_versions == 2


def test_an_old_version_stays_while_another_owner_references_it(fake: FakeCluster, make: Any,
                                                               clock: Clock,
                                                               cache_dir: Path) -> None:
    fake.put("k", b"v1")
    reader = make(update_interval_secs=0)
    old = reader.get("k", owner="reader")
    fake.put("k", b"v2")
    assert make(update_interval_secs=0).get("k", owner="job").version == 2
    assert version_dirs(cache_dir, "k") == ["v1", "v2"]
    assert old.path.read_bytes() == b"v1"
    entries = {(e.version, e.current, e.owners) for e in reader.entries()}
    assert entries == {(1, False, ("reader",)), (2, True, ("job",))}
    assert reader.release("reader") == 1
    report = reader.cleanup()
    assert report.removed_versions == (("k", 1),)
    assert version_dirs(cache_dir, "k") == ["v2"]


def test_release_drops_the_owners_references(fake: FakeCluster, make: Any) -> None:
    fake.put("a", b"a")
    fake.put("b", b"b")
    cache = make()
    cache.get("a", owner="app-1")
    cache.get("b", owner="app-1")
    cache.get("b", owner="app-2")
    assert {(e.key, e.refs) for e in cache.entries()} == {("a", 1), ("b", 2)}
    assert make().release("app-1") == 2  # from any instance or process
    assert cache.release("app-1") == 0
    assert {(e.key, e.owners) for e in cache.entries()} == {("a", ()), ("b", ("app-2",))}
    with pytest.raises(InvalidArgument):
        cache.release("")


def test_a_get_without_owner_is_referenced_until_close(fake: FakeCluster, make: Any) -> None:
    fake.put("k", b"data")
    cache = make()
    cache.get("k")
    [entry] = cache.entries()
    assert entry.refs == 1 and entry.owners[0].startswith("instance:")
    cache.close()
    assert make().entries()[0].refs == 0
    with pytest.raises(InvalidArgument, match="closed"):
        cache.get("k")


def test_references_of_dead_processes_are_stale(fake: FakeCluster, make: Any,
                                               cache_dir: Path) -> None:
    fake.put("k", b"data")
    cache = make()
    cache.get("k", owner="app")
    refs = cache_dir / "blobs" / "k" / "refs"
    [mine] = list(refs.iterdir())
    record = json.loads(mine.read_text())
    for name, change in (("restarted", {"start": record["start"] + 1}),
                         ("rebooted", {"boot": "another-boot-id"}),
                         ("gone", {"pid": 2**22 + 12345})):
        (refs / f"o=app@{name}").write_text(json.dumps({**record, **change}))
    assert cache.entries()[0].refs == 1
    report = cache.cleanup()
    assert report.stale_refs == 3
    assert [p.name for p in refs.iterdir()] == [mine.name]


def test_an_unreferenced_entry_goes_on_the_second_pass_after_the_retention(
    fake: FakeCluster, make: Any, clock: Clock, cache_dir: Path
) -> None:
    fake.put("k", b"data")
    cache = make(retention_secs=100, soft_limit_bytes=0)
    cache.get("k", owner="job")
    assert cache.cleanup().staged == (), "referenced: not even staged"
    cache.release("job")
    clock.advance(1)
    assert cache.cleanup().staged == (("k", 1),)
    clock.advance(99.5)
    report = cache.cleanup()
    assert report.evicted == () and report.staged == ()
    # Used again: back to stage one.
    cache.get("k", owner="job")
    cache.release("job")
    clock.advance(1)
    assert cache.cleanup().staged == (("k", 1),)
    clock.advance(100)
    assert cache.cleanup().evicted == (("k", 1),)
    assert cache.version("k") is None
    assert not (cache_dir / "blobs" / "k").exists()
    assert not (cache_dir / "locks" / "k.lock").exists()
    assert cache.stats().evictions == 1


def test_lru_unreferenced_entries_go_first_referenced_never(fake: FakeCluster, make: Any,
                                                           clock: Clock) -> None:
    for key in ("k1", "k2", "k3", "k4"):
        fake.put(key, bytes(100))
    cache = make(soft_limit_bytes=250)
    cache.get("k1", owner="job")
    for key in ("k2", "k3", "k4", "k2"):  # k3 is now the least recently used
        clock.advance(1)
        cache.get(key, owner="tmp")
    cache.release("tmp")
    clock.advance(1)
    first = cache.cleanup()
    assert first.evicted == () and set(first.staged) == {("k2", 1), ("k3", 1), ("k4", 1)}
    report = cache.cleanup()
    assert report.evicted == (("k3", 1), ("k4", 1))
    assert report.total_bytes == 200
    assert {e.key for e in cache.entries()} == {"k1", "k2"}
    tight = make(soft_limit_bytes=0)
    tight.cleanup()
    assert {e.key for e in tight.entries()} == {"k1"}, "the referenced entry is never evicted"


def test_entries_deleted_remotely_go_first_even_below_the_limit(fake: FakeCluster, make: Any,
                                                               clock: Clock) -> None:
    fake.put("old", b"x" * 10)
    fake.put("gone", b"y" * 10)
    cache = make(update_interval_secs=0)
    cache.get("old", owner="t")
    clock.advance(1)
    cache.get("gone", owner="t")
    cache.release("t")
    fake.delete("gone")
    with pytest.raises(KeyNotFound):
        cache.get("gone")
    assert [e.key for e in cache.entries() if e.deleted_remotely] == ["gone"]
    clock.advance(1)
    cache.cleanup()
    assert cache.cleanup().evicted == (("gone", 1),)
    assert [e.key for e in cache.entries()] == ["old"]


def test_over_the_limit_the_cluster_is_asked_which_keys_were_deleted(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("a", b"x" * 100)
    fake.put("b", b"y" * 100)
    cache = make(soft_limit_bytes=150)
    cache.get("a", owner="t")
    clock.advance(1)
    cache.get("b", owner="t")  # the most recently used...
    cache.release("t")
    fake.delete("b")  # ...but deleted remotely, which nobody asked about yet
    clock.advance(1)
    cache.cleanup()
    assert cache.cleanup().evicted == (("b", 1),)


def test_get_runs_cleanup_at_most_every_interval(fake: FakeCluster, make: Any, clock: Clock,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("k", b"data")
    cache = make(retention_secs=600)
    passes: list[float] = []
    real = cache._janitor._cleanup_pass
    monkeypatch.setattr(cache._janitor, "_cleanup_pass",
                        lambda *a: passes.append(clock()) or real(*a))
    for _ in range(3):
        cache.get("k")
        clock.advance(10)
    assert len(passes) == 1, "the first get cleans, then not before 30 s"
    cache.get("k")
    assert len(passes) == 2
    # Another instance on the node (a new Spark Python worker, say) finds that pass recorded
    # in the cache directory: none of its own until its own interval (5 s) has gone by.
    short = make(retention_secs=5)
    real_short = short._janitor._cleanup_pass
    monkeypatch.setattr(short._janitor, "_cleanup_pass",
                        lambda *a: passes.append(clock()) or real_short(*a))
    short.get("k")
    assert len(passes) == 2, "the node made a pass at this very time"
    clock.advance(5)
    short.get("k")
    assert len(passes) == 3
    # A record from the future (the clock was set back) is not believed.
    later = make(retention_secs=600)
    real_later = later._janitor._cleanup_pass
    monkeypatch.setattr(later._janitor, "_cleanup_pass",
                        lambda *a: passes.append(clock()) or real_later(*a))
    os.utime(later.directory / "cleanup.lock", (clock() + 3600, clock() + 3600))
    later.get("k")
    assert len(passes) == 4


def test_a_failed_cleanup_pass_leaves_the_next_process_to_clean(
        fake: FakeCluster, make: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("k", b"data")
    first = make(retention_secs=600)
    first.get("k")  # a pass, recorded at this time
    lock = first.directory / "cleanup.lock"
    recorded = lock.stat().st_mtime
    clock.advance(30)

    def broken(urgent: bool = False) -> CleanupReport:
        raise OSError("disk error")

    monkeypatch.setattr(first._janitor, "_cleanup_pass", broken)
    with pytest.raises(OSError):
        first.cleanup()
    assert lock.stat().st_mtime == recorded, "the failed pass is not recorded as made"
    second = make(retention_secs=600)
    passes: list[float] = []
    real = second._janitor._cleanup_pass
    monkeypatch.setattr(second._janitor, "_cleanup_pass",
                        lambda *a: passes.append(clock()) or real(*a))
    second.get("k")
    assert passes == [clock()]


class _FullDisk:
    """The cache directory's ``write_atomic`` failing with ENOSPC while ``full``; the first
    removal of a cached version (its ``discard``) makes room."""

    def __init__(self, cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        import errno

        self.full = True
        self.refused = 0
        write, discard = cache._layout.write_atomic, cache._layout.discard

        def write_atomic(path: Path, data: bytes) -> None:
            if self.full:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            write(path, data)

        def discard_and_free(path: Path) -> None:
            discard(path)
            if re.fullmatch(r"v\d+", path.name):  # a version's directory, with its bytes
                self.full = False

        monkeypatch.setattr(cache._layout, "write_atomic", write_atomic)
        monkeypatch.setattr(cache._layout, "discard", discard_and_free)


def test_a_full_disk_is_made_room_on_by_evicting_what_nobody_uses(
    fake: FakeCluster, make: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: every get failed with a raw ENOSPC (recording its reference), cache hits too,
    # and cleanup() failed on its first staged marker, so nothing could ever free space.
    fake.put("old", b"o" * 100)
    fake.put("new", b"n" * 100)
    cache = make(retention_secs=100, soft_limit_bytes=10**9)
    cache.get("old", owner="job")
    cache.release("job")
    clock.advance(200)  # unused for longer than the retention, never staged
    disk = _FullDisk(cache, monkeypatch)
    blob = cache.get("new", owner="job")
    assert blob.path.read_bytes() == b"n" * 100
    assert disk.refused >= 1 and cache.version("old") is None


def test_a_full_disk_with_nothing_to_remove_is_a_clear_error(
    fake: FakeCluster, make: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.put("k", b"data")
    cache = make(retention_secs=100)
    cache.get("k", owner="job")  # referenced: never removed
    _FullDisk(cache, monkeypatch)
    with pytest.raises(ResourceExhausted, match=r"disk under .* is full .* free space there"):
        cache.get("k", owner="other")
    report = cache.cleanup()  # counters and staged markers no longer fail the pass
    assert report.evicted == ()


def test_an_unpacked_tree_is_read_only_and_still_evicted_whole(
    fake: FakeCluster, make: Any, clock: Clock, cache_dir: Path
) -> None:
    # Before, its directories were 0755: one job could add or rename files in the tree every
    # later job on the node was handed, and only the archive's digest is checked.
    fake.put("lib.tgz", _tar(TREE, "w:gz"))
    cache = make(soft_limit_bytes=0)
    root = cache.get("lib.tgz", uncompress=True, owner="job").path
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]
    assert len(dirs) == 3 and all(d.stat().st_mode & 0o222 == 0 for d in dirs)
    cache.release("job")
    clock.advance(1)
    cache.cleanup()
    clock.advance(1)
    assert cache.cleanup().evicted == (("lib.tgz", 1),)
    assert not root.exists() and scratch_files(cache_dir) == []
    assert not any((cache_dir / "tmp").rglob("trash-*"))


def test_an_archive_refused_for_want_of_room_gets_room_made_first(
    fake: FakeCluster, make: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk is nearly full of blobs nobody used for longer than the retention, under the
    # soft limit: the unpack that has no room makes some, instead of failing every time.
    fake.put("old", b"o" * 100)
    fake.put("lib.tgz", _tar(TREE, "w:gz"))
    cache = make(retention_secs=100, soft_limit_bytes=10**9)
    cache.get("old", owner="job")
    cache.release("job")
    clock.advance(200)
    room = [0]
    monkeypatch.setattr(install_mod, "_room_to_unpack", lambda path: room[0])
    discard = cache._layout.discard

    def discard_and_free(path: Path) -> None:
        discard(path)
        room[0] = 10**6

    monkeypatch.setattr(cache._layout, "discard", discard_and_free)
    assert _read_tree(cache.get("lib.tgz", uncompress=True).path) == TREE
    assert cache.version("old") is None
