"""``blobha bench``: how fast is this cluster, next to a baseline measured in the same run.

Metrics so far:

* ``replication_latency_ms`` (p50, p99): over N creates of 1 MiB blobs, from the create being
  acknowledged to 3 replicas, as seen by a client (the server-side wait answers the moment the
  third replica registers, so one RPC round trip is included). Baseline: the median synchronous
  ZooKeeper create on the same ensemble, the floor for any ZooKeeper-coordinated step.
* ``failover_kill_s`` / ``failover_term_s`` (``--local`` only, since it kills a master): from
  SIGKILL or SIGTERM of the leader to the first successful write through the same client.
  Baseline: the configured ZooKeeper session timeout.

Output is a table, or with ``--json`` one object per metric with ``name``, ``value``, ``unit``,
``baseline_name``, ``baseline_value`` and ``ratio``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kazoo.client import KazooClient

from blobha.client import Client
from blobha.localcluster import LocalCluster

SESSION_TIMEOUT_MS = 6000


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float

    @property
    def ratio(self) -> float:
        return self.value / self.baseline_value if self.baseline_value else float("nan")

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ratio": round(self.ratio, 4)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def zk_create_ms(connect: str, n: int = 200) -> float:
    zk = KazooClient(hosts=connect)
    zk.start(timeout=15)
    try:
        base = f"/blobha-bench-{os.getpid()}-{time.monotonic_ns()}"
        zk.create(base)
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            zk.create(f"{base}/n{i}", b"x" * 64)
            times.append((time.perf_counter() - t0) * 1000)
        zk.delete(base, recursive=True)
        return statistics.median(times)
    finally:
        zk.stop()
        zk.close()


def replication_latency(client: Client, count: int, size: int, prefix: str) -> list[float]:
    data = os.urandom(size)
    latencies = []
    for i in range(count):
        key = f"{prefix}-{i}"
        client.create(key, data, replication_factor=3)
        t0 = time.perf_counter()
        result = client.wait_for_replication([key], 3, timeout=30)
        latencies.append((time.perf_counter() - t0) * 1000)
        if not result.reached:
            raise RuntimeError(f"{key} did not reach 3 replicas within 30s")
    for i in range(count):
        client.delete(f"{prefix}-{i}")
    return latencies


def failover(cluster: LocalCluster, client: Client, sig: int, key: str) -> float:
    leader = cluster.leader()
    client.create(key, b"before", replication_factor=3)
    t0 = time.perf_counter()
    leader.signal(sig)
    while True:
        try:
            client.update(key, b"after")
            elapsed = time.perf_counter() - t0
            break
        except Exception:
            # The client already retries with backoff; this only bounds the whole attempt.
            if time.perf_counter() - t0 > 120:
                raise
            time.sleep(0.01)
    leader.wait(30)
    cluster.start_master(leader)
    cluster.wait_ready(60, expect=len(cluster.masters))
    return elapsed


def run(cluster_addr: str | None, local: bool, count: int, size: int) -> list[Metric]:
    metrics: list[Metric] = []
    with tempfile.TemporaryDirectory(prefix="blobha-bench-") as tmp:
        lc: LocalCluster | None = None
        if local:
            lc = LocalCluster(Path(tmp), nodes=3, base_port=0, overrides={
                "zookeeper.session.timeout.ms": SESSION_TIMEOUT_MS,
                "blobstore.disk.reserved.bytes": 0,
            })
            lc.start()
            cluster_addr = lc.cluster
        assert cluster_addr is not None
        try:
            with Client(cluster_addr, user="blobha-bench", timeout=120) as client:
                prefix = f"bench-{os.getpid()}"
                lat = replication_latency(client, count, size, prefix)
                if lc is not None:
                    zk_ms = zk_create_ms(lc.zk.connect_string)
                    metrics += [
                        Metric("replication_latency_ms_p50", percentile(lat, 50), "ms",
                               "zk_sync_create_ms_p50", zk_ms),
                        Metric("replication_latency_ms_p99", percentile(lat, 99), "ms",
                               "zk_sync_create_ms_p50", zk_ms),
                    ]
                    session = SESSION_TIMEOUT_MS / 1000
                    for name, sig in (("failover_term_s", signal.SIGTERM),
                                      ("failover_kill_s", signal.SIGKILL)):
                        secs = failover(lc, client, sig, f"{prefix}-{name}")
                        metrics.append(Metric(name, secs, "s", "session_timeout_s", session))
                else:
                    metrics += [
                        Metric("replication_latency_ms_p50", percentile(lat, 50), "ms", "", 0),
                        Metric("replication_latency_ms_p99", percentile(lat, 99), "ms", "", 0),
                    ]
        finally:
            if lc is not None:
                lc.stop()
    return metrics


def main(cluster: str | None, local: bool, as_json: bool, count: int, size: int) -> int:
    if not local and not cluster:
        print("blobha: error: give --local or --cluster", file=sys.stderr)
        return 2
    metrics = run(cluster, local, count, size)
    if as_json:
        print(json.dumps([m.as_dict() for m in metrics], indent=2))
    else:
        print(f"{'metric':32} {'value':>10} {'unit':4}  {'baseline':28} {'value':>10} {'ratio':>8}")
        for m in metrics:
            print(f"{m.name:32} {m.value:10.3f} {m.unit:4}  {m.baseline_name:28}"
                  f" {m.baseline_value:10.3f} {m.ratio:8.2f}")
    return 0
