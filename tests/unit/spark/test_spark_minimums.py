"""The versions a job reads at least: the driver's side learns them before launch, the
configuration carries them (``spark.blobha.min.versions``), and the executor's side makes its
node cache read at least them. Fakes only: the node cache's client is the fake cluster of
tests/support/cache_fakes.py, one of whose masters may be behind."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import FakeCluster

from blobha.cache import BlobCache
from blobha.client import BlobMeta
from blobha.core.errors import InvalidArgument, Unavailable
from blobha.spark import driver, executor
from blobha.spark.conf import CONF_MAP, CONF_MIN_VERSIONS
from blobha.spark.minimums import SeenVersion, merge_min_versions, parse_min_versions
from blobha.spark.settings import SparkBlobSettings
from blobha.wire.status import ReplicationStatus

KEY = "model.bin"


def test_the_versions_travel_in_the_executors_configuration(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="blobha.spark")
    settings = SparkBlobSettings.from_conf({
        CONF_MAP: json.dumps({KEY: {"localname": "model"}}),
        CONF_MIN_VERSIONS: json.dumps({KEY: [3, 1700000000.25]}),
    })
    assert settings.min_version(KEY) == SeenVersion(KEY, 3, 1700000000.25)
    assert settings.min_version("other") is None
    assert SparkBlobSettings.from_json(settings.to_json()) == settings
    assert "unknown" not in caplog.text, "the launcher's own key is known"


def test_a_configuration_without_versions_reads_as_before() -> None:
    old = SparkBlobSettings.from_conf({CONF_MAP: json.dumps({KEY: {}})})
    assert old.min_versions == () and old.min_version(KEY) is None
    assert CONF_MIN_VERSIONS not in old.to_conf()
    assert parse_min_versions("") == ()


@pytest.mark.parametrize("value", [
    "[1, 2]", "{nope", '{"k": [0, 1.0]}', '{"k": [1, 0]}', '{"k": [1]}', '{"k": ["1", 2.0]}',
    '{"k": [true, 2.0]}', '{"bad/key": [1, 2.0]}',
])
def test_malformed_versions_are_refused_with_the_key_named(value: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_min_versions(value)


def test_merging_keeps_the_newest_of_each_key() -> None:
    merged = merge_min_versions(
        [SeenVersion("a", 5, 100.0), SeenVersion("b", 2, 100.0)],
        [SeenVersion("a", 1, 200.0), SeenVersion("b", 1, 100.0), SeenVersion("c", 1, 1.0)])
    assert merged == (SeenVersion("a", 1, 200.0), SeenVersion("b", 2, 100.0),
                      SeenVersion("c", 1, 1.0))


class _DriverClient:
    """What the driver's side calls: metadata answers in turn, and the minimums it was given."""

    user = "alice"

    def __init__(self, *metas: BlobMeta) -> None:
        self.metas = list(metas)
        self.remembered: list[tuple[str, int, float]] = []

    def get_meta(self, key: str) -> BlobMeta:
        return self.metas.pop(0)

    def remember_version(self, key: str, version: int, created_at: float) -> None:
        self.remembered.append((key, version, created_at))


def _meta(version: int, created_at: float = 500.0) -> BlobMeta:
    return BlobMeta(KEY, version, 3, "d", (), 3, 1, created_at, created_at, "alice", 3,
                    access=7)


def _status(version: int) -> ReplicationStatus:
    return ReplicationStatus(KEY, version, 3, 3, ())


def test_the_driver_passes_the_version_its_metadata_and_the_wait_agree_on() -> None:
    client = _DriverClient()
    seen = driver._seen_versions(client, {KEY: _meta(4)}, [_status(4)])  # type: ignore[arg-type]
    assert seen == (SeenVersion(KEY, 4, 500.0),) and client.remembered == []


def test_a_newer_committed_version_is_read_again_past_the_master_behind() -> None:
    # The metadata came from a master behind (v3); the wait read ZooKeeper (v4).
    client = _DriverClient(_meta(4))
    seen = driver._seen_versions(client, {KEY: _meta(3)}, [_status(4)])  # type: ignore[arg-type]
    assert client.remembered == [(KEY, 4, 500.0)], "the re-read carries the newer minimum"
    assert seen == (SeenVersion(KEY, 4, 500.0),)


def test_a_read_again_that_fails_still_passes_the_committed_version() -> None:
    client = _DriverClient()

    def unanswered(key: str) -> BlobMeta:
        raise Unavailable("every master is behind")

    client.get_meta = unanswered  # type: ignore[method-assign]
    seen = driver._seen_versions(client, {KEY: _meta(3)}, [_status(4)])  # type: ignore[arg-type]
    assert seen == (SeenVersion(KEY, 4, 500.0),)


def test_metadata_without_a_creation_time_sets_no_minimum() -> None:
    client = _DriverClient()
    seen = driver._seen_versions(client, {KEY: _meta(3, created_at=0.0)},  # type: ignore[arg-type]
                                 [_status(3)])
    assert seen == ()


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    """A node cache whose record says version one, fresh for an hour (an earlier job), while
    the cluster has version two and the master asked first is still at one."""
    cluster = FakeCluster()
    cluster.put(KEY, b"one")
    cache_dir = tmp_path / "cache"
    with BlobCache(cache_dir, client=cluster.client(),  # type: ignore[arg-type]
                   update_interval_secs=3600) as earlier:
        assert earlier.get(KEY, owner="app-0").version == 1
    cluster.put(KEY, b"two")
    cluster.behind[KEY] = 1

    def open_cache(settings: SparkBlobSettings) -> BlobCache:
        return BlobCache(cache_dir, client=cluster.client(),  # type: ignore[arg-type]
                         update_interval_secs=settings.update_interval_secs)

    monkeypatch.setattr(executor, "open_cache", open_cache)
    return cluster


def _settings(**kw: Any) -> SparkBlobSettings:
    return SparkBlobSettings.from_conf({
        CONF_MAP: json.dumps({KEY: {"localname": "model"}}),
        "spark.blobha.cluster": "127.0.0.1:1", "spark.blobha.user": "alice",
        "spark.blobha.update.interval.secs": "3600", "spark.app.id": "app-1",
        **kw,
    })


def test_an_executor_reads_at_least_the_version_the_driver_saw(node: FakeCluster) -> None:
    created = node.blobs[KEY].created_at
    localizer = executor._Localizer()
    try:
        # A configuration from before minimums: the node's fresh record serves version one.
        assert localizer.get(_settings(), "model").version == 1
        launched = _settings(**{CONF_MIN_VERSIONS: json.dumps({KEY: [2, created]})})
        blob = localizer.get(launched, "model")
        assert (blob.version, blob.path.read_bytes()) == (2, b"two")
    finally:
        localizer.close()


def test_the_worker_hook_lays_out_code_at_least_at_the_version_seen(
        node: FakeCluster, tmp_path: Path) -> None:
    import hashlib

    from blobha.spark import worker
    from blobha.spark.codemap import CodeSpec
    from blobha.spark.conf import ENV_CONF

    created = node.blobs[KEY].created_at
    pin = (2, hashlib.sha256(b"two").hexdigest())
    settings = _settings().replace(code=(CodeSpec(KEY, "file", "lib.py", *pin),),
                                   min_versions=(SeenVersion(KEY, 2, created),))
    cwd = tmp_path / "work"
    cwd.mkdir()
    worker.lay_out({ENV_CONF: settings.to_json()}, cwd)
    assert (cwd / "lib.py").read_bytes() == b"two"
