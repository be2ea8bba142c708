"""``blobha bench``: how fast is this cluster, next to a baseline measured in the same run.

Like ``rados bench`` or MinIO's ``warp``, against any cluster (``--cluster``) or a throw-away
local one (``--local``). Every figure comes with a baseline measured on the same machine in the
same run, and the ratio ``value / baseline``, so a result reads "0.9x the disk" rather than a
bare number that means nothing on other hardware.

Metric groups (``--metrics`` picks a subset; every metric name starts with its group's name):

``upload_mbps``
    Durable upload of one ``--size-mb`` blob (default 1 GiB) with W=1, timed from the call to
    the acknowledgement. The big-blob groups run ``--repeat`` rounds (default 3), each next to
    its own baselines, and report medians: on a shared machine one slow round must not decide.
    Baseline: a dd-style sequential write of the same size with fdatasync, in 1 MiB buffers, on
    the masters' data file system (``--baseline-dir`` for a remote cluster).
``download_mbps``
    Download of that blob once it is in the page cache, digest verified, into nowhere. Baseline:
    a raw gRPC stream of as many bytes in the same chunk size (1 MiB) from a server process with
    no disk and no hashing (generic handlers, no protobuf).
``replication_latency_ms``
    p50 and p99 over ``--count`` creates of 1 MiB blobs, from the create being acknowledged to 3
    replicas, as a client sees it. Baseline: the median synchronous ZooKeeper create.
``replication_1g_s``
    From the big blob's acknowledgement to 3 replicas. Baseline: writing twice its size with
    fdatasync (the two followers write one copy each to the same disk).
``upload_w2_mbps``
    The ``--size-mb`` upload with a write quorum of 2 (the leader forwards the bytes to a second
    holder as they arrive), against the same upload with W=1, alternating which goes first.
    ``upload_w2_disk_mbps``: the disk's share, a dd-style write of that size with fdatasync
    alone (the baseline, as for ``upload_mbps``) and two at once (the value), as two masters
    sharing a disk write W=2's copies. Where W=1 runs at the disk's pace, W=2's ratio follows
    this one. With ``--local``, each upload is accounted for: ``upload_w2_cpu_s`` and
    ``upload_w2_leader_cpu_s``, the CPU seconds of all masters and of the leader alone;
    ``upload_w2_disk_written_mb``, what the masters' disk wrote while the upload ran (both
    copies land on it); ``upload_w2_disk_ceiling_mbps``, the disk's best pace in the group
    (any upload or dd-style write) over the bytes a W=2 upload puts on it: W=2 cannot beat it
    here, so its ratio to W=1 is W=2's ceiling on this machine. Each beside the W=1 figure.
``upload_w2_apart_mbps`` (``--local``)
    The same pair of uploads on a cluster of its own whose followers keep their data in
    memory and run on a CPU of their own, the leader and the client sharing the other, with
    memory warmed before each upload (:mod:`blobha.ops.bench.apart`): the forward's cost where
    each master has a disk and CPUs of its own. ``upload_w2_apart_disk_written_mb`` shows that
    only the leader's copy reaches the disk. Baseline: W=1 on that cluster.
``small_ops_w2_per_s`` / ``replication_latency_w2_ms``
    The 4 KiB creates (1 and 8 clients) and the time to 3 replicas of ``small_ops_per_s`` and
    ``replication_latency_ms`` with W=2, each against W=1 measured alongside.
``upload_tls_mbps`` / ``download_tls_mbps`` (``--local``)
    The big upload and download against a TLS cluster started beside the plaintext one,
    alternating. Baselines: the plaintext figures of the same rounds.
``spark`` (needs pyspark)
    The Spark comparison of :mod:`blobha.ops.bench.spark_cache`: from job start until every executor
    (two separate executor processes) holds a ``--spark-size-mb`` blob (default 256 MiB),
    blobha's node cache against ``sc.addFile``, for a first and a second application.
    Baseline: ``addFile``'s time in the same run.
``spark_env_start`` (needs pyspark)
    :mod:`blobha.ops.bench.spark_env`: on a standalone Spark cluster of two worker nodes
    started for the run, from submit until the first task has run on both executors, whose
    interpreter is a ``--spark-env-size-mb`` packed Python environment (default 320 MiB), for
    three consecutive applications: ``blobha spark-submit`` against plain ``spark-submit
    --archives`` in the same run.

    Both Spark groups give ``--spark-java-options`` (none by default) to every Spark JVM they
    start, on both sides: each application's driver and executors, the standalone cluster's
    daemons.
``failover_term_s`` / ``failover_kill_s`` (``--local``)
    From SIGTERM or SIGKILL of the leader to the first successful write through the client.
    Baseline: the configured ZooKeeper session timeout (``--session-timeout-ms``, 6 s by
    default, for every cluster the run starts), which a killed leader's session takes to end.
``failover_kill_restart_s`` (``--local``)
    From SIGKILL of the leader, restarted at once on its data directory (as systemd's
    ``Restart=`` or a container's restart policy would), to the first successful write. The
    restarted process ends its predecessor's session rather than waiting for it to expire.
    Baseline: the configured ZooKeeper session timeout.
``small_ops_per_s``
    4 KiB creates per second (acknowledged) with 1 and with 8 concurrent clients, and 4 KiB reads
    per second likewise, each client a thread with its own :class:`Client`. Baselines: raw
    synchronous ZooKeeper creates (for creates) and gets (for reads) per second, with as many
    kazoo clients, on the same ensemble. ``small_ops_per_s_create_c1_floor`` is the most one
    client's creates could reach on this design: each waits for a fenced ZooKeeper
    transaction, a durable install and a gRPC round trip, each measured alone (medians; needs
    ZooKeeper); baseline as for the creates.
``scale`` (``--local``)
    With ``--scale-keys`` keys in the cluster (created concurrently; the rate is reported with
    raw ZooKeeper creates as the baseline): full listing through the client (baseline: one raw
    ``get_children``), leader and follower RSS (baseline: the same process before the keys were
    added) and RSS per added key (baseline: ZooKeeper's own data bytes per znode), ZooKeeper
    watches (baseline: znodes) and znodes (baseline: keys), and the time a follower whose disk
    was wiped takes, from its restart, to hold every key and report no lag (baseline: as many
    synchronous ZooKeeper creates, the replica registrations it cannot avoid). Measured at rest:
    before the memory figures, every master must hold every key. ``scale_keys`` reports the
    count actually measured. Then, at that size: a follower's restart on its disk until its
    copies count again (``scale_restart_s``; baseline: the same restart before the keys were
    added), and the three failovers of the failover groups (``failover_term_at_scale_s``,
    ``failover_kill_restart_at_scale_s``, ``failover_kill_at_scale_s``; baseline: the session
    timeout, as theirs). The embedded ZooKeeper gets the heap the keys need
    (:func:`blobha.ops.zkserver.heap_mb_for`).
``fanout`` (root; only when named, and alone: ``--metrics fanout``)
    :mod:`blobha.ops.bench.fanout_net` in network namespaces of its own (ZooKeeper, 3 masters and 8
    nodes, 200 Mbit/s links shaped with tc): one node's cache fetches a ``--spark-size-mb``
    blob alone, then all 8 at once with peer serving on. Reported against the one-node time:
    the all-nodes, median and slowest node times; against the blob's size: the masters'
    egress, in all and each. Needs no ``--local`` or ``--cluster``.

A remote cluster (``--cluster``) gets the metrics that need no master process of our own; its
ZooKeeper baselines need ``--zookeeper HOST:PORT`` (otherwise they are reported as 0, ratio
null), and its disk baselines are taken on this machine, which is only the masters' disk if
they run here.

Output is a table, or with ``--json`` one object per metric with ``name``, ``value``, ``unit``,
``baseline_name``, ``baseline_value`` and ``ratio`` (null when there is no baseline). Progress
and notes go to stderr, so ``--json`` output stays machine-readable.

The parts: :mod:`~blobha.ops.bench.options` (groups, options, sizes),
:mod:`~blobha.ops.bench.report` (results and their formatting), :mod:`~blobha.ops.bench.driver`
(load generation), :mod:`~blobha.ops.bench.baselines` (what is measured on this machine),
:mod:`~blobha.ops.bench.context` (one run's shared state), one module per metric group
(``bigblob``, ``smallops``, ``spark``, ``failover``, ``scale``) and
:mod:`~blobha.ops.bench.runner` (the run and the entry point).
"""

from __future__ import annotations

from blobha.ops.bench.baselines import (
    disk_write_secs,
    node_status,
    parse_mntr,
    parse_vmrss_kib,
    parse_wchs,
    pattern,
    raw_grpc_download_secs,
    raw_grpc_server_main,
    rss_kib,
    unjournaled_ext4,
)
from blobha.ops.bench.driver import (
    Driver,
    DriveResult,
)
from blobha.ops.bench.options import (
    LOCAL_ONLY,
    METRIC_GROUPS,
    BenchOptions,
    parse_metrics,
)
from blobha.ops.bench.report import (
    Log,
    Metric,
    format_json,
    format_number,
    format_table,
    mb_per_s,
    percentile,
)
from blobha.ops.bench.runner import (
    main,
    run,
)

__all__ = [
    "LOCAL_ONLY",
    "METRIC_GROUPS",
    "BenchOptions",
    "DriveResult",
    "Driver",
    "Log",
    "Metric",
    "disk_write_secs",
    "format_json",
    "format_number",
    "format_table",
    "main",
    "mb_per_s",
    "node_status",
    "parse_metrics",
    "parse_mntr",
    "parse_vmrss_kib",
    "parse_wchs",
    "pattern",
    "percentile",
    "raw_grpc_download_secs",
    "raw_grpc_server_main",
    "rss_kib",
    "run",
    "unjournaled_ext4",
]
