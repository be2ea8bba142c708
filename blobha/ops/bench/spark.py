"""The spark groups: blobha's node cache against ``sc.addFile`` (blobha.ops.bench_spark), and
a packed Python environment through blobha against ``spark-submit --archives``
(blobha.ops.bench_spark_env)."""

from __future__ import annotations

import importlib.util
from typing import cast

from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import bench_user
from blobha.ops.bench.options import SPARK_EXECUTORS, MiB


def spark(bench: Bench) -> None:
    """The Spark comparison (blobha.ops.bench_spark): time until every executor holds a
    ``--spark-size-mb`` blob, blobha against ``sc.addFile``, first and second application."""
    if importlib.util.find_spec("pyspark") is None:
        bench.log.note("spark skipped: pyspark is not installed (deploy/setup.sh spark)")
        return
    from blobha.ops.bench_spark import run_spark_bench

    size = bench.opts.spark_size_mb * MiB
    bench.log.say(f"Spark: every executor gets a {bench.opts.spark_size_mb} MiB blob, blobha"
                  " against sc.addFile, first and second application")
    for m in run_spark_bench(bench.cluster, size, executors=SPARK_EXECUTORS,
                             user=bench_user(), java_options=bench.opts.spark_java_options):
        bench.add(str(m["name"]), float(cast(float, m["value"])), str(m["unit"]),
                  str(m["baseline_name"]), float(cast(float, m["baseline_value"])))


def spark_env_start(bench: Bench) -> None:
    """Three applications whose executors run a packed Python environment, from submit until
    both executors ran a task: ``blobha spark-submit`` against ``spark-submit --archives``."""
    if importlib.util.find_spec("pyspark") is None:
        bench.log.note("spark_env_start skipped: pyspark is not installed (deploy/setup.sh spark)")
        return
    from blobha.ops.bench_spark_env import run_env_start_bench

    bench.log.say(f"Spark: applications with a {bench.opts.spark_env_size_mb} MiB packed Python"
                  " environment, blobha spark-submit against spark-submit --archives")
    for m in run_env_start_bench(bench.cluster, bench.opts.spark_env_size_mb * MiB,
                                 user=bench_user(), java_options=bench.opts.spark_java_options):
        bench.add(str(m["name"]), float(cast(float, m["value"])), str(m["unit"]),
                  str(m["baseline_name"]), float(cast(float, m["baseline_value"])))
