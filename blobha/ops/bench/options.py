"""What a run measures and with what: the metric groups, the options, the workload's sizes."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024
#: ZooKeeper session timeout of the local clusters a run starts, unless --session-timeout-ms.
SESSION_TIMEOUT_MS = 6000
#: The least a master accepts (``zookeeper.session.timeout.ms``).
MIN_SESSION_TIMEOUT_MS = 1000
#: The chroot a local cluster's masters use (the configuration default).
CHROOT = "/blobha"
USER = "blobha-bench"
#: Concurrency of the "many clients" small-ops figures and of the scale phase's key creation.
CONCURRENT_CLIENTS = 8
SMALL_BLOB = 4 * 1024
#: Calls timed for each part of a create's floor (medians; also bounded in time).
FLOOR_ROUNDS = 300
#: Each scale key holds this much: big enough to be a real blob, small enough that 100,000 of
#: them measure metadata costs rather than disk bandwidth.
SCALE_BLOB = 1024
#: Bytes of each raw ZooKeeper baseline znode: about the size of a key's metadata znode.
ZK_NODE_BYTES = 256
CATCHUP_TIMEOUT = 3600.0
#: Separate executor processes in the Spark comparison (Spark's local-cluster mode).
SPARK_EXECUTORS = 2

#: Metric groups in the order they run; the big-blob groups share one upload.
METRIC_GROUPS: tuple[str, ...] = (
    "upload_mbps",
    "replication_1g_s",
    "download_mbps",
    "replication_latency_ms",
    "small_ops_per_s",
    "upload_w2_mbps",
    "upload_w2_apart_mbps",
    "small_ops_w2_per_s",
    "replication_latency_w2_ms",
    "upload_tls_mbps",
    "download_tls_mbps",
    "peer_plan_s",
    "spark",
    "spark_env_start",
    "failover_term_s",
    "failover_kill_s",
    "failover_kill_restart_s",
    "scale",
)
#: Groups run only when asked for by name (never by "all"): ``fanout`` needs root and builds
#: network namespaces, with a cluster of its own in them.
EXPLICIT_GROUPS: tuple[str, ...] = ("fanout",)
#: Groups that kill, restart or inspect master processes: only a cluster we started.
LOCAL_ONLY = frozenset({"failover_term_s", "failover_kill_s", "failover_kill_restart_s", "scale",
                        # Beside the run's cluster, another is started.
                        "upload_tls_mbps", "download_tls_mbps", "upload_w2_apart_mbps"})


def parse_metrics(text: str | None) -> tuple[str, ...]:
    """``"scale,upload_mbps"`` -> the groups in run order; None or "all" -> every group.

    Raises ValueError naming the valid groups for anything else.
    """
    if text is None or text.strip() in ("", "all"):
        return METRIC_GROUPS
    wanted = {t.strip() for t in text.split(",") if t.strip()}
    known = METRIC_GROUPS + EXPLICIT_GROUPS
    unknown = sorted(wanted - set(known))
    if unknown:
        raise ValueError(
            f"unknown metric {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return tuple(g for g in known if g in wanted)


@dataclass(frozen=True)
class BenchOptions:
    size_mb: int = 1024
    count: int = 100
    small_ops_seconds: float = 10.0
    scale_keys: int = 100_000
    #: Rounds of the big-blob metrics (medians are reported).
    repeat: int = 3
    #: Size of the blob every Spark executor gets in the ``spark`` group.
    spark_size_mb: int = 256
    #: Size of the packed Python environment in the ``spark_env_start`` group.
    spark_env_size_mb: int = 320
    metrics: tuple[str, ...] = METRIC_GROUPS
    #: A remote cluster's ZooKeeper ("host:port"), for the ZooKeeper baselines.
    zookeeper: str | None = None
    #: Where disk baselines write for a remote cluster (a local one uses its data directory).
    baseline_dir: str | None = None
    #: The local cluster serves TLS (token authentication); a remote one's TLS comes from
    #: the client's own options.
    tls: bool = False
    #: ZooKeeper session timeout of the local clusters the run starts (``--local``): how long
    #: ``failover_kill_s`` waits for a killed leader's session to end, and its baseline.
    session_timeout_ms: int = SESSION_TIMEOUT_MS
    #: JVM options for every Spark JVM the spark groups start (each application's driver and
    #: executors, the standalone cluster's daemons), blobha's side and the baseline's alike.
    spark_java_options: str = ""

    def check(self, local: bool, explicit_metrics: bool) -> None:
        """Raise ValueError for a combination that cannot run."""
        if min(self.size_mb, self.count, self.scale_keys, self.repeat, self.spark_size_mb,
               self.spark_env_size_mb) < 1:
            raise ValueError("--size-mb, --count, --scale-keys, --repeat, --spark-size-mb and"
                             " --spark-env-size-mb must be at least 1")
        if self.session_timeout_ms < MIN_SESSION_TIMEOUT_MS:
            raise ValueError(f"--session-timeout-ms must be at least {MIN_SESSION_TIMEOUT_MS}")
        if not self.small_ops_seconds > 0:
            raise ValueError("--small-ops-seconds must be positive")
        if self.tls and not local:
            raise ValueError("--tls starts a TLS cluster of its own: add --local (for a remote"
                             " cluster, give its CA with --ca)")
        if not local and explicit_metrics:
            needs_local = sorted(set(self.metrics) & LOCAL_ONLY, key=METRIC_GROUPS.index)
            if needs_local:
                raise ValueError(
                    f"{', '.join(needs_local)}: only with a cluster of our own; add --local"
                )
