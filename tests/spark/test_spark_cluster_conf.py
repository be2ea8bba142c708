"""A real ``blobha spark-submit`` configured the way a cluster is: ``spark.blobha.*`` in
``spark-defaults.conf`` (``$SPARK_CONF_DIR``), no interpreter named by the user, and separate
executor processes (``local-cluster[2,1,1024]``). Every executor's ``blob_path`` must use the
configured ``spark.blobha.cache.dir``, not the node's default cache directory."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from blobha_spark_helpers import require_spark, spark_home
from support.clusters import running_cluster

from blobha import spark as blobspark
from blobha.client import Client
from blobha.ops.localcluster import LocalCluster

require_spark()

pytestmark = pytest.mark.spark

KEY = "conventions-blob"

JOB = textwrap.dedent("""
    import json, os, sys

    from pyspark.sql import SparkSession


    def where(_):
        from blobha import spark as bs

        yield {"path": bs.blob_path("conv.bin"), "executor": os.path.basename(os.getcwd())}


    spark = SparkSession.builder.getOrCreate()
    sc = spark.sparkContext
    try:
        # A barrier stage runs one task per executor (1 core each) at the same time.
        rows = sc.parallelize(range(2), 2).barrier().mapPartitions(where).collect()
        from blobha import spark as bs

        out = {"app": sc.applicationId, "rows": rows, "driver": bs.blob_path("conv.bin")}
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    finally:
        spark.stop()
""")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        with Client(c.cluster, user="alice", timeout=60) as alice:
            alice.create(KEY, b"c" * 4096, acl="o::r", replication_factor=3)
            alice.wait_for_replication([KEY], 3, 30)
        yield c


def test_the_cache_directory_of_spark_defaults_is_used_on_every_executor(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "spark-conf"
    conf_dir.mkdir()
    cache_dir = tmp_path / "node-wide-cache"
    (conf_dir / "spark-defaults.conf").write_text(textwrap.dedent(f"""\
        spark.blobha.blobstore.map        {{"{KEY}": {{"localname": "conv.bin"}}}}
        spark.blobha.cluster              {cluster.cluster}
        spark.blobha.user                 bob
        spark.blobha.min.replication      3
        spark.blobha.max.replication.wait.secs 1min
        spark.blobha.cache.dir            {cache_dir}
        spark.ui.enabled                  false
        spark.ui.showConsoleProgress      false
        spark.driver.memory               768m
        spark.executor.memory             768m
    """))
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "out.json"
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path / "spark-local"))
    # The node's default cache directory, which the conf must override everywhere.
    monkeypatch.setenv("BLOBHA_CACHE_DIR", str(tmp_path / "node-default"))
    # Nothing names an interpreter: the launcher's own serves a local-cluster master.
    for var in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_HOME", "BLOBHA_CLUSTER",
                blobspark.ENV_CONF):
        monkeypatch.delenv(var, raising=False)
    app = None
    try:
        status = blobspark.submit_main(
            ["--", "--master", "local-cluster[2,1,1024]", str(job), str(out)]
        )
        assert status == 0
        result = json.loads(out.read_text())
        app = result["app"]
        rows = result["rows"]
        assert len({r["executor"] for r in rows}) == 2, rows
        for path in [*(r["path"] for r in rows), result["driver"]]:
            assert Path(path).is_relative_to(cache_dir), path
        assert not (tmp_path / "node-default").exists()
    finally:
        if app is not None:
            shutil.rmtree(spark_home() / "work" / app, ignore_errors=True)
