"""Unit tests of the node-local cache (blobha.cache) with a fake client: no network, no processes.

The fake keeps blobs in memory and writes downloads the way the real client does (a temporary
file renamed into place); a fake clock drives retention and update intervals without sleeping.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support.waiting import wait_until

from blobha import cli
from blobha.cache import BlobCache, CachedBlob, CleanupReport, default_cache_dir
from blobha.cache import checks as checks_mod
from blobha.cache import install as install_mod
from blobha.cache import refs as refs_mod
from blobha.cache import verify as verify_mod
from blobha.cli import connect
from blobha.client import BlobInfo, BlobMeta
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    BlobError,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    ResourceExhausted,
    TlsMismatch,
    Unavailable,
)
from blobha.core.keys import key_dirname

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Fakes
# --------------------------------------------------------------------------------------------


@dataclass
class _Blob:
    versions: list[bytes]
    created_at: float
    readers: set[str] | None = None  # None = everyone


@dataclass
class FakeCluster:
    blobs: dict[str, _Blob] = field(default_factory=dict)
    meta_calls: int = 0
    downloads: int = 0
    started: int = 0
    #: When set, downloads wait for it (to hold other askers at the lock).
    gate: threading.Event | None = None
    #: Raised by the next download, after writing half the data.
    fail_next: BaseException | None = None
    #: Raised by every get_meta.
    meta_error: BaseException | None = None
    #: get_meta in a thread of one of these names waits for that thread's event (to hold
    #: other askers at the node's check lock).
    meta_gates: dict[str, threading.Event] = field(default_factory=dict)
    #: get_meta calls in progress.
    meta_inside: int = 0
    #: Committed between the metadata answer and the download (a racing update).
    update_during_download: bytes | None = None
    #: key -> the version the master a client asks first shows (one behind, cut off): served
    #: to a client with no newer minimum, as a real master does; one with a newer minimum is
    #: refused there and served the latest by another master.
    behind: dict[str, int] = field(default_factory=dict)
    _created: float = 1000.0

    def put(self, key: str, data: bytes, readers: set[str] | None = None) -> int:
        blob = self.blobs.get(key)
        if blob is None:
            self._created += 1
            self.blobs[key] = _Blob([data], self._created, readers)
            return 1
        blob.versions.append(data)
        if readers is not None:
            blob.readers = readers
        return len(blob.versions)

    def delete(self, key: str) -> None:
        del self.blobs[key]

    def client(self, user: str = "alice") -> FakeClient:
        return FakeClient(self, user)


class FakeClient:
    def __init__(self, cluster: FakeCluster, user: str) -> None:
        self.cluster = cluster
        self.user = user
        self.closed = False
        #: key -> (created_at, version): the client's read minimum (remember_version, reads).
        self.minimums: dict[str, tuple[float, int]] = {}

    def remember_version(self, key: str, version: int, created_at: float) -> None:
        order = (created_at, version)
        self.minimums[key] = max(order, self.minimums.get(key, order))

    def _number(self, key: str, blob: _Blob) -> int:
        """The version this client is answered: the lagging master's, unless its minimum is
        newer (then another master answers)."""
        lag = self.cluster.behind.get(key)
        latest = len(blob.versions)
        if lag is None or self.minimums.get(key, (0.0, 0)) > (blob.created_at, lag):
            number = latest
        else:
            number = lag
        self.remember_version(key, number, blob.created_at)
        return number

    def _blob(self, key: str) -> _Blob:
        blob = self.cluster.blobs.get(key)
        if blob is None:
            raise KeyNotFound(f"no blob with key {key!r}")
        if blob.readers is not None and self.user not in blob.readers:
            raise NotAuthorized(f"{self.user} may not read {key!r}")
        return blob

    def get_meta(self, key: str) -> BlobMeta:
        c = self.cluster
        c.meta_calls += 1
        gate = c.meta_gates.get(threading.current_thread().name)
        if gate is not None:
            c.meta_inside += 1
            try:
                assert gate.wait(30), "the test never opened the gate"
            finally:
                c.meta_inside -= 1
        if c.meta_error is not None:
            raise c.meta_error
        blob = self._blob(key)
        number = self._number(key, blob)
        data = blob.versions[number - 1]
        return BlobMeta(key, number, len(data), digest_bytes(data), (), 3, 1,
                        blob.created_at, blob.created_at, "alice", 3)

    def download(self, key: str, dest: str | os.PathLike[str], version: int = 0,
                 **_: Any) -> BlobInfo:
        c = self.cluster
        c.started += 1
        if c.update_during_download is not None:
            c.put(key, c.update_during_download)
            c.update_during_download = None
        blob = self._blob(key)
        number = version or self._number(key, blob)
        data = blob.versions[number - 1]
        path = Path(dest)
        tmp = path.with_name(f".{path.name}.part")
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
            if c.fail_next is not None:
                error, c.fail_next = c.fail_next, None
                raise error
            if c.gate is not None:
                assert c.gate.wait(30), "the test never opened the gate"
            f.write(data[len(data) // 2 :])
        os.replace(tmp, path)
        c.downloads += 1
        return BlobInfo(number, len(data), digest_bytes(data))

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


@pytest.fixture
def fake() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def make(fake: FakeCluster, clock: Clock, cache_dir: Path) -> Iterator[Callable[..., BlobCache]]:
    """Builds caches on ``cache_dir`` (alice, fake clock, no retention by default)."""
    made: list[BlobCache] = []

    def build(user: str = "alice", **kw: Any) -> BlobCache:
        kw.setdefault("retention_secs", 0.0)
        kw.setdefault("clock", clock)
        if "connect" in kw:
            kw["user"] = user
        else:
            kw.setdefault("client", fake.client(user))
        c = BlobCache(kw.pop("directory", cache_dir), **kw)
        made.append(c)
        return c

    yield build
    for c in made:
        c.close()


def version_dirs(cache_dir: Path, key: str) -> list[str]:
    d = cache_dir / "blobs" / key_dirname(key)
    return sorted(p.name for p in d.glob("v*")) if d.exists() else []


def scratch_files(cache_dir: Path) -> list[Path]:
    return [p for p in (cache_dir / "tmp").rglob("*") if p.is_file()]


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


@pytest.fixture
def lock_waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads that went to wait for a check lock (``blobs/<key dir>/asking/<user>``)."""
    waits: list[str] = []
    real_lock_file = checks_mod.lock_file

    def recording(path: Path, blocking: bool) -> int | None:
        if blocking and path.parent.name == "asking":
            waits.append(threading.current_thread().name)
        return real_lock_file(path, blocking)

    monkeypatch.setattr(checks_mod, "lock_file", recording)
    return waits


# --------------------------------------------------------------------------------------------
# Fetching, once per node
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Integrity
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Authorisation (scenario 21)
# --------------------------------------------------------------------------------------------


def test_a_user_without_read_never_gets_a_cached_file(fake: FakeCluster, make: Any) -> None:
    fake.put("secret", b"s3cr3t", readers={"alice"})
    assert make("alice").get("secret").path.read_bytes() == b"s3cr3t"
    bob = make("bob", update_interval_secs=3600)
    for _ in range(2):
        with pytest.raises(NotAuthorized):
            bob.get("secret")
    assert fake.downloads == 1
    assert bob.stats().hits == 0


def test_revoked_read_is_noticed_within_the_update_interval(fake: FakeCluster, make: Any,
                                                           clock: Clock) -> None:
    fake.put("k", b"data", readers={"alice", "carol"})
    carol = make("carol", update_interval_secs=30)
    carol.get("k")
    fake.blobs["k"].readers = {"alice"}
    clock.advance(29)
    carol.get("k")  # checked at most every 30 s: still within the interval
    clock.advance(1)
    with pytest.raises(NotAuthorized):
        carol.get("k")


def test_the_cluster_is_asked_at_most_once_per_interval(fake: FakeCluster, make: Any,
                                                       clock: Clock) -> None:
    fake.put("k", b"data")
    cache = make(update_interval_secs=30)
    for _ in range(5):
        cache.get("k")
    assert fake.meta_calls == 1
    clock.advance(30)
    cache.get("k")
    assert fake.meta_calls == 2


def lazy(fake: FakeCluster, make: Any, user: str, **kw: Any) -> tuple[BlobCache, list[str]]:
    """A cache that connects only when it must (as the Spark executors' do), and the users it
    connected as."""
    connected: list[str] = []

    def connect() -> FakeClient:
        connected.append(user)
        return fake.client(user)

    return make(user, connect=connect, **kw), connected


def test_a_new_process_within_the_interval_needs_no_round_trip(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"data")
    make(update_interval_secs=30).get("k")
    assert fake.meta_calls == 1
    clock.advance(20)
    later, connected = lazy(fake, make, "alice", update_interval_secs=30)
    assert later.get("k").path.read_bytes() == b"data"
    assert connected == [] and fake.meta_calls == 1, "the node's record answered"
    stats = later.stats()
    assert (stats.hits, stats.checks) == (1, 1)


def test_processes_finding_the_record_aged_together_ask_the_cluster_once(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The executors of a new application, once the last answer has aged: one asks (and loads
    # the client), the others wait for its answer on the node, and for the version it was told
    # of to be installed. Two instances hold separate flock descriptions, exactly like two
    # processes.
    fake.put("k", b"v1")
    make(update_interval_secs=30).get("k")
    fake.put("k", b"v2")
    clock.advance(31)
    downloads_when_b_went_on: list[int] = []
    waiting_lock_file = checks_mod.lock_file

    def watching(path: Path, blocking: bool) -> int | None:
        fd = waiting_lock_file(path, blocking)
        if blocking and path.parent.name == "asking":
            downloads_when_b_went_on.append(fake.downloads)
        return fd

    monkeypatch.setattr(checks_mod, "lock_file", watching)
    a, a_connected = lazy(fake, make, "alice", update_interval_secs=30)
    b, b_connected = lazy(fake, make, "alice", update_interval_secs=30)
    fake.meta_gates = {"a": threading.Event()}
    got: dict[str, CachedBlob] = {}
    ta = threading.Thread(target=lambda: got.setdefault("a", a.get("k")), name="a")
    ta.start()
    wait_until(lambda: fake.meta_calls == 2, what="a to ask the cluster")
    tb = threading.Thread(target=lambda: got.setdefault("b", b.get("k")), name="b")
    tb.start()
    wait_until(lambda: lock_waits == ["b"], what="b to wait for the check lock")
    fake.meta_gates["a"].set()
    ta.join(30)
    tb.join(30)
    assert (got["a"].version, got["b"].version) == (2, 2)
    assert got["b"].path.read_bytes() == b"v2"
    assert fake.meta_calls == 2, "b took a's answer"
    assert downloads_when_b_went_on == [2], "b went on once a had installed version 2"
    assert (a_connected, b_connected) == (["alice"], []), "b needed no client, not even to download"
    assert fake.downloads == 2 and b.stats().checks == 2


def _get_in_threads(make_cache: Callable[[str], BlobCache], names: str
                    ) -> tuple[dict[str, threading.Thread], dict[str, CachedBlob],
                               dict[str, BaseException]]:
    """A thread per name, each getting "k" from a cache of its own; not started."""
    got: dict[str, CachedBlob] = {}
    errors: dict[str, BaseException] = {}

    def get(name: str) -> None:
        try:
            got[name] = make_cache(name).get("k")
        except BaseException as exc:
            errors[name] = exc

    threads = {n: threading.Thread(target=get, args=(n,), name=n) for n in names}
    return threads, got, errors


def test_after_an_asker_that_got_no_answer_the_others_ask_in_parallel(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str]
) -> None:
    # With the cluster unreachable each question takes the client's whole timeout: the
    # processes that waited for the one that got no answer must not then take turns. (Each
    # then serves the cached copy on the node's record of the cluster's last answer to alice.)
    fake.put("k", b"v1")
    make(update_interval_secs=30).get("k")
    clock.advance(31)
    fake.meta_error = Unavailable("no master answers")
    fake.meta_gates = {name: threading.Event() for name in "abc"}
    threads, _, errors = _get_in_threads(
        lambda _: lazy(fake, make, "alice", update_interval_secs=30)[0], "abc")
    threads["a"].start()
    wait_until(lambda: fake.meta_inside == 1, what="a to ask the cluster")
    threads["b"].start()
    threads["c"].start()
    wait_until(lambda: sorted(lock_waits) == ["b", "c"], what="b and c to wait for a")
    fake.meta_gates["a"].set()
    wait_until(lambda: fake.meta_inside == 2, what="b and c to ask at the same time")
    fake.meta_gates["b"].set()
    fake.meta_gates["c"].set()
    for t in threads.values():
        t.join(30)
    assert errors == {}
    assert fake.meta_calls == 4


@pytest.mark.parametrize("refusal", [NotAuthorized, KeyNotFound])
def test_a_refusal_is_not_shared_through_the_check_lock(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str], cache_dir: Path,
    refusal: type[Exception]
) -> None:
    fake.put("k", b"data", readers={"alice"})
    make("alice", update_interval_secs=30).get("k")
    if refusal is NotAuthorized:
        fake.blobs["k"].readers = set()
    else:
        fake.delete("k")
    clock.advance(31)
    fake.meta_gates = {"a": threading.Event()}
    threads, _, errors = _get_in_threads(
        lambda _: lazy(fake, make, "alice", update_interval_secs=30)[0], "ab")
    threads["a"].start()
    wait_until(lambda: fake.meta_inside == 1, what="a to ask the cluster")
    threads["b"].start()
    wait_until(lambda: lock_waits == ["b"], what="b to wait for a")
    fake.meta_gates["a"].set()
    for t in threads.values():
        t.join(30)
    assert sorted(errors) == ["a", "b"]
    assert all(isinstance(e, refusal) for e in errors.values())
    assert fake.meta_calls == 3, "b asked for itself: a had no answer to share"
    kdir = cache_dir / "blobs" / key_dirname("k")
    assert not (kdir / "checks" / "alice").exists()


def test_users_do_not_wait_for_each_others_questions(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str]
) -> None:
    fake.put("k", b"data")
    make("alice", update_interval_secs=30).get("k")
    make("bob", update_interval_secs=30).get("k")
    clock.advance(31)
    fake.meta_gates = {"alice": threading.Event()}
    alice, bob = (lazy(fake, make, u, update_interval_secs=30)[0] for u in ("alice", "bob"))
    got: dict[str, CachedBlob] = {}
    ta = threading.Thread(target=lambda: got.setdefault("alice", alice.get("k")), name="alice")
    ta.start()
    wait_until(lambda: fake.meta_inside == 1, what="alice's process to ask the cluster")
    # Asked from this thread while alice's question hangs: it would wait, and the gate time out,
    # if the users shared a lock.
    assert bob.get("k").path.read_bytes() == b"data"
    assert lock_waits == []
    fake.meta_gates["alice"].set()
    ta.join(30)
    assert got["alice"].path.read_bytes() == b"data"
    assert fake.meta_calls == 4


def test_a_recorded_check_counts_from_when_the_cluster_answered(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"v1")
    make(update_interval_secs=30).get("k", owner="app-1")
    fake.put("k", b"v2")
    clock.advance(20)
    second, connected = lazy(fake, make, "alice", update_interval_secs=30)
    assert second.get("k", owner="app-2").version == 1, "within the interval of the answer"
    clock.advance(10)  # 30 s after the cluster's answer, 10 s after this instance started
    blob = second.get("k", owner="app-2")
    assert (blob.version, blob.path.read_bytes()) == (2, b"v2")
    assert connected == ["alice"] and fake.meta_calls == 2


def test_a_user_without_read_is_refused_from_a_warm_cache(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("secret", b"s3cr3t", readers={"alice"})
    make("alice", update_interval_secs=3600).get("secret")
    bob, connected = lazy(fake, make, "bob", update_interval_secs=3600)
    for _ in range(2):
        with pytest.raises(NotAuthorized):
            bob.get("secret")
    assert connected == ["bob"], "alice's record does not answer for bob"
    assert fake.meta_calls == 3 and fake.downloads == 1
    assert bob.stats().hits == 0


def test_a_revoked_read_reaches_new_processes_within_the_interval(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"data", readers={"alice", "carol"})
    make("carol", update_interval_secs=30).get("k")
    fake.blobs["k"].readers = {"alice"}
    clock.advance(29)
    lazy(fake, make, "carol", update_interval_secs=30)[0].get("k")  # the answer is 29 s old
    clock.advance(1)
    with pytest.raises(NotAuthorized):
        lazy(fake, make, "carol", update_interval_secs=30)[0].get("k")
    # The refusal removed carol's record: no process of hers is served from it any more, even
    # one that counts a longer interval.
    late, connected = lazy(fake, make, "carol", update_interval_secs=3600)
    with pytest.raises(NotAuthorized):
        late.get("k")
    assert connected == ["carol"]


@pytest.mark.parametrize("outage", [
    Unavailable("no master answered"),
    # No master accepts this client's TLS settings (its CA was replaced, say): that says
    # nothing of what alice may read, so it must not make the cache forget it.
    TlsMismatch("no TLS connection to master m1:1: its certificate did not verify"),
])
def test_an_unreachable_cluster_serves_what_this_user_was_allowed_to_read(
    fake: FakeCluster, make: Any, clock: Clock, outage: BlobError
) -> None:
    fake.put("k", b"data")
    fake.put("never-checked", b"other")
    cache = make(update_interval_secs=1)
    cache.get("k")
    make("bob").get("never-checked")
    fake.meta_error = outage
    clock.advance(5)
    assert cache.get("k").path.read_bytes() == b"data"
    with pytest.raises(type(outage)):
        cache.get("never-checked")  # cached, but the cluster never said alice may read it
    # A process started during the outage (a new Spark worker) has no answer of its own: the
    # node's record of the cluster's last answer to alice serves. Before, it failed.
    assert make(update_interval_secs=1).get("k").path.read_bytes() == b"data"


# --------------------------------------------------------------------------------------------
# Updates (scenario 20)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Staged cleanup and eviction (scenario 19)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Restart (scenario 22)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Unpacking (scenario 18) and its safety
# --------------------------------------------------------------------------------------------


def _tar(files: dict[str, bytes], mode: str = "w") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tf:  # type: ignore[call-overload]
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _tar_members(*members: tuple[str, bytes, str, str]) -> bytes:
    """Members as (name, data, type, linkname) with type one of f, d, sym, hard, chr, fifo."""
    types = {"f": tarfile.REGTYPE, "d": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
             "hard": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for name, data, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type = types[kind]
            info.linkname = link
            info.size = len(data) if kind == "f" else 0
            tf.addfile(info, io.BytesIO(data) if kind == "f" else None)
    return out.getvalue()


def _zip(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return out.getvalue()


TREE = {"top.txt": b"top", "dir/a.bin": b"\x00\x01", "dir/sub/run.sh": b"#!/bin/sh\n"}


def _read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("key, data", [
    ("lib.tgz", _tar(TREE, "w:gz")),
    ("lib.tar.gz", _tar(TREE, "w:gz")),
    ("lib.tar", _tar(TREE)),
    ("lib.zip", _zip(TREE)),
    ("lib.jar", _zip(TREE)),
    ("no-extension-tar", _tar(TREE, "w:gz")),
    ("no-extension-zip", _zip(TREE)),
])
def test_archives_unpack_to_the_expected_tree(fake: FakeCluster, make: Any, key: str,
                                             data: bytes) -> None:
    fake.put(key, data)
    cache = make()
    blob = cache.get(key, uncompress=True)
    assert blob.path.is_dir() and blob.path.name == "unpacked"
    assert _read_tree(blob.path) == TREE
    if key.endswith(("tgz", "gz", "tar")):
        assert (blob.path / "dir/sub/run.sh").stat().st_mode & 0o111
    assert cache.get(key).path.read_bytes() == data, "the archive itself stays available"
    assert cache.get(key, uncompress=True).path == blob.path
    [entry] = cache.entries()
    assert entry.unpacked == blob.path and entry.size == len(data) + sum(map(len, TREE.values()))


def test_links_inside_the_tree_are_kept(fake: FakeCluster, make: Any) -> None:
    fake.put("links.tar", _tar_members(
        ("d/file", b"content", "f", ""),
        ("d/hard", b"", "hard", "d/file"),
        ("d/rel", b"", "sym", "file"),
        ("up", b"", "sym", "d/../d/file"),
        ("sub/dirlink", b"", "sym", "../d"),
    ))
    root = make().get("links.tar", uncompress=True).path
    assert (root / "d/hard").read_bytes() == b"content"
    assert os.readlink(root / "d/rel") == "file" and (root / "d/rel").read_bytes() == b"content"
    assert (root / "up").read_bytes() == b"content"
    assert (root / "sub/dirlink/file").read_bytes() == b"content"


def _outside(tmp_path: Path) -> Path:
    return tmp_path / "outside"


# Extraction happens in cache/tmp/<instance>/x-*/: four levels below tmp_path.
ESCAPE = "../../../../outside/evil"

MALICIOUS_TARS = {
    "dotdot": lambda out: _tar_members(("ok", b"1", "f", ""), (ESCAPE, b"evil", "f", "")),
    "dotdot-inside": lambda out: _tar_members(("a/../../evil", b"evil", "f", "")),
    "absolute": lambda out: _tar_members((str(out / "evil"), b"evil", "f", "")),
    "symlink-to-etc-passwd": lambda out: _tar_members(("passwd", b"", "sym", "/etc/passwd")),
    "symlink-relative-escape": lambda out: _tar_members(("up", b"", "sym", "../../../../..")),
    "symlink-chain-escape": lambda out: _tar_members(
        ("d/l", b"", "sym", ".."), ("e", b"", "sym", "d/l/../../../../outside")),
    # Lexically inside ("d/l/.." is "d"), really the parent of the tree: only the file system
    # can tell.
    "symlink-chain-escape-hidden": lambda out: _tar_members(
        ("d/l", b"", "sym", ".."), ("e", b"", "sym", "d/l/..")),
    "write-through-symlink": lambda out: _tar_members(
        ("link", b"", "sym", "."), ("link/evil", b"evil", "f", "")),
    "hardlink-outside": lambda out: _tar_members(("h", b"", "hard", "/etc/passwd")),
    "hardlink-dotdot": lambda out: _tar_members(("h", b"", "hard", ESCAPE)),
    "hardlink-to-symlink": lambda out: _tar_members(
        ("s", b"", "sym", "x"), ("h", b"", "hard", "s")),
    "device": lambda out: _tar_members(("null", b"", "chr", "")),
    "fifo": lambda out: _tar_members(("pipe", b"", "fifo", "")),
}

MALICIOUS_ZIPS = {
    "dotdot": lambda out: _zip({ESCAPE: b"evil"}),
    "backslash-dotdot": lambda out: _zip({"..\\..\\..\\..\\outside\\evil": b"evil"}),
    "absolute": lambda out: _zip({str(out / "evil"): b"evil"}),
    "symlink-to-etc-passwd": lambda out: _zip({}, {"passwd": "/etc/passwd"}),
    "symlink-escape": lambda out: _zip({}, {"up": "../../../../outside"}),
}


@pytest.mark.parametrize("kind, name", [("tar", n) for n in MALICIOUS_TARS]
                         + [("zip", n) for n in MALICIOUS_ZIPS])
def test_malicious_archives_are_refused_and_nothing_is_written_outside(
    fake: FakeCluster, make: Any, tmp_path: Path, cache_dir: Path, kind: str, name: str
) -> None:
    outside = _outside(tmp_path)
    outside.mkdir()
    build = MALICIOUS_TARS[name] if kind == "tar" else MALICIOUS_ZIPS[name]
    key = f"evil-{name}.{kind}"
    fake.put(key, build(outside))
    cache = make()
    with pytest.raises(InvalidArgument, match="refusing to unpack"):
        cache.get(key, uncompress=True)
    assert list(outside.iterdir()) == []
    assert not (cache_dir / "blobs" / key / "v1" / "unpacked").exists()
    assert scratch_files(cache_dir) == [] and not any(
        p.is_symlink() for p in (cache_dir / "tmp").rglob("*"))
    assert cache.get(key).path.is_file(), "the blob itself is still served"


def test_non_archives_cannot_be_unpacked(fake: FakeCluster, make: Any) -> None:
    fake.put("plain.bin", b"not an archive")
    fake.put("liar.zip", _tar(TREE))
    cache = make()
    with pytest.raises(InvalidArgument, match="neither a tar"):
        cache.get("plain.bin", uncompress=True)
    with pytest.raises(InvalidArgument, match="not a zip archive"):
        cache.get("liar.zip", uncompress=True)


def test_a_truncated_archive_is_refused(fake: FakeCluster, make: Any) -> None:
    data = _tar({"f": os.urandom(50_000)}, "w:gz")
    fake.put("cut.tgz", data[: len(data) // 2])
    with pytest.raises(InvalidArgument, match=r"cut\.tgz"):
        make().get("cut.tgz", uncompress=True)


# --------------------------------------------------------------------------------------------
# Names, arguments, directory
# --------------------------------------------------------------------------------------------


def test_unusual_keys_get_safe_names(fake: FakeCluster, make: Any) -> None:
    long_key = "x" * 300 + ".tar.gz"
    for key in ("données 2024.csv", long_key, ".hidden", "-dash"):
        fake.put(key, key.encode())
    cache = make()
    for key in ("données 2024.csv", ".hidden", "-dash"):
        assert cache.get(key).path.name == key
    path = cache.get(long_key).path
    assert path.name.startswith("h-") and path.name.endswith(".tar.gz")
    assert path.read_bytes() == long_key.encode()
    assert {e.key for e in cache.entries()} == {"données 2024.csv", long_key, ".hidden", "-dash"}


@pytest.mark.parametrize("kw", [{"soft_limit_bytes": -1}, {"retention_secs": -1.0},
                                {"update_interval_secs": float("nan")}])
def test_bad_settings_are_refused(fake: FakeCluster, cache_dir: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        BlobCache(cache_dir, client=fake.client(), **kw)  # type: ignore[arg-type]


def test_cluster_and_user_arguments(fake: FakeCluster, cache_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOBHA_CLUSTER", raising=False)
    with pytest.raises(InvalidArgument, match="BLOBHA_CLUSTER"):
        BlobCache(cache_dir)
    with pytest.raises(InvalidArgument, match="differs"):
        BlobCache(cache_dir, client=fake.client("alice"), user="bob")  # type: ignore[arg-type]
    monkeypatch.setenv("BLOBHA_CLUSTER", "127.0.0.1:1")
    with BlobCache(cache_dir, user="carol") as c:
        assert c.user == "carol"


def test_a_foreign_directory_is_not_adopted(fake: FakeCluster, tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="not a blobha cache"):
        BlobCache(tmp_path / "home", client=fake.client())  # type: ignore[arg-type]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "LAYOUT").write_text("blobha-cache 99\n")
    with pytest.raises(InvalidArgument, match="another format"):
        BlobCache(tmp_path / "other", client=fake.client())  # type: ignore[arg-type]


def test_a_cache_root_another_account_owns_is_refused(
        fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Made by someone else before us (a shared path under /tmp): whoever owns it reads and
    # changes what we cache there, so it is refused before anything in it is looked at.
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / "LAYOUT").write_text("blobha-cache 1\n")  # planted: looks like a cache
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)  # nobody
    else:
        # Our own directory seen by another account: the same check, from its side.
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(InvalidArgument) as refused:
        BlobCache(root, client=fake.client())  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"{root} belongs to another account" in message and "--cache-dir" in message
    assert sorted(os.listdir(root)) == ["LAYOUT"]  # nothing made in it


def test_a_root_owned_shared_cache_root_is_used_unless_everyone_may_change_it(
        fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("a directory that root owns needs root to make")
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o770)  # an administrator's cache for a group, owned by root
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # seen by a member of the group
    with BlobCache(root, client=fake.client()):  # type: ignore[arg-type]
        pass
    root.chmod(0o777)
    with pytest.raises(InvalidArgument, match=r"changed by every account \(mode 0777\)"):
        BlobCache(root, client=fake.client())  # type: ignore[arg-type]


def test_bad_keys_and_owners_are_refused(fake: FakeCluster, make: Any) -> None:
    cache = make()
    with pytest.raises(InvalidArgument):
        cache.get("a/b")
    with pytest.raises(InvalidArgument):
        cache.get("k", owner="")


def test_an_instance_refuses_to_work_in_a_forked_child(fake: FakeCluster, make: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("k", b"data")
    cache = make()
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    with pytest.raises(InvalidArgument, match="forked child"):
        cache.get("k")
    assert fake.meta_calls == 0


def test_connect_makes_the_client_when_first_needed_and_the_cache_owns_it(
    fake: FakeCluster, cache_dir: Path
) -> None:
    fake.put("k", b"data")
    made: list[FakeClient] = []

    def connect() -> FakeClient:
        made.append(fake.client("alice"))
        return made[-1]

    with BlobCache(cache_dir, user="alice", connect=connect) as cache:  # type: ignore[arg-type]
        assert made == [] and cache.user == "alice"
        cache.get("k")
        cache.get("k")
        assert len(made) == 1
    assert made[0].closed, "a client made through connect belongs to the cache"
    with BlobCache(cache_dir, connect=connect) as cache:  # type: ignore[arg-type]
        assert len(made) == 2, "without a user, only the client can tell who we are"
        assert cache.user == "alice"
    with pytest.raises(InvalidArgument, match="not both"):
        BlobCache(cache_dir, client=fake.client(), connect=connect)  # type: ignore[arg-type]
    bob = BlobCache(cache_dir, user="bob", connect=connect)  # type: ignore[arg-type]
    with bob, pytest.raises(InvalidArgument, match="serves 'bob'"):
        bob.get("k")


def test_an_injected_client_is_left_open(fake: FakeCluster,
                                                        cache_dir: Path) -> None:
    client = fake.client()
    with BlobCache(cache_dir, client=client):  # type: ignore[arg-type]
        pass
    assert not client.closed, "an injected client belongs to the caller"


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BLOBHA_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("BLOBHA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "blobha"


# --------------------------------------------------------------------------------------------
# blobha fetch
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fetch(fake: FakeCluster, monkeypatch: pytest.MonkeyPatch,
          capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.setattr(connect, "client_factory",
                        lambda cluster, user: fake.client(user or "alice"))

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["fetch", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_fetch_prints_key_version_path(fake: FakeCluster, fetch: Any, cache_dir: Path) -> None:
    fake.put("a", b"A")
    fake.put("b.zip", _zip({"f": b"F"}))
    code, out, err = fetch("a", "b.zip", "--cache-dir", str(cache_dir))
    assert (code, err) == (0, "")
    lines = [line.split("\t") for line in out.splitlines()]
    assert [(k, v) for k, v, _ in lines] == [("a", "1"), ("b.zip", "1")]
    assert Path(lines[0][2]).read_bytes() == b"A"
    code, out, _ = fetch("b.zip", "--cache-dir", str(cache_dir), "--uncompress", "--json")
    assert code == 0
    [item] = json.loads(out)
    assert item["key"] == "b.zip" and item["version"] == 1
    assert (Path(item["path"]) / "f").read_bytes() == b"F"
    assert fake.downloads == 2


def test_fetch_uses_blobha_cache_dir(fake: FakeCluster, fetch: Any, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("a", b"A")
    monkeypatch.setenv("BLOBHA_CACHE_DIR", str(tmp_path / "env-cache"))
    code, out, _ = fetch("a")
    assert code == 0 and out.split("\t")[2].strip().startswith(str(tmp_path / "env-cache"))


def test_fetch_errors_are_one_line_with_the_usual_exit_codes(fake: FakeCluster, fetch: Any,
                                                            cache_dir: Path) -> None:
    fake.put("secret", b"s", readers={"alice"})
    fake.put("plain", b"p")
    code, out, err = fetch("missing", "--cache-dir", str(cache_dir))
    assert code == KeyNotFound.exit_code and out == ""
    assert err.startswith("blobha: error:") and err.count("\n") == 1
    code, _, err = fetch("secret", "--cache-dir", str(cache_dir), "--user", "bob")
    assert code == NotAuthorized.exit_code and "bob" in err
    code, _, err = fetch("plain", "--cache-dir", str(cache_dir), "--uncompress")
    assert code == InvalidArgument.exit_code and err.count("\n") == 1
    code, _, _ = fetch("--cache-dir", str(cache_dir))
    assert code == 2


def test_an_archive_that_expands_past_the_room_on_disk_is_refused_while_unpacking(
    fake: FakeCluster, make: Any, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 MiB of zeros in about 64 KiB: with 8 MiB of room, unpacking stops at 8 MiB instead of
    # filling the disk (a 1 MiB archive unpacked to 1 GiB before).
    bomb = _tar({"zeros.bin": bytes(64 * 1024 * 1024)}, "w:gz")
    assert len(bomb) < 1024 * 1024
    fake.put("bomb.tgz", bomb)
    monkeypatch.setattr(install_mod, "_room_to_unpack", lambda path: 8 * 1024 * 1024)
    cache = make()
    with pytest.raises(ResourceExhausted, match="expands to more than the 8,388,608 bytes"):
        cache.get("bomb.tgz", uncompress=True)
    assert not (cache_dir / "blobs" / "bomb.tgz" / "v1" / "unpacked").exists()
    assert scratch_files(cache_dir) == []
    assert cache.get("bomb.tgz").path.read_bytes() == bomb, "the blob itself is still served"


def test_the_room_to_unpack_leaves_a_margin_of_the_disk_free(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    margin = min(install_mod.UNPACK_MARGIN_BYTES, total // 20)
    # Other writers may move the free space between the two looks.
    assert abs(install_mod._room_to_unpack(tmp_path) - max(0, free - margin)) < 64 * 1024 * 1024


@pytest.mark.parametrize("name, build", [("many.tar", _tar), ("many.zip", _zip)])
def test_an_archive_with_too_many_members_is_refused(tmp_path: Path, name: str,
                                                     build: Any) -> None:
    from blobha.cache.unpack import unpack

    archive = tmp_path / name
    archive.write_bytes(build({f"f{i}": b"x" for i in range(11)}))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match="more than 10 members"):
        unpack(archive, name, dest, max_members=10)
    if name.endswith(".zip"):
        assert list(dest.iterdir()) == []  # a zip's count is known before anything is written


def _no_zipfile(*args: object, **kw: object) -> None:
    raise AssertionError("zipfile read the central directory")


@pytest.mark.parametrize("members, limit, match", [(10, 10**9, "more than 10 members"),
                                                   (100, 200, "central directory takes")])
def test_a_zips_directory_is_judged_before_zipfile_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, members: int, limit: int, match: str
) -> None:
    # zipfile reads the whole directory into memory (about 600 bytes per entry) on opening:
    # a zip of millions of tiny entries would exhaust an executor before any count.
    import blobha.cache.unpack as unpack_mod

    archive = tmp_path / "many.zip"
    archive.write_bytes(_zip({f"f{i}": b"" for i in range(11)}))
    monkeypatch.setattr(unpack_mod, "MAX_ZIP_DIRECTORY", limit)
    monkeypatch.setattr(unpack_mod.zipfile, "ZipFile", _no_zipfile)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match=match):
        unpack_mod.unpack(archive, "many.zip", dest, max_members=members)
    assert list(dest.iterdir()) == []


def test_the_directory_of_a_zip64_archive_is_read_from_its_64_bit_record(
        tmp_path: Path) -> None:
    import zipfile

    from blobha.cache.unpack import _zip_directory

    archive = tmp_path / "big.zip"
    count = 0x10000 + 5  # past the 16-bit count: zipfile writes the zip64 records
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(count):
            zf.writestr(f"{i}", b"")
    with zipfile.ZipFile(archive) as zf:
        start = zf.start_dir
    eocd64 = archive.read_bytes().rfind(b"PK\x06\x06")
    assert eocd64 > 0  # a zip64 archive indeed
    assert _zip_directory(archive) == (count, eocd64 - start)
    small = tmp_path / "small.zip"
    small.write_bytes(_zip({"a": b"1", "b": b"2"}))
    directory = _zip_directory(small)
    assert directory is not None and directory[0] == 2
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    assert _zip_directory(tmp_path / "junk.zip") is None


def test_a_zip_link_with_a_huge_target_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from blobha.cache.unpack import unpack

    archive = tmp_path / "link.zip"
    archive.write_bytes(_zip({}, {"l": "a" * 5000}))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match="symbolic link with a target of 5,000 bytes"):
        unpack(archive, "link.zip", dest)


def test_a_member_name_too_long_for_the_file_system_is_a_clear_error(tmp_path: Path) -> None:
    from blobha.cache.unpack import unpack

    archive = tmp_path / "long.tar"
    name = "a" * 300
    archive.write_bytes(_tar({name: b"x"}))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match=r"cannot unpack 'long.tar' at member 'a+': its"
                       " name is too long"):
        unpack(archive, "long.tar", dest)


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


def test_probing_a_key_this_user_may_no_longer_read_drops_the_nodes_record(
    fake: FakeCluster, make: Any, clock: Clock, cache_dir: Path
) -> None:
    fake.put("k", b"data", readers={"alice"})
    cache = make(retention_secs=0, soft_limit_bytes=0, update_interval_secs=1)
    cache.get("k")
    fake.blobs["k"].readers = set()
    clock.advance(5)
    cache._janitor._probe_deleted([cache._layout.scan_key(key_dirname("k"), "k")])
    # An outage now must not let a new process of alice's read it on the old record.
    fake.meta_error = Unavailable("no master answered")
    with pytest.raises(Unavailable):
        make(update_interval_secs=1).get("k")
