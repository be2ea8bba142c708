"""``blobha spark-submit`` on a real standalone Spark cluster of two worker nodes (a master and
two workers from the installed pyspark, each worker with its own work directory, HOME and node
cache, and no BLOBHA_* setting), the driver in client mode: executors on both nodes read the
job's blob through their node's cache, each node downloads it once, and a second application
downloads nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blobha_spark_helpers import require_spark
from standalone import StandaloneSpark, master_downloads
from support.clusters import running_cluster

from blobha.client import Client
from blobha.ops.localcluster import LocalCluster

require_spark()

pytestmark = pytest.mark.spark

KEY = "standalone-lookup"
DATA = hashlib.sha256(b"seed").digest() * (3 * 1024 * 1024 // 32)  # 3 MiB, on the data channel

JOB = '''
import hashlib, json, os, sys
from pyspark.sql import SparkSession
from blobha.spark import blob_path

spark = SparkSession.builder.getOrCreate()

def probe(i):
    path = blob_path("lookup.bin")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return [os.environ.get("HOME", ""), path, digest]

rows = spark.sparkContext.parallelize(range(16), 16).map(probe).collect()
with open(sys.argv[1], "w") as out:
    json.dump(rows, out)
spark.stop()
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        with Client(c.cluster, user="alice", timeout=60) as alice:
            alice.create(KEY, DATA, acl="u:alice:rwa", replication_factor=3)
            alice.wait_for_replication([KEY], 3, 30)
        yield c


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneSpark]:
    with StandaloneSpark(tmp_path_factory.mktemp("spark"), workers=2) as s:
        yield s


def _submit(cluster: LocalCluster, spark: StandaloneSpark, work: Path, job_text: str = JOB,
            blob: str = f"{KEY}:lookup.bin") -> Any:
    """Run ``job_text`` with ``blob`` through ``blobha spark-submit``; what it wrote."""
    work.mkdir(parents=True, exist_ok=True)
    job = work / "job.py"
    job.write_text(job_text)
    out = work / "rows.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
    env.update(BLOBHA_CLUSTER=cluster.cluster, BLOBHA_USER="alice",
               BLOBHA_CACHE_DIR=str(work / "driver-cache"))
    cmd = [sys.executable, "-m", "blobha", "spark-submit", "--blob", blob,
           "--min-replication", "2", "--max-wait", "60s", "--",
           "--master", spark.url, "--deploy-mode", "client",
           # Every node of this cluster has blobha in this interpreter (one machine): say so,
           # as a real cluster's jobs name their nodes' interpreter.
           "--conf", f"spark.pyspark.python={sys.executable}",
           "--conf", "spark.executor.memory=512m", "--conf", "spark.driver.memory=512m",
           "--conf", "spark.cores.max=2", "--conf", "spark.ui.enabled=false",
           str(job), str(out)]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


def test_both_nodes_read_the_blob_through_their_own_cache_once(
        cluster: LocalCluster, spark: StandaloneSpark, tmp_path: Path) -> None:
    before = master_downloads(cluster)
    rows = _submit(cluster, spark, tmp_path / "first")
    want = hashlib.sha256(DATA).hexdigest()
    assert {digest for _, _, digest in rows} == {want}
    # Both workers ran tasks, each from its own node cache (under its own HOME).
    homes = {home for home, _, _ in rows}
    assert homes == {str(h) for h in spark.homes}, homes
    for home, path, _ in rows:
        assert path.startswith(home + "/"), (home, path)
    # One download per node, each node's cache says; the masters served it in ranged reads
    # (of one or two pieces), to one node or both, the rest going from cache to cache: at most
    # one read per piece and node (3 pieces, 2 nodes), never a whole download per node twice.
    roots = {path.split("/blobs/")[0] for _, path, _ in rows}
    assert len(roots) == 2, roots
    for root in roots:
        stats = json.loads((Path(root) / "stats.json").read_text())
        assert stats["downloads"] == 1, (root, stats)
    assert 1 <= master_downloads(cluster) - before <= 2 * -(-len(DATA) // (1024 * 1024))

    # A second application: both nodes' caches serve it, nothing is downloaded again.
    before = master_downloads(cluster)
    rows = _submit(cluster, spark, tmp_path / "second")
    assert {digest for _, _, digest in rows} == {want}
    assert master_downloads(cluster) - before == 0


PEER_KEY = "standalone-peer-model"
PEER_DATA = hashlib.sha256(b"peer").digest() * (16 * 1024 * 1024 // 32)  # 16 pieces of 1 MiB

# One task first, on one node, then tasks on both: the second node's cache fetches while the
# first node's process that fetched the blob still runs (Python workers are reused), serving it.
STAGED_JOB = '''
import hashlib, json, os, sys
from pyspark.sql import SparkSession
from blobha.spark import blob_path

spark = SparkSession.builder.getOrCreate()

def probe(i):
    path = blob_path("model.bin")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return [os.environ.get("HOME", ""), path, digest]

sc = spark.sparkContext
first = sc.parallelize([0], 1).map(probe).collect()
rest = sc.parallelize(range(16), 16).map(probe).collect()
with open(sys.argv[1], "w") as out:
    json.dump({"first": first, "rest": rest}, out)
spark.stop()
'''


def test_the_second_node_gets_most_of_the_blob_from_the_first_nodes_cache(
        cluster: LocalCluster, spark: StandaloneSpark, tmp_path: Path) -> None:
    with Client(cluster.cluster, user="alice", timeout=60) as alice:
        alice.create(PEER_KEY, PEER_DATA, acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication([PEER_KEY], 3, 30)
    def counters() -> dict[str, tuple[int, int]]:
        """Per node cache directory: (bytes downloaded, of those from peers), all told."""
        return {str(home / ".cache" / "blobha"): (s.get("bytes_downloaded", 0),
                                                   s.get("bytes_from_peers", 0))
                for home, s in zip(spark.homes, spark.node_stats(), strict=True)}

    before = counters()
    rows = _submit(cluster, spark, tmp_path / "staged", STAGED_JOB, f"{PEER_KEY}:model.bin")
    want = hashlib.sha256(PEER_DATA).hexdigest()
    assert {d for _, _, d in rows["first"] + rows["rest"]} == {want}
    roots = {path.split("/blobs/")[0] for _, path, _ in rows["first"] + rows["rest"]}
    assert len(roots) == 2, roots  # both nodes ran tasks
    first = rows["first"][0][1].split("/blobs/")[0]
    (second,) = roots - {first}
    after = counters()
    assert roots == set(after), (roots, after)
    got = {root: (after[root][0] - before[root][0], after[root][1] - before[root][1])
           for root in roots}
    print(f"bytes downloaded / from peers per node: first {got[first]}, second {got[second]}")
    assert got[first] == (len(PEER_DATA), 0), got  # nobody held it yet: all from the masters
    assert got[second][0] == len(PEER_DATA), got
    assert got[second][1] > len(PEER_DATA) // 2, got  # most of it from the first node
