"""Spark benchmark ``spark_env_start``: a packed Python environment as the executors' interpreter.

On a standalone Spark cluster of two worker nodes started for the run
(:class:`~blobha.ops.sparkstandalone.StandaloneSpark`, one executor per node, the driver in
client mode), three consecutive applications each way, timed from the moment the submit command
starts until the first task has run on both executors (the later of the two tasks' clocks):

* ``blobha spark-submit -- --archives env.tgz#env --conf spark.pyspark.python=./env/bin/python``:
  the first application uploads the archive (content-addressed) and waits for its minimum
  replication; each node's cache downloads and unpacks it once; later applications link the
  node's unpacked tree;
* baseline, plain ``spark-submit`` with the same arguments: the driver serves the archive and
  every executor fetches and unpacks it again, for every application.

The archive is a virtual environment (a copied interpreter, as ``venv-pack`` makes) filled to
``size_bytes`` with package files of random content, so that gzip cannot shrink it; PySpark and
blobha come from this machine's installation through a ``.pth`` file. A marker module with a
new value each run makes its content, hence its blob key, new: the first application always
uploads. Each result is a dict with ``name``, ``value``, ``unit``, ``baseline_name``,
``baseline_value`` and ``ratio`` (targets: at most 1.2 for the first application, at most
0.25 for the second and third). The log shows each application's time, how many downloads each
node's cache made and what an application without the archive costs (Spark's own floor).

Run it::

    python -m blobha.ops.bench.spark_env --local --size-mib 320
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

from blobha.client import Client
from blobha.ops.bench.spark_cache import command_line, metric, run_and_print
from blobha.ops.sparkstandalone import StandaloneSpark, spark_home
from blobha.spark.jobcode import code_key, digest_path

log = logging.getLogger("blobha.bench_spark")  # the Spark benchmarks share one logger

MiB = 1024 * 1024
DEFAULT_SIZE = 320 * MiB
EXECUTORS = 2
APPLICATIONS = 3
#: One application's bound: far above what even a slow machine needs for a few hundred MiB.
_APP_TIMEOUT_SECS = 900.0
_BALLAST_FILE = 256 * 1024

# Runs on the driver. Waits for both executors (their start is part of what is timed), then
# one task per executor at once; each task reports when it ran, under which node's HOME and
# with which interpreter.
_JOB = '''
import json, os, sys, time
started = time.time()
from pyspark.sql import SparkSession

executors, with_env = int(sys.argv[2]), sys.argv[3] == "env"

def first(_):
    mark = ""
    if with_env:
        import envmark  # in the environment archive only
        mark = envmark.MARK
    yield {"ran": time.time(), "home": os.environ.get("HOME", ""), "mark": mark,
           "prefix": os.path.realpath(sys.prefix)}

spark = SparkSession.builder.getOrCreate()
sc = spark.sparkContext
deadline = time.monotonic() + 600
while len(sc.statusTracker().getExecutorInfos()) <= executors:  # the driver is listed too
    if time.monotonic() > deadline:
        raise SystemExit(f"{executors} executors did not register")
    time.sleep(0.05)
registered = time.time()
rows = sc.parallelize(range(executors), executors).barrier().mapPartitions(first).collect()
json.dump({"app": sc.applicationId, "rows": rows, "driver": started, "registered": registered},
          open(sys.argv[1], "w"))
spark.stop()
'''


def build_env_archive(root: Path, size_bytes: int, mark: str) -> Path:
    """``root/env.tgz``: a relocatable virtual environment of about ``size_bytes`` packed, with
    the module ``envmark`` (``MARK = mark``) found nowhere else."""
    env = root / "envsrc"
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(env)],
                   check=True)
    purelib = next(env.glob("lib/python*/site-packages"))
    (purelib / "envmark.py").write_text(f"MARK = {mark!r}\n")
    ours = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
    (purelib / "outer.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    ballast = purelib / "ballast"
    ballast.mkdir()
    for n in range(max(size_bytes // _BALLAST_FILE, 1)):
        (ballast / f"part{n:05d}.bin").write_bytes(os.urandom(_BALLAST_FILE))
    archive = root / "env.tgz"
    # Level 1: the ballast is incompressible, and the archive is made once per run.
    with tarfile.open(archive, "w:gz", compresslevel=1) as t:
        for path in sorted(env.rglob("*")):
            if "__pycache__" not in path.parts:
                t.add(path, arcname=str(path.relative_to(env)), recursive=False)
    shutil.rmtree(env)
    return archive


def _spark_args(spark: StandaloneSpark, archive: Path | None, java_options: str = ""
                ) -> list[str]:
    args = ["--master", spark.url, "--deploy-mode", "client",
            "--conf", "spark.executor.memory=512m", "--conf", "spark.driver.memory=512m",
            "--conf", f"spark.cores.max={EXECUTORS}", "--conf", "spark.ui.enabled=false",
            # Client mode: the driver runs here, where ./env does not exist.
            "--conf", f"spark.pyspark.driver.python={sys.executable}"]
    if java_options:
        args += ["--conf", f"spark.driver.extraJavaOptions={java_options}",
                 "--conf", f"spark.executor.extraJavaOptions={java_options}"]
    if archive is None:
        return [*args, "--conf", f"spark.pyspark.python={sys.executable}"]
    return [*args, "--archives", f"{archive}#env",
            "--conf", "spark.pyspark.python=./env/bin/python"]


def _run_app(command: list[str], env: dict[str, str], work: Path, job: Path,
             spark: StandaloneSpark, mark: str | None) -> float:
    """Run one application; seconds from its start until both executors had run a task. The
    log splits that: until the driver's script ran, until both executors registered, until
    their first tasks ran."""
    work.mkdir(parents=True)
    out = work / "out.json"
    started = time.time()
    with_env = "env" if mark is not None else "none"
    done = subprocess.run([*command, str(job), str(out), str(EXECUTORS), with_env], cwd=work,
                          env=env,
                          capture_output=True, text=True, timeout=_APP_TIMEOUT_SECS)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} exited with {done.returncode}: "
                           + (done.stderr or done.stdout)[-3000:])
    result = json.loads(out.read_text())
    rows = result["rows"]
    if {r["home"] for r in rows} != {str(h) for h in spark.homes}:
        raise RuntimeError(f"the tasks did not run on every node: {rows}")
    # The environment's interpreter: unpacked on the task's own node (in Spark's application
    # directory, or in blobha's node cache).
    if mark is not None and any(
            r["mark"] != mark or not r["prefix"].startswith(str(Path(r["home"]).parent) + "/")
            for r in rows):
        raise RuntimeError(f"the executors did not run the environment's interpreter: {rows}")
    for node in range(spark.workers):  # Spark's per-application copies: hundreds of MiB each
        shutil.rmtree(spark.work_dir(node) / result["app"], ignore_errors=True)
    ran = max(float(r["ran"]) for r in rows)
    log.info("%s: driver script at %.2f s, executors registered at %.2f s, tasks ran at %.2f s",
             work.name, result["driver"] - started, result["registered"] - started,
             ran - started)
    return ran - started


def run_env_start_bench(
    cluster: str,
    size_bytes: int = DEFAULT_SIZE,
    *,
    user: str | None = None,
    work_dir: str | None = None,
    java_options: str = "",
) -> list[dict[str, object]]:
    """Time three applications each way; see the module docstring. ``cluster`` is the blob
    store's address; credentials come from the ``BLOBHA_*`` environment, as the launcher's do.
    ``java_options`` go to every Spark JVM: the daemons, each application's driver and
    executors."""
    if size_bytes < 1:
        raise ValueError("size_bytes must be positive")
    user = user or "blobha-bench"
    root = Path(tempfile.mkdtemp(prefix="blobha-bench-spark-env-", dir=work_dir))
    mark = uuid.uuid4().hex
    key = ""
    try:
        archive = build_env_archive(root / "input", size_bytes, mark)
        key = code_key(user, digest_path(str(archive)), archive.name)
        log.info("environment archive: %.0f MiB packed", archive.stat().st_size / MiB)
        job = root / "input" / "job.py"
        job.write_text(textwrap.dedent(_JOB))
        plain_env = {k: v for k, v in os.environ.items()
                     if not k.startswith(("BLOBHA_", "PYSPARK_", "SPARK_"))}
        plain_env["SPARK_HOME"] = str(spark_home())
        blobha_env = {**{k: v for k, v in os.environ.items()
                         if not k.startswith(("PYSPARK_", "SPARK_"))},
                      "SPARK_HOME": str(spark_home()), "BLOBHA_CLUSTER": cluster,
                      "BLOBHA_USER": user, "BLOBHA_CACHE_DIR": str(root / "driver-cache")}
        submit = [str(spark_home() / "bin" / "spark-submit")]
        launcher = [sys.executable, "-m", "blobha", "spark-submit", "--"]
        timings: dict[tuple[int, str], float] = {}
        with StandaloneSpark(root / "spark", workers=EXECUTORS,
                             java_options=java_options) as spark:
            floor = _run_app([*submit, *_spark_args(spark, None, java_options)], plain_env,
                             root / "floor", job, spark, None)
            for app_no in range(1, APPLICATIONS + 1):
                args = _spark_args(spark, archive, java_options)
                timings[app_no, "archives"] = _run_app(
                    [*submit, *args], plain_env, root / f"plain{app_no}", job, spark, mark)
                timings[app_no, "blobha"] = _run_app(
                    [*launcher, *args], blobha_env, root / f"blobha{app_no}", job, spark, mark)
                log.info("application %d: blobha %.2f s, spark-submit --archives %.2f s;"
                         " node cache downloads so far %s", app_no, timings[app_no, "blobha"],
                         timings[app_no, "archives"], spark.node_downloads())
            log.info("an application without the archive takes %.2f s (Spark's floor)", floor)
            downloads = spark.node_downloads()
        if downloads != [1] * EXECUTORS:
            raise RuntimeError(f"expected one download per node, the caches made {downloads}")
    finally:
        if key:
            try:
                with Client(cluster, user=user, timeout=60) as c:
                    c.delete(key)
            except Exception as exc:  # clean-up must not hide the result
                log.warning("could not delete %s: %s", key, exc)
        shutil.rmtree(root, ignore_errors=True)
    names = {1: "first", 2: "second", 3: "third"}
    return [metric(f"spark_env_start_{names[n]}_app_s", timings[n, "blobha"],
                    f"spark_archives_{names[n]}_app_s", timings[n, "archives"])
            for n in range(1, APPLICATIONS + 1)]


def main(argv: list[str] | None = None) -> int:
    p = command_line("python -m blobha.ops.bench.spark_env",
                     "Time blobha against spark-submit --archives for starting applications"
                     " whose executors run a packed Python environment.")
    p.add_argument("--size-mib", type=float, default=DEFAULT_SIZE / MiB)
    args = p.parse_args(argv)
    size = int(args.size_mib * MiB)
    return run_and_print(p, args, lambda cluster: run_env_start_bench(cluster, size))


if __name__ == "__main__":
    sys.exit(main())
