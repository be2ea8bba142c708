"""The node cache never goes back a version (read-your-writes across processes), with the fake
cluster of tests/support/cache_fakes.py: one of its masters may be behind and serves its older
view to a client with no newer minimum, as a real cut-off master does.

What is checked: the cache seeds its client with what it holds and with the node's record
(so the master behind is passed over), with what another process recorded (a download of
that version), and with what a caller requires (remember_version), which a fresh record
older than it does not satisfy; a minimum nobody can confirm is refused rather than served
older; records without a creation time set no minimum.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import Clock, FakeCluster

from blobha.cache import BlobCache
from blobha.core.errors import InvalidArgument, Stale, Unavailable
from blobha.core.keys import key_dirname

KEY = "model.bin"


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def new_cache(cluster: FakeCluster, cache_dir: Path) -> Iterator[Callable[..., BlobCache]]:
    """A new cache instance on ``cache_dir`` with a client of its own (a new process)."""
    made: list[BlobCache] = []

    def build(**kw: Any) -> BlobCache:
        kw.setdefault("retention_secs", 0.0)
        kw.setdefault("clock", Clock())
        c = BlobCache(cache_dir, client=cluster.client(), **kw)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield build
    for c in made:
        c.close()


def check_record(cache_dir: Path, key: str = KEY, user: str = "alice") -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (cache_dir / "blobs" / key_dirname(key) / "checks" / key_dirname(user)).read_bytes())
    return data


def test_a_cache_holding_a_version_asks_for_it_at_least(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache], cache_dir: Path) -> None:
    cluster.put(KEY, b"one")
    cluster.put(KEY, b"two")
    assert new_cache().get(KEY).version == 2
    cluster.behind[KEY] = 1  # the master asked first still has version one

    restarted = new_cache(update_interval_secs=0.0)  # asks the cluster on every get
    blob = restarted.get(KEY)
    assert (blob.version, blob.path.read_bytes()) == (2, b"two")
    # Its update check went past the master behind: the node's record did not go back.
    assert check_record(cache_dir)["version"] == 2


def test_a_damaged_copy_is_fetched_again_at_its_version_not_the_one_before(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache]) -> None:
    cluster.put(KEY, b"one" * 100)
    cluster.put(KEY, b"two" * 100)
    path = new_cache().get(KEY).path
    path.chmod(0o644)
    path.write_bytes(b"bad" * 100)  # a crash damaged it: same size, other bytes
    cluster.behind[KEY] = 1

    blob = new_cache(update_interval_secs=0.0).get(KEY)
    assert (blob.version, blob.path.read_bytes()) == (2, b"two" * 100)


def test_a_version_another_process_recorded_is_downloaded_at_least_at_that_version(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache]) -> None:
    cluster.put(KEY, b"one")
    cluster.put(KEY, b"two")
    cluster.fail_next = Unavailable("the connection dropped")
    with pytest.raises(Unavailable):
        new_cache(update_interval_secs=3600).get(KEY)  # recorded version two, then failed
    cluster.behind[KEY] = 1

    blob = new_cache(update_interval_secs=3600).get(KEY)  # served by the record: no question
    assert (blob.version, blob.path.read_bytes()) == (2, b"two")


def test_a_required_version_is_asked_for_past_a_fresh_older_record(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache]) -> None:
    cluster.put(KEY, b"one")
    assert new_cache(update_interval_secs=3600).get(KEY).version == 1  # an earlier job
    cluster.put(KEY, b"two")  # the update just before the next job's launch
    cluster.behind[KEY] = 1
    created = cluster.blobs[KEY].created_at

    # Without a minimum, the node's fresh record serves version one (the update interval).
    assert new_cache(update_interval_secs=3600).get(KEY).version == 1
    job = new_cache(update_interval_secs=3600)
    job.remember_version(KEY, 2, created)
    calls = cluster.meta_calls
    blob = job.get(KEY)
    assert (blob.version, blob.path.read_bytes()) == (2, b"two")
    assert cluster.meta_calls == calls + 1
    # Once served, the minimum costs nothing more: later gets use the new record.
    assert job.get(KEY).version == 2 and cluster.meta_calls == calls + 1
    # An older minimum changes nothing.
    job.remember_version(KEY, 1, created)
    assert job.get(KEY).version == 2


def test_a_required_version_nobody_confirms_is_refused_not_served_older(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache]) -> None:
    cluster.put(KEY, b"one")
    created = cluster.blobs[KEY].created_at
    assert new_cache(update_interval_secs=3600).get(KEY).version == 1
    cluster.meta_error = Unavailable("no master answers")

    job = new_cache(update_interval_secs=3600)
    job.remember_version(KEY, 2, created)
    with pytest.raises(Stale, match=r"v1, older than v2"):
        job.get(KEY)
    # A minimum the node holds is served through the outage, as before.
    held = new_cache(update_interval_secs=3600)
    held.remember_version(KEY, 1, created)
    assert held.get(KEY).version == 1


def test_a_newer_incarnation_satisfies_a_minimum_of_an_older_one(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache]) -> None:
    cluster.put(KEY, b"one")
    cluster.put(KEY, b"two")
    old_created = cluster.blobs[KEY].created_at
    cluster.delete(KEY)
    cluster.put(KEY, b"again")  # version 1 of a key created later
    job = new_cache()
    job.remember_version(KEY, 2, old_created)
    blob = job.get(KEY)
    assert (blob.version, blob.path.read_bytes()) == (1, b"again")


def test_records_without_a_creation_time_set_no_minimum(
        cluster: FakeCluster, new_cache: Callable[..., BlobCache], cache_dir: Path) -> None:
    cluster.put(KEY, b"one")
    blob = new_cache().get(KEY)
    meta_path = blob.path.parent.parent / "meta.json"
    record = json.loads(meta_path.read_bytes())
    del record["created_at"]  # as an older release might have left it
    meta_path.write_bytes(json.dumps(record).encode())

    cache = new_cache(update_interval_secs=0.0)
    client = cache._cluster()
    again = cache.get(KEY)
    assert (again.version, again.path.read_bytes()) == (1, b"one")
    # No minimum came from that record; the one the client has is what the cluster said.
    assert client.minimums[KEY] == (cluster.blobs[KEY].created_at, 1)  # type: ignore[attr-defined]


@pytest.mark.parametrize("version, created_at, message", [
    (0, 1000.0, "version must be"),
    (True, 1000.0, "version must be"),
    (2, 0.0, "created_at must be"),
    (2, float("nan"), "created_at must be"),
])
def test_remember_version_takes_a_version_and_a_creation_time(
        new_cache: Callable[..., BlobCache], version: Any, created_at: float,
        message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        new_cache().remember_version(KEY, version, created_at)
