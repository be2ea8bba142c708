"""The job's own code through the blob store: ``blobha spark-submit`` (a real spark-submit,
``local-cluster[2,1,1024]``, so executors are separate processes) takes ``--py-files``,
``--files`` and ``--archives`` out of what Spark ships, stores them as content-addressed blobs,
and the ``blobha-python`` hook lays them out on executors from the node cache. The job is
plain PySpark: it imports the zipped module, reads ``SparkFiles.get`` and ``./data/...``, and a
``--blob`` side file through ``blob_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blobha_spark_helpers import env_archive, job_files, require_spark, spark_env, spark_home
from support.clusters import running_cluster

from blobha import spark as blobspark
from blobha.client import Client
from blobha.ops.localcluster import LocalCluster

require_spark()

pytestmark = pytest.mark.spark

MASTER = "local-cluster[2,1,1024]"
SIDE_KEY = "jobcode-side"

JOB = '''
import json, os, sys
from pyspark import SparkFiles
from pyspark.sql import SparkSession

import jobhelper  # the driver imports the py-files too (client mode)

def task(i):
    import jobhelper
    from blobha.spark import blob_path
    with open(SparkFiles.get("factor.txt")) as f:
        factor = int(f.read())
    with open("./data/table/values.txt") as f:
        values = [int(v) for v in f.read().split()]
    with open(blob_path("side.txt")) as f:
        side = int(f.read())
    return {
        "value": jobhelper.triple(i) * factor + sum(values) + side,
        "module": os.path.realpath(jobhelper.__file__.split(".zip")[0] + ".zip"),
        "factor": os.path.realpath(SparkFiles.get("factor.txt")),
        "data": os.path.realpath("./data"),
        "pid": os.getppid(),
    }

spark = SparkSession.builder.getOrCreate()
sc = spark.sparkContext
rows = sc.parallelize(range(8), 8).map(task).collect()
json.dump({"app": sc.applicationId, "driver_triple": jobhelper.triple(1), "rows": rows,
           "spark_files": sc.getConf().get("spark.files", ""),
           "py_files": sc.getConf().get("spark.submit.pyFiles", ""),
           "archives": sc.getConf().get("spark.archives", "")},
          open(sys.argv[1], "w"))
spark.stop()
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        with Client(c.cluster, user="bob", timeout=60) as bob:
            bob.create(SIDE_KEY, b"100", acl="u:bob:rwa")
        yield c


def _submit(cluster: LocalCluster, files: dict[str, Path], cache_dir: Path, out: Path,
            work: Path) -> int:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in spark_env(work).items():
            mp.setenv(k, v)
        return blobspark.submit_main([
            "--blob", f"{SIDE_KEY}:side.txt", "--min-replication", "1", "--max-wait", "30",
            "--cluster", cluster.cluster, "--user", "bob", "--cache-dir", str(cache_dir),
            "--",
            "--master", MASTER,
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.ui.showConsoleProgress=false",
            "--conf", "spark.executor.memory=512m",
            "--driver-memory", "512m",
            "--py-files", str(files["lib"]),
            "--files", str(files["factor"]),
            "--archives", f"{files['data']}#data",
            str(files["job"]), str(out),
        ])


def _read(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(out.read_text())
    shutil.rmtree(spark_home() / "work" / result["app"], ignore_errors=True)
    return result


def test_code_reaches_executors_from_the_cache_and_is_stored_once(
    cluster: LocalCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="blobha.spark")
    files = job_files(tmp_path / "job", JOB)
    cache_dir = tmp_path / "node-cache"
    out1 = tmp_path / "out1.json"
    status = _submit(cluster, files, cache_dir, out1, tmp_path / "w1")
    assert status == 0, capfd.readouterr().err[-5000:]
    first = _read(out1)

    # 3*i*10 + (1+2+3) + 100, from the zip, the file, the archive and the side blob.
    assert sorted(r["value"] for r in first["rows"]) == [30 * i + 106 for i in range(8)]
    assert first["driver_triple"] == 3
    cache = str(cache_dir.resolve())
    for row in first["rows"]:
        for what in ("module", "factor", "data"):
            assert row[what].startswith(cache + os.sep), (what, row)
    assert len({r["pid"] for r in first["rows"]}) == 2, "two executors, each its own JVM"
    # Spark itself ships none of them: the driver serves nothing.
    assert (first["spark_files"], first["py_files"], first["archives"]) == ("", "", "")

    with Client(cluster.cluster, user="bob") as c:
        keys = sorted(c.list(prefix="code.bob."))
        # code.<user>.<xxh3-128 of the content>.<basename>
        assert {k.split(".", 3)[3] for k in keys} == {"libs.zip", "factor.txt", "data.tgz"}
        assert all(len(k.split(".")[2]) == 32 for k in keys)
        metas = {k: c.get_meta(k) for k in keys}
    assert caplog.text.count("uploaded ") == 3

    # A second application with the same files uploads nothing.
    caplog.clear()
    out2 = tmp_path / "out2.json"
    status = _submit(cluster, files, cache_dir, out2, tmp_path / "w2")
    assert status == 0, capfd.readouterr().err[-5000:]
    second = _read(out2)
    assert sorted(r["value"] for r in second["rows"]) == [30 * i + 106 for i in range(8)]
    assert "uploaded " not in caplog.text
    assert caplog.text.count("already stored") == 3
    with Client(cluster.cluster, user="bob") as c:
        assert sorted(c.list(prefix="code.bob.")) == keys
        for k, meta in metas.items():
            again = c.get_meta(k)
            assert (again.version, again.updated_at) == (meta.version, meta.updated_at)


TOKEN_JOB = '''
import json, os, sys
from pyspark.sql import SparkSession

def task(i):
    import jobhelper
    from blobha.client import Client
    from blobha.core.errors import NotAuthorized
    from blobha.spark import blob_path, current_settings
    from blobha.spark.executor import job_credentials
    with open(blob_path("side.txt")) as f:
        side = int(f.read())
    settings = current_settings()
    creds = job_credentials(settings.resolved_cache_dir())
    try:  # what the executors hold only reads the job's keys
        with Client(settings.cluster, credentials=creds, timeout=10) as c:
            c.create("jobcode-token-write", b"x")
        refused = False
    except NotAuthorized:
        refused = True
    return {"value": jobhelper.triple(i) + side, "refused": refused,
            "own_token": os.environ.get("BLOBHA_TOKEN_FILE", ""),
            "own_ca": os.environ.get("BLOBHA_CA", ""),
            "module": os.path.realpath(jobhelper.__file__.split(".zip")[0] + ".zip")}

spark = SparkSession.builder.getOrCreate()
sc = spark.sparkContext
rows = sc.parallelize(range(4), 4).map(task).collect()
json.dump({"app": sc.applicationId, "rows": rows}, open(sys.argv[1], "w"))
spark.stop()
'''


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("secure"), tls=True) as c:
        with Client(c.cluster, user="alice", timeout=60, credentials=c.credentials("alice")) as a:
            a.create(SIDE_KEY, b"100", acl="u:alice:rwa")
        yield c


def test_executors_read_with_a_redacted_job_token_and_the_ca_from_the_conf(
    secure: LocalCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="blobha.spark")
    files = job_files(tmp_path / "job", JOB)
    files["job"].write_text(textwrap.dedent(TOKEN_JOB))
    creds = secure.credentials("alice")
    events = tmp_path / "events"
    events.mkdir()
    out = tmp_path / "out.json"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in spark_env(tmp_path / "w").items():
            mp.setenv(k, v)
        mp.setenv("BLOBHA_CA", str(creds.ca))
        mp.setenv("BLOBHA_TOKEN_FILE", str(creds.token_file))
        status = blobspark.submit_main([
            "--blob", f"{SIDE_KEY}:side.txt", "--token-lifetime", "2h",
            "--cluster", secure.cluster, "--user", "alice",
            "--cache-dir", str(tmp_path / "node-cache"),
            "--",
            "--master", MASTER, "--verbose",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.ui.showConsoleProgress=false",
            "--conf", "spark.executor.memory=512m",
            "--conf", "spark.eventLog.enabled=true",
            "--conf", "spark.eventLog.compress=false",
            "--conf", f"spark.eventLog.dir=file://{events}",
            # Executors of a real cluster hold none of the user's credentials: here they would
            # inherit the launcher's environment, so take them away.
            "--conf", "spark.executorEnv.BLOBHA_TOKEN_FILE=",
            "--conf", "spark.executorEnv.BLOBHA_CA=",
            "--driver-memory", "512m",
            "--py-files", str(files["lib"]),
            str(files["job"]), str(out),
        ])
    printed = capfd.readouterr()
    assert status == 0, printed.err[-5000:]
    result = _read(out)
    assert sorted(r["value"] for r in result["rows"]) == [3 * i + 100 for i in range(4)]
    for row in result["rows"]:
        assert row["refused"] and row["own_token"] == "" and row["own_ca"] == "", row
        assert row["module"].startswith(str((tmp_path / "node-cache").resolve()))
    assert "job token " in caplog.text

    # The token never shows: not in spark-submit --verbose, not in the event log (what the
    # UI and the history server show), where its confs are listed as redacted.
    log_files = [p for p in events.rglob("*") if p.is_file()]
    assert log_files
    event_log = "".join(p.read_text() for p in log_files)
    assert "bjt1." not in event_log and "bjt1." not in printed.out + printed.err
    assert '"spark.blobha.job.token":"*********(redacted)"' in event_log
    assert '"spark.executorEnv.BLOBHA_JOB_TOKEN":"*********(redacted)"' in event_log
    assert "spark.blobha.job.token" in printed.out + printed.err  # --verbose lists it, redacted


ENV_JOB = '''
import json, os, sys
from pyspark.sql import SparkSession

def task(i):
    import envonly  # in the environment archive only
    return {"value": envonly.VALUE + i, "executable": sys.executable,
            "prefix": os.path.realpath(sys.prefix), "env": os.path.realpath("./env")}

spark = SparkSession.builder.getOrCreate()
sc = spark.sparkContext
rows = sc.parallelize(range(4), 4).map(task).collect()
json.dump({"app": sc.applicationId, "rows": rows}, open(sys.argv[1], "w"))
spark.stop()
'''


def test_spark_pyspark_python_runs_the_interpreter_of_the_environment_archive(
    cluster: LocalCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "job"
    root.mkdir()
    archive = env_archive(root)
    job = root / "job.py"
    job.write_text(textwrap.dedent(ENV_JOB))
    out = tmp_path / "out.json"
    cache_dir = tmp_path / "node-cache"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in spark_env(tmp_path / "w").items():
            mp.setenv(k, v)
        status = blobspark.submit_main([
            "--cluster", cluster.cluster, "--user", "bob", "--cache-dir", str(cache_dir),
            "--",
            "--master", MASTER,
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.ui.showConsoleProgress=false",
            "--conf", "spark.executor.memory=512m",
            "--driver-memory", "512m",
            "--archives", f"{archive}#env",
            "--conf", "spark.pyspark.python=./env/bin/python",
            str(job), str(out),
        ])
    assert status == 0, capfd.readouterr().err[-5000:]
    result = _read(out)
    assert sorted(r["value"] for r in result["rows"]) == [1000 + i for i in range(4)]
    cache = str(cache_dir.resolve())
    for row in result["rows"]:
        assert row["executable"].endswith("/env/bin/python"), row
        assert row["prefix"] == row["env"] and row["env"].startswith(cache + os.sep), row
