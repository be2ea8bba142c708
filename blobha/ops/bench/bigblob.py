"""The big-blob groups (upload, replication_1g, download) and replication_latency_ms."""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, BinaryIO, cast

from blobha.client import Client
from blobha.ops.bench.baselines import (
    Discard,
    disk_write_secs,
    pattern,
    raw_grpc_download_secs,
    read_file_into_cache,
)
from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import zk_create_rate
from blobha.ops.bench.options import MiB
from blobha.ops.bench.report import mb_per_s, percentile

if TYPE_CHECKING:
    from blobha.ops.localcluster import LocalCluster


def big_blob(bench: Bench, groups: set[str]) -> None:
    """Upload, replication and download of the big blob, ``--repeat`` rounds, each round
    next to its baselines; medians are reported, so one burst of a noisy neighbour does
    not decide a figure."""
    size = bench.opts.size_mb * MiB
    rounds = bench.opts.repeat
    up: list[float] = []
    rep: list[float] = []
    down: list[float] = []
    dd1: list[float] = []
    dd2: list[float] = []
    raw: list[float] = []
    data = pattern(size)
    with bench.client() as c:
        c.cluster_summary()  # leader discovery outside the clock
        keys = [f"{bench.prefix}-big-{r}" for r in range(rounds)]
        for r, key in enumerate(keys):
            if "upload_mbps" in groups:
                dd1.append(disk_write_secs(bench.disk_dir, size))
            t0 = time.perf_counter()
            c.create(key, data, replication_factor=3, write_quorum=1)
            up.append(time.perf_counter() - t0)
            bench.created.append(key)
            t0 = time.perf_counter()
            reached = c.wait_for_replication([key], 3, timeout=max(600.0, size / 20e6))
            rep.append(time.perf_counter() - t0)
            if not reached.reached:
                raise RuntimeError(f"{key} did not reach 3 replicas in {rep[-1]:.0f} s")
            if "replication_1g_s" in groups:
                dd2.append(disk_write_secs(bench.disk_dir, 2 * size))
            if "download_mbps" in groups:
                down.append(download_secs(bench.lc, c, key, size))
                raw.append(raw_grpc_download_secs(size))
            bench.log.say(
                f"round {r + 1}/{rounds} of {size // MiB} MiB: upload {up[-1]:.2f} s"
                f" (dd {dd1[-1] if dd1 else 0:.2f} s), replication {rep[-1]:.2f} s"
                f" (dd 2x {dd2[-1] if dd2 else 0:.2f} s), download"
                f" {down[-1] if down else 0:.2f} s (raw gRPC {raw[-1] if raw else 0:.2f} s)"
            )
        # Gone before the later phases (a catching-up follower should copy keys, not
        # gigabytes), but only now: deleting gigabytes sets the disk trimming them for
        # seconds (ext4 mounted with discard), and the next round's upload then measured
        # that rather than the cluster.
        for key in keys:
            c.delete(key)
            bench.created.remove(key)
    del data
    med = statistics.median
    if "upload_mbps" in groups:
        bench.add("upload_mbps", mb_per_s(size, med(up)), "MB/s",
                  "disk_fdatasync_write_mbps", mb_per_s(size, med(dd1)))
    if "replication_1g_s" in groups:
        bench.add("replication_1g_s", med(rep), "s", "disk_fdatasync_write_2x_s", med(dd2))
    if "download_mbps" in groups:
        bench.add("download_mbps", mb_per_s(size, med(down)), "MB/s",
                  "raw_grpc_stream_mbps", mb_per_s(size, med(raw)))


def download_secs(lc: LocalCluster | None, c: Client, key: str, size: int) -> float:
    """One timed, digest-verified download of ``key`` from a warm page cache: every replica's
    file read once with a local cluster ``lc``, else one untimed download first."""
    if lc is not None:
        # "Already in the page cache": read every replica's file once, untimed.
        for path in lc.data_dir.glob("master-*/keys/*/v*.blob"):
            if path.stat().st_size == size:
                read_file_into_cache(path)
    else:
        c.download(key, cast(BinaryIO, Discard()))  # warms whichever replica it hits
    t0 = time.perf_counter()
    info = c.download(key, cast(BinaryIO, Discard()))  # digest-verified by the client
    secs = time.perf_counter() - t0
    if info.size != size:
        raise RuntimeError(f"download delivered {info.size} of {size} bytes")
    return secs


def replication_latency(bench: Bench) -> None:
    data = os.urandom(MiB)
    latencies = []
    bench.log.say(f"replication latency over {bench.opts.count} creates of 1 MiB")
    with bench.client() as c:
        keys = [f"{bench.prefix}-lat-{i}" for i in range(bench.opts.count)]
        for key in keys:
            c.create(key, data, replication_factor=3)
            bench.created.append(key)
            t0 = time.perf_counter()
            result = c.wait_for_replication([key], 3, timeout=60)
            latencies.append((time.perf_counter() - t0) * 1000)
            if not result.reached:
                raise RuntimeError(f"{key} did not reach 3 replicas within 60 s")
        for key in keys:
            c.delete(key)
            bench.created.remove(key)
    zk_ms = 0.0
    if bench.zk_connect is not None:
        zk = zk_create_rate(bench.zk_connect, 1, min(bench.opts.small_ops_seconds, 3.0))
        zk_ms = statistics.median(zk.latencies_ms)
    for q in (50, 99):
        bench.add(f"replication_latency_ms_p{q}", percentile(latencies, q), "ms",
                  "zk_sync_create_ms_p50", zk_ms)
