"""A run from start to end, and ``blobha bench``'s entry point (:func:`main`)."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

from blobha.ops.bench import (
    apart,
    bigblob,
    failover,
    peerplan,
    production,
    scale,
    smallops,
    spark,
)
from blobha.ops.bench.baselines import unjournaled_ext4
from blobha.ops.bench.context import Bench
from blobha.ops.bench.options import (
    LOCAL_ONLY,
    SESSION_TIMEOUT_MS,
    BenchOptions,
    parse_metrics,
)
from blobha.ops.bench.report import Log, Metric, format_json, format_table
from blobha.ops.localcluster import LocalCluster, cpus_allowed
from blobha.ops.zkserver import heap_mb_for


def run_groups(bench: Bench) -> list[Metric]:
    """Every chosen metric group, in the order of METRIC_GROUPS."""
    groups = set(bench.opts.metrics)
    if groups & {"upload_mbps", "replication_1g_s", "download_mbps"}:
        bigblob.big_blob(bench, groups)
    if "replication_latency_ms" in groups:
        bigblob.replication_latency(bench)
    if "small_ops_per_s" in groups:
        smallops.small_ops(bench)
    if "upload_w2_mbps" in groups:
        production.upload_w2(bench)
    if "upload_w2_apart_mbps" in groups and bench.lc is not None:
        apart.upload_w2_apart(bench)
    if "small_ops_w2_per_s" in groups:
        production.small_ops_w2(bench)
    if "replication_latency_w2_ms" in groups:
        production.replication_latency_w2(bench)
    if groups & {"upload_tls_mbps", "download_tls_mbps"} and bench.lc is not None:
        production.tls_transfers(bench, groups)
    if "peer_plan_s" in groups:
        peerplan.peer_plan(bench)
    if "spark" in groups:
        spark.spark(bench)
    if "spark_env_start" in groups:
        spark.spark_env_start(bench)
    for name, sig, restart in (("failover_term_s", signal.SIGTERM, False),
                               ("failover_kill_s", signal.SIGKILL, False),
                               ("failover_kill_restart_s", signal.SIGKILL, True)):
        if name in groups and bench.lc is not None:
            failover.failover(bench, name, sig, restart)
    if "scale" in groups and bench.lc is not None:
        scale.scale(bench)
    return bench.metrics


def run(cluster_addr: str | None, local: bool, opts: BenchOptions, log: Log) -> list[Metric]:
    with tempfile.TemporaryDirectory(prefix="blobha-bench-") as tmp:
        lc: LocalCluster | None = None
        zk_connect = opts.zookeeper
        disk_dir = Path(opts.baseline_dir or tmp)
        if local:
            lc = LocalCluster(Path(tmp) / "cluster", nodes=3, base_port=0, overrides={
                "zookeeper.session.timeout.ms": opts.session_timeout_ms,
                "blobstore.disk.reserved.bytes": 0,
            }, spread_cpus=True, tls=opts.tls,
                zk_heap_mb=heap_mb_for(opts.scale_keys if "scale" in opts.metrics else 0))
            log.say(f"starting a local {'TLS ' if opts.tls else ''}cluster of 3 masters in"
                    f" {lc.data_dir}")
            try:
                lc.start()
            except BaseException:
                lc.stop()
                raise
            cluster_addr = lc.cluster
            zk_connect = lc.zk.connect_string
            disk_dir = lc.data_dir
            placed = [cpus_allowed(m.pid) for m in lc.masters]
            log.note(f"the masters run on CPUs {', '.join(placed)} (master.cpus; each on one CPU"
                     " unless BLOBHA_MASTER_CPUS is set: empty runs them anywhere); ZooKeeper"
                     " and the bench's clients run anywhere")
            device = unjournaled_ext4(lc.data_dir)
            if device is not None:
                # Said before any figure: the slowdown lasts minutes and is large enough to
                # mislead a reader comparing runs.
                log.note(f"{lc.data_dir} is on ext4 without a journal ({device}): there every"
                         " new file passes over each inode freed in the last minutes, so small"
                         " creates run about a fifth slower right after a large deletion (an"
                         " earlier run's clean-up); leave two minutes between runs")
        else:
            if zk_connect is None:
                log.note("no --zookeeper given: ZooKeeper baselines are 0 (no ratio)")
            log.note(f"disk baselines are measured in {disk_dir} on this machine; they describe"
                     " the masters' disks only if the masters run here")
        assert cluster_addr is not None
        credentials = production.local_credentials(lc) if lc is not None else None
        bench = Bench(cluster_addr, opts, log, lc, zk_connect, disk_dir, credentials)
        try:
            return run_groups(bench)
        finally:
            try:
                if lc is None:
                    bench.remove_created()
            finally:
                if lc is not None:
                    log.say("stopping the local cluster")
                    lc.stop()


def main(
    cluster: str | None,
    local: bool,
    as_json: bool,
    count: int = 100,
    size_mb: int = 1024,
    small_ops_seconds: float = 10.0,
    scale_keys: int = 100_000,
    metrics: str | None = None,
    repeat: int = 3,
    zookeeper: str | None = None,
    baseline_dir: str | None = None,
    spark_size_mb: int = 256,
    spark_env_size_mb: int = 320,
    tls: bool = False,
    fanout_nodes: int = 8,
    fanout_rate_mbit: float = 200.0,
    fanout_peers: bool = True,
    session_timeout_ms: int | None = None,
    spark_java_options: str = "",
) -> int:
    """``blobha bench``; returns the exit status."""
    if metrics is not None and "fanout" in {m.strip() for m in metrics.split(",")}:
        if {m.strip() for m in metrics.split(",")} != {"fanout"}:
            print("blobha: error: --metrics fanout runs alone (its cluster lives in network"
                  " namespaces of its own)", file=sys.stderr)
            return 2
        from blobha.ops.bench.fanout import run_fanout_group

        # The blob every executor's node gets: --spark-size-mb (default 256 MiB).
        return run_fanout_group(spark_size_mb, as_json, fanout_nodes, fanout_rate_mbit,
                                fanout_peers)
    if not local and not cluster:
        print("blobha: error: give --local or --cluster", file=sys.stderr)
        return 2
    if not local and session_timeout_ms is not None:
        print("blobha: error: --session-timeout-ms sets the local cluster's: add --local",
              file=sys.stderr)
        return 2
    try:
        opts = BenchOptions(
            size_mb=size_mb, count=count, small_ops_seconds=small_ops_seconds,
            scale_keys=scale_keys, repeat=repeat, metrics=parse_metrics(metrics),
            spark_size_mb=spark_size_mb, spark_env_size_mb=spark_env_size_mb,
            zookeeper=zookeeper,
            baseline_dir=baseline_dir,
            tls=tls,
            session_timeout_ms=(SESSION_TIMEOUT_MS if session_timeout_ms is None
                                else session_timeout_ms),
            spark_java_options=spark_java_options,
        )
        opts.check(local, explicit_metrics=metrics is not None)
    except ValueError as e:
        print(f"blobha: error: {e}", file=sys.stderr)
        return 2
    log = Log()
    if not local:
        skipped = [g for g in opts.metrics if g in LOCAL_ONLY]
        if skipped:
            log.note(f"skipped {', '.join(skipped)}: they need --local")
    # SIGTERM unwinds this through the finally blocks that stop a local cluster: the command
    # line turns it into an exception (blobha.cli.app).
    results = run(cluster, local, opts, log)
    if as_json:
        print(format_json(results))
    else:
        where = "a local 3-master cluster" if local else cluster
        print(f"blobha bench against {where}: --size-mb {opts.size_mb} --count {opts.count}"
              f" --small-ops-seconds {opts.small_ops_seconds:g} --scale-keys {opts.scale_keys}"
              f" --repeat {opts.repeat} --spark-size-mb {opts.spark_size_mb}"
              f" --spark-env-size-mb {opts.spark_env_size_mb}"
              + (f" --session-timeout-ms {opts.session_timeout_ms}" if local else "")
              + (f" --spark-java-options={opts.spark_java_options!r}"
                 if opts.spark_java_options else ""))
        print(format_table(results))
        for n in log.notes:
            print(f"note: {n}")
    return 0
