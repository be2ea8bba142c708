"""blob_path on separate executor processes (``local-cluster[2,1,1024]``: a standalone master
and two workers, each executor its own JVM and Python workers), against a real 3-master
cluster: one download per node, a second application served from the cache, and an update
reaching a job that is running.

The tests run in file order and share one cache directory, as applications on one node do.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blobha_spark_helpers import (
    file_sha256,
    new_session,
    require_spark,
    sha256,
    spark_env,
    stop_session,
)
from support.clusters import running_cluster
from support.waiting import wait_until

from blobha import spark as blobspark
from blobha.cache import BlobCache
from blobha.client import Client
from blobha.ops.localcluster import LocalCluster

require_spark()

import blobha_spark_helpers  # noqa: E402
from pyspark import cloudpickle  # noqa: E402
from support import waiting  # noqa: E402

# Executors cannot import test modules: ship this module's task functions (and the helpers
# they call, wait_until included) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(blobha_spark_helpers)
cloudpickle.register_pickle_by_value(waiting)

pytestmark = pytest.mark.spark

MASTER = "local-cluster[2,1,1024]"
EXECUTORS = 2
DATA_KEY = "spark-exec-lookup"
ARCHIVE_KEY = "spark-exec-model.tgz"
UPDATE_INTERVAL = 1.0
BLOB_MAP = {
    DATA_KEY: {"localname": "lookup.bin"},
    ARCHIVE_KEY: {"localname": "model", "uncompress": True},
}


def _archive(text: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("model/weights.txt", text.encode()), ("model/README", b"demo\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("spark-work")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in spark_env(work).items():
            mp.setenv(k, v)
        yield work


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def blobs(cluster: LocalCluster) -> dict[str, bytes]:
    data = os.urandom(6 * 1024 * 1024)
    archive = _archive("w=1\n")
    with Client(cluster.cluster, user="alice", timeout=60) as c:
        c.create(DATA_KEY, data, acl="o::r", replication_factor=3)
        c.create(ARCHIVE_KEY, archive, acl="o::r", replication_factor=3)
    return {DATA_KEY: data, ARCHIVE_KEY: archive}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("node-cache")


@pytest.fixture(scope="module")
def app1(
    env: Path, cluster: LocalCluster, blobs: dict[str, bytes], cache_dir: Path
) -> Iterator[Any]:
    spark = new_session(MASTER, "blobha-exec-app1")
    try:
        _wait_for_executors(spark)
        yield spark
    finally:
        stop_session(spark)


def _wait_for_executors(spark: Any) -> None:
    # local-cluster starts its executors asynchronously; a barrier stage needs them all.
    tracker = spark.sparkContext.statusTracker()
    wait_until(
        lambda: len(tracker.getExecutorInfos()) > EXECUTORS,  # the driver is listed too
        120,
        "both executors to register",
        interval=0.2,
    )


def _prepare(spark: Any, cluster: LocalCluster, cache_dir: Path) -> blobspark.ReplicationReport:
    return blobspark.prepare(
        spark,
        BLOB_MAP,
        cluster=cluster.cluster,
        user="bob",  # not the creator: reads through the o::r ACL on every executor
        min_replication=3,
        max_wait_secs=60,
        cache_dir=str(cache_dir),
        update_interval_secs=UPDATE_INTERVAL,
    )


def _stats(cluster: LocalCluster, cache_dir: Path) -> Any:
    with BlobCache(cache_dir, cluster.cluster, user="bob") as cache:
        return cache.stats()


def _owners(cluster: LocalCluster, cache_dir: Path) -> set[str]:
    with BlobCache(cache_dir, cluster.cluster, user="bob") as cache:
        return {o for e in cache.entries() for o in e.owners}


def _read_both(_: Any) -> Iterator[dict[str, Any]]:
    """Task body: resolve both blobs and report what this executor saw."""
    from blobha import spark as bs

    lookup = bs.blob_info("lookup.bin")
    model_dir = bs.blob_path("model")
    with open(os.path.join(model_dir, "model", "weights.txt")) as f:
        weights = f.read()
    yield {
        # A standalone executor runs in work/<app id>/<executor id>.
        "executor": os.path.basename(os.getcwd()),
        "pid": os.getpid(),
        "app": bs.application_id(bs.current_settings()),
        "path": str(lookup.path),
        "version": lookup.version,
        "sha256": file_sha256(lookup.path),
        "weights": weights,
        "model_is_dir": os.path.isdir(model_dir),
        # The version the driver saw before launch, which this read had to reach.
        "seen": list(bs.current_settings().min_version(DATA_KEY) or ()),
    }


def test_each_blob_is_downloaded_once_per_node(
    app1: Any, cluster: LocalCluster, blobs: dict[str, bytes], cache_dir: Path
) -> None:
    report = _prepare(app1, cluster, cache_dir)
    assert report.reached and {s.key for s in report.statuses} == set(BLOB_MAP)
    assert all(s.replication >= 3 for s in report.statuses)
    before = _stats(cluster, cache_dir)

    sc = app1.sparkContext
    # A barrier stage runs its tasks at the same time, one per executor (1 core each): both
    # executors ask for both blobs concurrently.
    together = sc.parallelize(range(EXECUTORS), EXECUTORS).barrier().mapPartitions(_read_both)
    rows = together.collect()
    # Then many more tasks, reusing the executors' Python workers.
    rows += sc.parallelize(range(12), 12).mapPartitions(_read_both).collect()

    assert len({r["executor"] for r in rows}) == EXECUTORS, rows
    assert {r["app"] for r in rows} == {sc.applicationId}
    assert {r["sha256"] for r in rows} == {sha256(blobs[DATA_KEY])}
    assert {r["weights"] for r in rows} == {"w=1\n"}
    assert all(r["model_is_dir"] for r in rows)
    assert len({r["path"] for r in rows}) == 1, "every executor uses the node's one copy"
    assert Path(rows[0]["path"]).is_relative_to(cache_dir)
    # What the driver saw before launch reached every executor, and every read reached it.
    seen = [list(m) for m in report.seen if m.key == DATA_KEY]
    assert len(seen) == 1 and all(r["seen"] == seen[0] for r in rows), (seen, rows)
    assert all(r["version"] >= seen[0][1] for r in rows)

    # The driver resolves the same names to the same node copy.
    assert blobspark.blob_path("lookup.bin") == rows[0]["path"]
    assert blobspark.blob_version("lookup.bin") == rows[0]["version"]

    after = _stats(cluster, cache_dir)
    assert after.downloads - before.downloads == 2, "one download per blob for the node"
    assert after.hits > before.hits
    # The application id owns the executors' references.
    assert sc.applicationId in _owners(cluster, cache_dir)


def _poll_for_update(marker_dir: str, deadline_secs: float) -> Any:
    """Task body of a long job: hold version 1, signal, then watch for a new version."""

    def run(_: Any) -> Iterator[dict[str, Any]]:
        from blobha import spark as bs

        first = bs.blob_version("lookup.bin")
        Path(marker_dir, f"started-{os.getpid()}").touch()
        # A version that stays put fails the task, hence the job, with wait_until's message.
        wait_until(lambda: bs.blob_version("lookup.bin") != first, deadline_secs,
                   "a new version of lookup.bin in the running task")
        info = bs.blob_info("lookup.bin")
        yield {
            "first": first,
            "seen": info.version,
            "seen_at": time.time(),
            "sha256": file_sha256(info.path),
            "executor": os.path.basename(os.getcwd()),
        }

    return run


def test_update_reaches_a_running_job(
    app1: Any, cluster: LocalCluster, blobs: dict[str, bytes], cache_dir: Path, tmp_path: Path
) -> None:
    _prepare(app1, cluster, cache_dir)
    sc = app1.sparkContext
    markers = tmp_path / "markers"
    markers.mkdir()
    before = _stats(cluster, cache_dir)
    result: dict[str, Any] = {}

    def job() -> None:
        try:
            rdd = sc.parallelize(range(EXECUTORS), EXECUTORS).barrier()
            result["rows"] = rdd.mapPartitions(_poll_for_update(str(markers), 90)).collect()
        except Exception as exc:  # reported by the assertion below
            result["error"] = exc

    # prepare() put the configuration in the environment of the Python workers, so a job
    # from another thread (which does not share this one's local properties) finds it too.
    runner = threading.Thread(target=job)
    runner.start()
    try:
        wait_until(lambda: len(list(markers.iterdir())) >= EXECUTORS, 120, "both tasks to start")
        new_data = os.urandom(3 * 1024 * 1024)
        with Client(cluster.cluster, user="alice", timeout=60) as c:
            meta = c.update(DATA_KEY, new_data)
        updated_at = time.time()
    finally:
        runner.join(180)
    assert not runner.is_alive(), "the long job did not end"
    assert "error" not in result, result.get("error")
    rows = result["rows"]
    assert len(rows) == EXECUTORS
    assert len({r["executor"] for r in rows}) == EXECUTORS
    for r in rows:
        assert r["first"] < meta.version == r["seen"]
        assert r["sha256"] == sha256(new_data)
        # Within the update interval, plus the per-process recheck and scheduling slack.
        assert r["seen_at"] - updated_at < UPDATE_INTERVAL + 10, r
    after = _stats(cluster, cache_dir)
    assert after.downloads - before.downloads == 1, "the new version, once for the node"
    blobs[DATA_KEY] = new_data


def test_second_application_uses_the_cache(
    app1: Any, env: Path, cluster: LocalCluster, blobs: dict[str, bytes], cache_dir: Path
) -> None:
    first_app = app1.sparkContext.applicationId
    stop_session(app1)  # the first application ends; the node's cache stays
    before = _stats(cluster, cache_dir)
    spark = new_session(MASTER, "blobha-exec-app2")
    try:
        _wait_for_executors(spark)
        sc = spark.sparkContext
        assert sc.applicationId != first_app
        _prepare(spark, cluster, cache_dir)
        rows = sc.parallelize(range(8), 8).mapPartitions(_read_both).collect()
        assert {r["app"] for r in rows} == {sc.applicationId}
        assert {r["sha256"] for r in rows} == {sha256(blobs[DATA_KEY])}
        after = _stats(cluster, cache_dir)
        assert after.downloads == before.downloads, "nothing downloaded again"
        assert after.hits > before.hits
        assert sc.applicationId in _owners(cluster, cache_dir)
        # References die with the processes that took them: once the first application's
        # executors are gone it no longer pins anything.
        wait_until(
            lambda: first_app not in _owners(cluster, cache_dir),
            60,
            "the first application's references to lapse",
            interval=0.2,
        )
    finally:
        stop_session(spark)
