"""One run's shared state: cluster, options, results, ZooKeeper baselines, keys to remove."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from blobha.client import Client
from blobha.ops.bench.driver import (
    Driver,
    DriveResult,
    bench_client,
    client_driver,
    zk_create_rate,
)
from blobha.ops.bench.options import CONCURRENT_CLIENTS, BenchOptions
from blobha.ops.bench.report import Log, Metric, format_number

if TYPE_CHECKING:
    from collections.abc import Callable

    from blobha.ops.localcluster import LocalCluster
    from blobha.wire.credentials import Credentials


class Bench:
    """One run against one cluster; ``lc`` is the local cluster when the run started its own."""

    def __init__(
        self, cluster: str, opts: BenchOptions, log: Log, lc: LocalCluster | None,
        zk_connect: str | None, disk_dir: Path, credentials: Credentials | None = None,
    ) -> None:
        self.cluster = cluster
        #: What the bench's clients present (a local TLS cluster's); None: ``BLOBHA_*``.
        self.credentials = credentials
        self.opts = opts
        self.log = log
        self.lc = lc
        self.zk_connect = zk_connect
        self.disk_dir = disk_dir
        self.metrics: list[Metric] = []
        self.prefix = f"bench-{os.getpid()}"
        self.created: list[str] = []  # keys to remove from a remote cluster afterwards
        self._zk_create_rates: dict[int, float] = {}

    def add(self, name: str, value: float, unit: str, baseline_name: str,
            baseline_value: float) -> None:
        m = Metric(name, value, unit, baseline_name, baseline_value)
        self.metrics.append(m)
        ratio = f"{m.ratio:.2f}x" if math.isfinite(m.ratio) else "-"
        self.log.say(f"{name} = {format_number(value)} {unit}  ({baseline_name}"
                     f" {format_number(baseline_value)}, ratio {ratio})")

    def client(self) -> Client:
        return bench_client(self.cluster, self.credentials)

    def driver(self, op: Callable[[Client, int], object]) -> Driver[Client]:
        """Clients of this run, each calling ``op(client, i)`` (see :class:`Driver`)."""
        return client_driver(self.cluster, op, self.credentials)

    def zk_create_rate(self, threads: int) -> float:
        """Raw ZooKeeper creates per second with ``threads`` clients, measured once per run
        (several groups share it); 0 without a ZooKeeper to measure."""
        if self.zk_connect is None:
            return 0.0
        if threads not in self._zk_create_rates:
            secs = min(self.opts.small_ops_seconds, 10.0)
            self._zk_create_rates[threads] = zk_create_rate(self.zk_connect, threads, secs).rate
        return self._zk_create_rates[threads]

    def note_errors(self, what: str, res: DriveResult) -> None:
        if res.errors:
            self.log.note(f"{what}: {len(res.errors)} client thread(s) failed and stopped early"
                          f" (first: {type(res.errors[0]).__name__}: {res.errors[0]})")

    def remove_created(self) -> None:
        """A remote cluster keeps nothing of ours."""
        if not self.created:
            return
        self.log.say(f"removing {len(self.created):,} benchmark keys")
        keys = list(self.created)
        Driver(self.client, Client.close, lambda c, i: c.delete(keys[i])).run(
            min(CONCURRENT_CLIENTS, len(keys)), total=len(keys))
