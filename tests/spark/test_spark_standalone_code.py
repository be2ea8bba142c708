"""The job's own code and a job token on a real standalone Spark cluster of two worker nodes,
the blob store in ``auth.mode=token`` with TLS, the driver in client mode.

The nodes hold no blobha credentials (no token file, no CA, no ``BLOBHA_*`` setting): what the
executors read with comes through the Spark conf. The job is plain PySpark: it imports a
module from ``--py-files``, reads a ``--files`` entry through ``SparkFiles.get``, an
``--archives data.tgz#data`` tree through ``./data/...`` and a ``--blob`` side file through
``blob_path``. Every one of those reaches each node once, from the masters into the node's
cache; the driver serves none of them; a second application downloads nothing. On the
workers, the job token neither writes nor reads another key, and a job token past its lifetime,
a revoked one and a tampered one are refused (``tests/integration/test_job_tokens.py`` covers
the same refusals on each master).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blobha_spark_helpers import CommandLineWatch, env_archive, job_files, require_spark
from standalone import StandaloneSpark, master_downloads
from support.clusters import running_cluster
from support.waiting import wait_until

from blobha.client import Client
from blobha.core.errors import Unauthenticated
from blobha.ops.localcluster import LocalCluster
from blobha.wire.credentials import Credentials

require_spark()

pytestmark = pytest.mark.spark

SIDE_KEY = "standalone-side"
OTHER_KEY = "standalone-other"  # alice's too, but not the job's

JOB = '''
import json, os, sys
from pyspark import SparkFiles
from pyspark.sql import SparkSession

import jobhelper  # client mode: the driver imports the py-files as plain spark-submit allows

LEAKED = json.load(open(sys.argv[2]))  # read on the driver; the tasks get it in their closure

def exposed():
    """Every process on this machine whose command line shows a job token (shown by its id
    only), and how many executor JVMs there are: read while this task runs, so with the
    executors, their Python workers, the driver and spark-submit all alive."""
    hits, executors = [], 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "bjt1." in line:
            # bjt1.ID.SECRET shown as bjt1.ID.<secret> (22 characters make "bjt1.ID.")
            hits.append(pid + ": " + " ".join(
                w[:w.index("bjt1.") + 22] + "<secret>" if "bjt1." in w else w
                for w in line.split()))
        executors += "CoarseGrainedExecutorBackend" in line
    return hits, executors

def task(i):
    import jobhelper
    from blobha.client import Client
    from blobha.core.errors import BlobError
    from blobha.spark import blob_path, current_settings
    from blobha.spark.executor import job_credentials
    with open(SparkFiles.get("factor.txt")) as f:
        factor = int(f.read())
    with open("./data/table/values.txt") as f:
        values = [int(v) for v in f.read().split()]
    with open(blob_path("side.txt")) as f:
        side = int(f.read())
    from blobha.wire.credentials import Credentials
    settings = current_settings()
    creds = job_credentials(settings.resolved_cache_dir())
    refusals = {}
    with Client(settings.cluster, credentials=creds, timeout=20) as c:
        for what, op in (("write", lambda: c.create("standalone-token-write", b"x")),
                         ("other key", lambda: c.read("@OTHER@"))):
            try:
                op()
                refusals[what] = ""
            except BlobError as e:
                refusals[what] = type(e).__name__
    # Leaked tokens: one past its lifetime, one revoked (both given to the job by the test),
    # and this job's own with its secret altered; each tries the job's side file.
    prefix, secret = creds.bearer.rsplit(".", 1)
    bad = {**LEAKED,
           "tampered": prefix + "." + secret[:-1] + ("A" if secret[-1] != "A" else "B")}
    for what, token in sorted(bad.items()):
        with Client(settings.cluster, credentials=Credentials(ca=creds.ca, bearer=token),
                    timeout=20) as leaked:
            try:
                leaked.read("@SIDE@")
                refusals[what] = ""
            except BlobError as e:
                refusals[what] = type(e).__name__ + ": " + str(e)
    shown, executors = exposed()
    return {
        "exposed": shown, "executors": executors,
        "value": jobhelper.triple(i) * factor + sum(values) + side,
        "home": os.environ.get("HOME", ""),
        "module": os.path.realpath(jobhelper.__file__.split(".zip")[0] + ".zip"),
        "factor": os.path.realpath(SparkFiles.get("factor.txt")),
        "data": os.path.realpath("./data"),
        "refusals": refusals,
        "own": sorted(k for k in ("BLOBHA_CA", "BLOBHA_CERT", "BLOBHA_KEY",
                                  "BLOBHA_TOKEN_FILE") if os.environ.get(k)),
    }

spark = SparkSession.builder.getOrCreate()
sc = spark.sparkContext
rows = sc.parallelize(range(8), 8).map(task).collect()
conf = sc.getConf()
json.dump({"app": sc.applicationId, "driver_triple": jobhelper.triple(1), "rows": rows,
           "shipped": [conf.get(k, "") for k in
                       ("spark.files", "spark.submit.pyFiles", "spark.archives")]},
          open(sys.argv[1], "w"))
spark.stop()
'''.replace("@OTHER@", OTHER_KEY).replace("@SIDE@", SIDE_KEY)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("secure"), tls=True) as c:
        with Client(c.cluster, user="alice", timeout=60, credentials=c.credentials("alice")) as a:
            a.create(SIDE_KEY, b"100", acl="u:alice:rwa", replication_factor=3)
            a.create(OTHER_KEY, b"secret", acl="u:alice:rwa", replication_factor=3)
            assert a.wait_for_replication([SIDE_KEY, OTHER_KEY], 3, 30).reached
        yield c


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneSpark]:
    with StandaloneSpark(tmp_path_factory.mktemp("spark"), workers=2) as s:
        yield s


def _code_args(files: dict[str, Path]) -> list[str]:
    return ["--conf", f"spark.pyspark.python={sys.executable}",
            "--py-files", str(files["lib"]),
            "--files", str(files["factor"]),
            "--archives", f"{files['data']}#data"]


def _launch(cluster: LocalCluster, spark: StandaloneSpark, job: Path, args: list[str],
            work: Path, job_args: tuple[str, ...] = (),
            wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``blobha spark-submit`` of ``job`` with the Spark arguments ``args``, as alice (run
    under ``wrapper``), writing the job's output to ``work/out.json``."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out.json"
    creds = cluster.credentials("alice")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_", "SPARK_", "BLOBHA_"))}
    # The submitting user's own credentials, on the submitting machine only.
    env.update(BLOBHA_CLUSTER=cluster.cluster, BLOBHA_USER="alice", BLOBHA_CA=str(creds.ca),
               BLOBHA_TOKEN_FILE=str(creds.token_file),
               BLOBHA_CACHE_DIR=str(work / "driver-cache"))
    cmd = [*wrapper, sys.executable, "-m", "blobha", "spark-submit",
           "--blob", f"{SIDE_KEY}:side.txt", "--min-replication", "2", "--max-wait", "60s",
           "--token-lifetime", "1h", "--",
           "--master", spark.url, "--deploy-mode", "client",
           "--conf", "spark.executor.memory=512m", "--conf", "spark.driver.memory=512m",
           "--conf", "spark.cores.max=2", "--conf", "spark.ui.enabled=false",
           *args, str(job), str(out), *job_args]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)


def _submit(cluster: LocalCluster, spark: StandaloneSpark, job: Path, args: list[str],
            work: Path, job_args: tuple[str, ...] = ()) -> tuple[dict[str, Any], str]:
    """:func:`_launch`, which must succeed; the job's output, and what the launcher printed."""
    done = _launch(cluster, spark, job, args, work, job_args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return dict(json.loads((work / "out.json").read_text())), done.stdout + done.stderr


def _executor_logs(spark: StandaloneSpark, app: str) -> str:
    logs = []
    for home in spark.homes:
        for p in sorted((home.parent / "work" / app).rglob("std*")):
            logs.append(p.read_text(errors="replace"))
    assert logs, f"no executor logs of {app}"
    return "\n".join(logs)


def _expired_and_revoked_tokens(cluster: LocalCluster, path: Path) -> str:
    """Two job tokens for the side file, in a JSON file for the job (``path``, returned): one
    past its lifetime, one revoked; each refused, by the time this returns, when this process
    asks."""
    with Client(cluster.cluster, user="alice", credentials=cluster.credentials("alice")) as a:
        expired = a.issue_job_token([SIDE_KEY], lifetime_secs=1)
        revoked = a.issue_job_token([SIDE_KEY], lifetime_secs=3600)
        a.revoke_job_token(revoked.token_id)
    creds = cluster.credentials("alice")
    for token in (expired.token, revoked.token):
        def refused(token: str = token) -> bool:
            with Client(cluster.cluster, timeout=10,
                        credentials=Credentials(ca=creds.ca, bearer=token)) as job:
                try:
                    job.get_meta(SIDE_KEY)
                except Unauthenticated:
                    return True
                return False

        wait_until(refused, timeout=30, what="the job token to be refused")
    path.write_text(json.dumps({"expired": expired.token, "revoked": revoked.token}))
    return str(path)


def test_job_code_and_side_file_reach_each_node_once_with_a_job_token(
        secure: LocalCluster, spark: StandaloneSpark, tmp_path: Path) -> None:
    files = job_files(tmp_path / "job", JOB)
    leaked = _expired_and_revoked_tokens(secure, tmp_path / "leaked.json")
    with CommandLineWatch() as watch:
        first, printed = _submit(secure, spark, files["job"], _code_args(files),
                                 tmp_path / "first", (leaked,))
    # No job token on any command line of the machine (what every account reads in ps): not
    # spark-submit's, the driver's, nor the executors' or their Python workers', read from a
    # thread here all along the launch and from inside each task, with all of them alive.
    assert watch.exposed == {}, watch.exposed
    assert watch.seen == set(watch.markers) and watch.scans > 10, (watch.seen, watch.scans)
    for row in first["rows"]:
        assert row["exposed"] == [] and row["executors"] >= 2, row

    # 3*i*10 + (1+2+3) + 100: from the zip, the file, the archive and the side blob.
    assert sorted(r["value"] for r in first["rows"]) == [30 * i + 106 for i in range(8)]
    assert first["driver_triple"] == 3
    # Both nodes ran tasks, each laid out from its own node cache.
    assert {r["home"] for r in first["rows"]} == {str(h) for h in spark.homes}
    for row in first["rows"]:
        for what in ("module", "factor", "data"):
            assert row[what].startswith(row["home"] + "/"), (what, row)
        # The executors read with the job token alone: nothing of their own, and it neither
        # writes nor reads a key outside the job.
        assert row["own"] == [], row
        refusals = row["refusals"]
        assert {refusals.pop("write"), refusals.pop("other key")} == {"NotAuthorized"}, row
        # Past its lifetime: "expired at ...", or, once a leader swept its record away (the
        # launcher's own token issue sweeps), refused as unknown.
        assert refusals["expired"].startswith("Unauthenticated: the job token "), row
        for what in ("expired", "revoked", "tampered"):
            assert "\n" not in refusals[what], row
        for what in ("revoked", "tampered"):
            assert refusals[what].startswith("Unauthenticated: the job token was refused"), row
    assert "job token " in printed and "bjt1." not in printed
    # Four blobs (three of code, one side file), each downloaded once per node.
    # Four blobs (three of code, one side file), each downloaded once per node: the counters
    # each node's cache keeps on disk for every process on the node.
    assert spark.node_downloads() == [4, 4]
    # Spark ships none of them: the driver's file server serves nothing, and no executor
    # fetched anything from it.
    assert first["shipped"] == ["", "", ""]
    logs = _executor_logs(spark, first["app"])
    assert "Fetching spark://" not in logs and "Fetching file:" not in logs

    # A second application: both nodes' caches serve it; nothing is uploaded or downloaded
    # (counted on the masters, once they hold every copy and sync nothing more).
    with Client(secure.cluster, user="alice", credentials=secure.credentials("alice")) as c:
        keys = [*c.list(prefix="code.alice."), SIDE_KEY]
        assert len(keys) == 4
        assert c.wait_for_replication(keys, 3, timeout=60).reached
    before = master_downloads(secure)
    second, printed = _submit(secure, spark, files["job"], _code_args(files),
                              tmp_path / "second", (leaked,))
    assert sorted(r["value"] for r in second["rows"]) == [30 * i + 106 for i in range(8)]
    assert "uploaded " not in printed
    assert spark.node_downloads() == [4, 4]
    assert master_downloads(secure) - before == 0


ENV_JOB = '''
import json, os, sys
from pyspark.sql import SparkSession

def task(i):
    import envonly  # in the environment archive only
    return {"value": envonly.VALUE + i, "executable": sys.executable,
            "home": os.environ.get("HOME", ""), "prefix": os.path.realpath(sys.prefix),
            "env": os.path.realpath("./env")}

spark = SparkSession.builder.getOrCreate()
sc = spark.sparkContext
rows = sc.parallelize(range(8), 8).map(task).collect()
json.dump({"app": sc.applicationId, "rows": rows}, open(sys.argv[1], "w"))
spark.stop()
'''


def test_a_packed_environment_is_the_executors_python_on_both_nodes(
        secure: LocalCluster, spark: StandaloneSpark, tmp_path: Path) -> None:
    root = tmp_path / "job"
    root.mkdir()
    archive = env_archive(root)
    job = root / "job.py"
    job.write_text(textwrap.dedent(ENV_JOB))
    before = spark.node_downloads()
    result, _ = _submit(secure, spark, job, [
        "--archives", f"{archive}#env", "--conf", "spark.pyspark.python=./env/bin/python",
        # Client mode: the driver runs here, where ./env does not exist (as Spark's own docs
        # have it, the driver's interpreter is named apart).
        "--conf", f"spark.pyspark.driver.python={sys.executable}",
    ], tmp_path / "w")
    assert sorted(r["value"] for r in result["rows"]) == [1000 + i for i in range(8)]
    assert {r["home"] for r in result["rows"]} == {str(h) for h in spark.homes}
    for row in result["rows"]:
        # The interpreter of the archive, unpacked once in the node's own cache.
        assert row["executable"].endswith("/env/bin/python"), row
        assert row["prefix"] == row["env"] and row["env"].startswith(row["home"] + "/"), row
    # The archive once per node; the job reads no side file, so nothing else comes.
    assert [a - b for a, b in zip(spark.node_downloads(), before, strict=True)] == [1, 1]


def test_bad_job_files_fail_before_launch_with_one_line_naming_the_file(
        secure: LocalCluster, spark: StandaloneSpark, tmp_path: Path) -> None:
    files = job_files(tmp_path / "job", JOB)
    unreadable = tmp_path / "job" / "secret.txt"
    unreadable.write_text("7")
    unreadable.chmod(0)
    evil = tmp_path / "job" / "evil.tgz"
    with tarfile.open(evil, "w:gz") as t:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    # Root reads any file: without the capabilities that let it, root is refused as any user.
    as_user = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search") \
        if os.geteuid() == 0 else ()
    cases = {
        "missing": (["--py-files", str(tmp_path / "job" / "gone.zip")],
                    f"{tmp_path}/job/gone.zip: no such file"),
        "unreadable": (["--files", str(unreadable)], f"{unreadable}: cannot read it"),
        "unsafe archive": (["--archives", f"{evil}#data"], f"{evil}: "),
    }
    state = spark.state()
    apps_before = len(state["activeapps"]) + len(state["completedapps"])
    with Client(secure.cluster, user="alice", credentials=secure.credentials("alice")) as c:
        code_before = set(c.list(prefix="code.alice."))
    for what, (args, message) in cases.items():
        done = _launch(secure, spark, files["job"], [*_code_args(files)[:2], *args],
                       tmp_path / what.replace(" ", "-"), wrapper=as_user)
        assert done.returncode != 0, (what, done.stdout[-2000:], done.stderr[-3000:])
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], (what, lines)
        assert "Traceback" not in lines[0]
    # None reached Spark, and nothing was stored.
    state = spark.state()
    assert len(state["activeapps"]) + len(state["completedapps"]) == apps_before
    with Client(secure.cluster, user="alice", credentials=secure.credentials("alice")) as c:
        assert set(c.list(prefix="code.alice.")) == code_before
    assert not (tmp_path / "escape.txt").exists()
