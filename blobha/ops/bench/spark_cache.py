"""Spark benchmark: how soon every executor has a large blob, blobha next to ``sc.addFile``.

Measured side by side in one run, on Spark applications with ``executors`` separate executor
processes (``local-cluster[N,1,1024]``), for a blob of ``size_bytes``, from job start until
every executor holds the blob:

* **first application** (node cache empty). blobha: the pre-launch check and replication wait
  (what ``blobha spark-submit`` does before launching), then a job whose tasks (one per
  executor, run together as a barrier stage) call :func:`blobha.spark.blob_path`. Baseline:
  ``sc.addFile`` plus the same job calling ``SparkFiles.get``.
* **second application** (a new application on the same node): the same two measurements.
  blobha serves the node cache: within the update interval of the first application's
  version check, and with the file's digest check recorded on the node, a task needs neither
  a round trip nor a re-hash (nor the gRPC client); ``addFile`` transfers the file again,
  because Spark's fetch cache is per application.
* **second application, client loaded**: as the second, but the executors' Python workers
  have already imported ``blobha.spark`` (the first two count that import, as a job's first
  task that uses blobha pays it once per worker). The bench writes blobha's bytecode first,
  as an installed package has it, so that import does not include compiling the sources.
  This application starts 30-40 s after the first one's version check: past the default
  update interval (30 s), its tasks ask the cluster again, once for the node (one process
  asks, the others take its answer); the log says how many checks the node made.

Each application's executors are registered and their Python workers started before either
clock starts, so both sides pay only for getting the file. Each result is a dict with
``name``, ``value``, ``unit``, ``baseline_name``, ``baseline_value`` and ``ratio`` (value /
baseline; the targets are <= 1.2 for the first application and <= 0.1 for the second). The
log shows, per application, the pre-launch wait, the time ``blob_path`` took in each task and
what an empty job of the same shape costs (Spark's floor, paid by both sides).

Run it::

    python -m blobha.ops.bench.spark_cache --local --size-mib 256 --executors 2
    python -m blobha.ops.bench.spark_cache --cluster m1:6627,m2:6627,m3:6627 --json

Note: all executors of ``local-cluster`` share one machine, hence one blobha cache (one
download serves both), whereas ``addFile`` fetches once per executor; on a real cluster with
one executor per node the two fetch the same number of times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from blobha import spark as blobspark
from blobha.cache import BlobCache
from blobha.client import Client

log = logging.getLogger("blobha.bench_spark")

MiB = 1024 * 1024
DEFAULT_SIZE = 256 * MiB
LOCAL_NAME = "bench.bin"
_EXECUTOR_WAIT_SECS = 180.0


def metric(name: str, value: float, baseline_name: str, baseline: float) -> dict[str, object]:
    """One figure as the benchmarks report it, with its baseline and their ratio."""
    return {
        "name": name,
        "value": round(value, 4),
        "unit": "s",
        "baseline_name": baseline_name,
        "baseline_value": round(baseline, 4),
        "ratio": round(value / baseline, 4) if baseline else float("nan"),
    }


def _write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MiB)
            f.write(os.urandom(n))
            left -= n


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Task bodies, made inside functions so that they travel by value: a module-level function
# travels by reference, and unpickling it imports its module. The warm-up ones then never make
# a worker import blobha.spark as a side effect (whether it is loaded before the clock starts
# is the benchmark's explicit choice), and the timed ones import blobha.spark as a job's task
# would, without this module (argparse, statistics...: an import cost that no job pays).


def _warm_up_task(load_blobha: bool) -> Any:
    def run(_: Any) -> Iterator[int]:
        if load_blobha:
            import blobha.spark  # noqa: F401 - loading it is the point
        yield os.getpid()

    return run


def _blobha_ready(name: str) -> Any:
    def run(_: Any) -> Iterator[tuple[str, int, float]]:
        started = time.perf_counter()
        path = blobspark.blob_path(name)
        yield os.path.basename(os.getcwd()), os.stat(path).st_size, time.perf_counter() - started

    return run


def _addfile_ready(name: str) -> Any:
    def run(_: Any) -> Iterator[tuple[str, int]]:
        from pyspark import SparkFiles

        yield os.path.basename(os.getcwd()), os.stat(SparkFiles.get(name)).st_size

    return run


class _App:
    """One Spark application with its executors registered and Python workers started."""

    def __init__(self, master: str, name: str, executors: int, java_options: str = "") -> None:
        from pyspark.sql import SparkSession

        self.executors = executors
        builder = (
            SparkSession.builder.master(master)
            .appName(name)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
        )
        if java_options:
            # The driver's take effect where it starts: with this process's first application.
            builder = (builder.config("spark.driver.extraJavaOptions", java_options)
                       .config("spark.executor.extraJavaOptions", java_options))
        self.spark = builder.getOrCreate()
        self.sc = self.spark.sparkContext
        self.sc.setLogLevel("ERROR")
        tracker = self.sc.statusTracker()
        deadline = time.monotonic() + _EXECUTOR_WAIT_SECS
        # The driver is listed among the executor infos, hence '>'.
        while len(tracker.getExecutorInfos()) <= executors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{executors} executors did not register")
            time.sleep(0.1)

    def warm_up(self, load_blobha: bool = False) -> None:
        """Start every executor's Python worker (and, if asked, import blobha in it)."""
        self._barrier(_warm_up_task(load_blobha))

    def _barrier(self, fn: Any) -> list[Any]:
        # One task per executor, all at once: the stage ends when every executor has run it.
        rdd = self.sc.parallelize(range(self.executors), self.executors).barrier()
        return list(rdd.mapPartitions(fn).collect())

    def time_empty_job(self) -> float:
        """Spark's own cost of one such job, which both sides pay (logged, for context)."""
        started = time.perf_counter()
        self._barrier(_warm_up_task(False))
        return time.perf_counter() - started

    def time_blobha(self, key: str, cluster: str, user: str, size: int) -> tuple[float, float]:
        """(total, of which the pre-launch wait)."""
        started = time.perf_counter()
        # What 'blobha spark-submit' does before launching: access check and server-side wait.
        # Counted, although with the launcher it happens before the application starts.
        blobspark.wait_for_replication([key], 1, 60, cluster=cluster, user=user)
        waited = time.perf_counter() - started
        rows = self._barrier(_blobha_ready(LOCAL_NAME))
        elapsed = time.perf_counter() - started
        _check(rows, self.executors, size)
        log.info("blob_path in the tasks took %s s", ", ".join(f"{r[2]:.3f}" for r in rows))
        return elapsed, waited

    def time_addfile(self, path: Path, size: int) -> float:
        started = time.perf_counter()
        self.sc.addFile(str(path))
        rows = self._barrier(_addfile_ready(path.name))
        elapsed = time.perf_counter() - started
        _check(rows, self.executors, size)
        return elapsed

    def stop(self) -> None:
        app_id = self.sc.applicationId
        local_cluster = (self.sc.master or "").startswith("local-cluster")
        self.spark.stop()
        if local_cluster:
            # local-cluster workers keep each application's directory (executor logs, and
            # every addFile copy: here hundreds of MiB) under <spark home>/work, which for
            # pip's pyspark is inside site-packages, and no setting moves it.
            shutil.rmtree(_spark_home() / "work" / app_id, ignore_errors=True)


def _spark_home() -> Path:
    home = os.environ.get("SPARK_HOME")
    if home:
        return Path(home)
    import pyspark

    return Path(pyspark.__file__).parent


def _check(rows: list[tuple[Any, ...]], executors: int, size: int) -> None:
    if len({r[0] for r in rows}) != executors or any(r[1] != size for r in rows):
        raise RuntimeError(f"not every executor got the whole file: {rows}")


def _node_counters(cache_dir: Path, user: str) -> tuple[int, int, int, int]:
    """(downloads, version checks, digest re-checks, hits) of the node cache so far."""
    def no_client() -> Any:
        raise AssertionError("reading the counters needs no client")

    with BlobCache(cache_dir, user=user, connect=no_client) as cache:
        s = cache.stats()
    return s.downloads, s.checks, s.verifications, s.hits


def _compile_blobha() -> None:
    """Write blobha's bytecode, as installing the package does.

    The timed jobs import blobha in every Python worker. Installed from a wheel, blobha comes
    with its bytecode; run from a source tree where none is written (an editable install with
    PYTHONDONTWRITEBYTECODE set, as development containers often have) each worker would
    compile the modules first, tens of milliseconds that no deployment pays. Where the
    directory cannot be written this does nothing, and the figures include compiling.
    """
    import compileall

    package = Path(blobspark.__file__).parents[1]  # the whole blobha package
    if not compileall.compile_dir(str(package), quiet=2):
        log.warning("could not write the bytecode of %s: its import includes compiling", package)


def _one_round(
    cluster: str, user: str, master: str, executors: int, size: int, root: Path,
    java_options: str = "",
) -> dict[tuple[int, str], float]:
    """Both applications once, with a new key and an empty node cache."""
    key = f"bench-spark-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    blob_file = root / LOCAL_NAME
    _write_random(blob_file, size)
    try:
        with Client(cluster, user=user, timeout=300) as c:
            c.create(key, blob_file, acl="o::r")
            c.wait_for_replication([key], 1, 120)
        cache_dir = root / "node-cache"
        timings: dict[tuple[int, str], float] = {}
        # 1: empty cache; 2: cached; 3: cached, and the workers already have the blobha client
        # library loaded (apps 1 and 2 count its import, as a job's first task pays it).
        for app_no in (1, 2, 3):
            app = _App(master, f"blobha-bench-app{app_no}", executors, java_options)
            try:
                # Sets the workers' environment: done before the warm-up, so the measured job
                # reuses the warmed Python workers (a new environment means new ones).
                blobspark.prepare(
                    app.spark,
                    {key: {"localname": LOCAL_NAME}},
                    cluster=cluster,
                    user=user,
                    min_replication=1,
                    cache_dir=str(cache_dir),
                )
                app.warm_up(load_blobha=app_no == 3)
                empty = app.time_empty_job()
                before = _node_counters(cache_dir, user)
                total, waited = app.time_blobha(key, cluster, user, size)
                timings[app_no, "blobha"] = total
                after = _node_counters(cache_dir, user)
                log.info(
                    "application %d: the node cache made %d download(s), %d version check(s)"
                    " with the cluster and %d digest re-check(s), and served %d hit(s)",
                    app_no, *(after[i] - before[i] for i in range(4)),
                )
                timings[app_no, "addFile"] = app.time_addfile(blob_file, size)
            finally:
                app.stop()
            log.info(
                "application %d: blobha %.3f s (pre-launch wait %.3f s), addFile %.3f s;"
                " an empty job of the same shape takes %.3f s",
                app_no, total, waited, timings[app_no, "addFile"], empty,
            )
        with BlobCache(cache_dir, cluster, user=user) as cache:
            downloads = cache.stats().downloads
        if downloads != 1:
            raise RuntimeError(f"expected one download for the node, the cache made {downloads}")
        return timings
    finally:
        with contextlib.suppress(Exception), Client(cluster, user=user) as c:
            c.delete(key)
        shutil.rmtree(root, ignore_errors=True)


def run_spark_bench(
    cluster: str,
    size_bytes: int = DEFAULT_SIZE,
    executors: int = 2,
    *,
    rounds: int = 1,
    user: str | None = None,
    master: str | None = None,
    work_dir: str | None = None,
    java_options: str = "",
) -> list[dict[str, object]]:
    """Time "every executor has the blob" for blobha and ``sc.addFile``, in a first and in a
    second application; see the module docstring. With ``rounds`` > 1 each figure is the
    median of that many rounds (each with a new key and an empty cache). ``java_options``
    go to the driver's JVM (if this process starts it) and every executor's.

    >>> for m in run_spark_bench("127.0.0.1:6627", 64 * 1024 * 1024):  # doctest: +SKIP
    ...     print(m["name"], m["value"], m["baseline_value"], m["ratio"])
    spark_first_app_blob_ready_s 1.9 2.1 0.9
    spark_second_app_blob_ready_s 0.08 1.9 0.04
    """
    if executors < 1 or size_bytes < 1 or rounds < 1:
        raise ValueError("executors, size_bytes and rounds must be positive")
    master = master or f"local-cluster[{executors},1,1024]"
    user = user or "blobha-bench"
    root = Path(tempfile.mkdtemp(prefix="blobha-bench-spark-", dir=work_dir))
    env = {"PYSPARK_PYTHON": sys.executable}
    results: list[dict[tuple[int, str], float]] = []
    _compile_blobha()
    try:
        with _environment(env):
            for n in range(rounds):
                results.append(
                    _one_round(cluster, user, master, executors, size_bytes, root / f"r{n}",
                               java_options)
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def median(app_no: int, side: str) -> float:
        return statistics.median(r[app_no, side] for r in results)

    return [
        metric("spark_first_app_blob_ready_s", median(1, "blobha"),
                "spark_addfile_first_app_s", median(1, "addFile")),
        metric("spark_second_app_blob_ready_s", median(2, "blobha"),
                "spark_addfile_second_app_s", median(2, "addFile")),
        metric("spark_second_app_blob_ready_client_loaded_s", median(3, "blobha"),
                "spark_addfile_third_app_s", median(3, "addFile")),
    ]


def command_line(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every Spark benchmark's command line shares: where the cluster is, the
    blob's size, JSON output."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", default=os.environ.get("BLOBHA_CLUSTER"))
    where.add_argument("--local", action="store_true",
                       help="start a 3-master local cluster for the run")
    p.add_argument("--json", action="store_true", help="one JSON object per metric")
    return p


def run_and_print(p: argparse.ArgumentParser, args: argparse.Namespace,
                  run: Callable[[str], list[dict[str, Any]]]) -> int:
    """``run(cluster)`` against ``--cluster`` or a local cluster started for it (``--local``),
    then each metric printed: a table row, or with ``--json`` one JSON object."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.local:
        from blobha.ops.localcluster import LocalCluster

        with tempfile.TemporaryDirectory(prefix="blobha-bench-spark-cluster-") as tmp, \
                LocalCluster(Path(tmp), nodes=3, base_port=0,
                             overrides={"blobstore.disk.reserved.bytes": 0}) as lc:
            metrics = run(lc.cluster)
    elif args.cluster:
        metrics = run(args.cluster)
    else:
        p.error("give --cluster (or BLOBHA_CLUSTER) or --local")
    for m in metrics:
        if args.json:
            print(json.dumps(m))
        else:
            print(f"{m['name']:32} {m['value']:>9.3f} {m['unit']}   {m['baseline_name']:28}"
                  f" {m['baseline_value']:>9.3f} {m['unit']}   ratio {m['ratio']:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = command_line("python -m blobha.ops.bench.spark_cache",
                     "Time blobha against sc.addFile for getting a blob to every executor.")
    p.add_argument("--size-mib", type=float, default=DEFAULT_SIZE / MiB)
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="report the median of this many runs")
    args = p.parse_args(argv)
    size = int(args.size_mib * MiB)
    return run_and_print(p, args, lambda cluster: run_spark_bench(
        cluster, size, args.executors, rounds=args.rounds))


if __name__ == "__main__":
    sys.exit(main())
