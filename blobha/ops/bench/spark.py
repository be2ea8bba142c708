"""The spark groups: blobha's node cache against ``sc.addFile`` (blobha.ops.bench.spark_cache), and
a packed Python environment through blobha against ``spark-submit --archives``
(blobha.ops.bench.spark_env)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import cast

from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import bench_user
from blobha.ops.bench.options import SPARK_EXECUTORS, MiB
from blobha.ops.bench.report import Log

#: The Spark benchmarks' logger: each application's times, the node caches' counters.
SPARK_LOGGER = "blobha.bench_spark"


class _ToLog(logging.Handler):
    def __init__(self, log: Log) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.say(f"  {record.getMessage()}")


@contextlib.contextmanager
def _progress(log: Log) -> Iterator[None]:
    """The Spark benchmarks' own lines among the run's progress lines (nothing else sets up
    logging in ``blobha bench``, and they tell where a group's minutes went)."""
    logger = logging.getLogger(SPARK_LOGGER)
    handler, level = _ToLog(log), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def spark(bench: Bench) -> None:
    """The Spark comparison (blobha.ops.bench.spark_cache): time until every executor holds a
    ``--spark-size-mb`` blob, blobha against ``sc.addFile``, first and second application."""
    if importlib.util.find_spec("pyspark") is None:
        bench.log.note("spark skipped: pyspark is not installed (deploy/setup.sh spark)")
        return
    from blobha.ops.bench.spark_cache import run_spark_bench

    size = bench.opts.spark_size_mb * MiB
    bench.log.say(f"Spark: every executor gets a {bench.opts.spark_size_mb} MiB blob, blobha"
                  " against sc.addFile, first and second application")
    with _progress(bench.log):
        metrics = run_spark_bench(bench.cluster, size, executors=SPARK_EXECUTORS,
                                  user=bench_user(), java_options=bench.opts.spark_java_options)
    for m in metrics:
        bench.add(str(m["name"]), float(cast(float, m["value"])), str(m["unit"]),
                  str(m["baseline_name"]), float(cast(float, m["baseline_value"])))


def spark_env_start(bench: Bench) -> None:
    """Three applications whose executors run a packed Python environment, from submit until
    both executors ran a task: ``blobha spark-submit`` against ``spark-submit --archives``."""
    if importlib.util.find_spec("pyspark") is None:
        bench.log.note("spark_env_start skipped: pyspark is not installed (deploy/setup.sh spark)")
        return
    from blobha.ops.bench.spark_env import run_env_start_bench

    bench.log.say(f"Spark: applications with a {bench.opts.spark_env_size_mb} MiB packed Python"
                  " environment, blobha spark-submit against spark-submit --archives")
    with _progress(bench.log):
        metrics = run_env_start_bench(bench.cluster, bench.opts.spark_env_size_mb * MiB,
                                      user=bench_user(),
                                      java_options=bench.opts.spark_java_options)
    for m in metrics:
        bench.add(str(m["name"]), float(cast(float, m["value"])), str(m["unit"]),
                  str(m["baseline_name"]), float(cast(float, m["baseline_value"])))
