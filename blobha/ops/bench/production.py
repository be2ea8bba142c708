"""The configuration production runs, each figure beside the easy one measured in the same run:
writes with a write quorum of 2 (big upload, small creates, time to three replicas) against
W=1, and transfers over TLS against plaintext."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from blobha.client import Client
from blobha.ops.bench.baselines import (
    DiskCounters,
    cpu_secs,
    disk_counters,
    disk_write_secs,
    disk_writes_at_once_secs,
    pattern,
)
from blobha.ops.bench.bigblob import download_secs
from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import bench_client
from blobha.ops.bench.options import CONCURRENT_CLIENTS, SMALL_BLOB, MiB
from blobha.ops.bench.report import mb_per_s, percentile
from blobha.ops.localcluster import LocalCluster
from blobha.wire.credentials import Credentials

#: Slices the small creates of each write quorum are run in, alternately.
_SLICES = 4
#: Creates timed per write quorum for the time to three replicas.
_LATENCY_ROUNDS_MAX = 100


@dataclass(frozen=True)
class Upload:
    """One timed upload, and what the machine did meanwhile."""

    secs: float
    #: CPU seconds of each process watched (see :func:`measured_upload`).
    cpu: list[float]
    #: Bytes the disk watched wrote, and its milliseconds busy; None without its counters.
    written: int | None
    busy_ms: int | None


def measured_upload(c: Client, key: str, data: bytes | bytearray, quorum: int,
                    disk: Path | None, pids: Sequence[int]) -> Upload:
    """Create ``key`` with three replicas and write quorum ``quorum``, timed, accounting for
    the disk holding ``disk`` and the CPU of processes ``pids``; then wait until every copy
    is made, so none competes with the next upload."""
    before, cpu0 = _counters(disk), [cpu_secs(p) for p in pids]
    t0 = time.perf_counter()
    c.create(key, data, replication_factor=3, write_quorum=quorum)
    took = time.perf_counter() - t0
    after, cpu1 = _counters(disk), [cpu_secs(p) for p in pids]
    if not c.wait_for_replication([key], 3, timeout=max(600.0, len(data) / 20e6)).reached:
        raise RuntimeError(f"{key} did not reach 3 replicas")
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    if before is None or after is None:
        return Upload(took, cpu, None, None)
    return Upload(took, cpu, after.written - before.written, after.busy_ms - before.busy_ms)


def _counters(path: Path | None) -> DiskCounters | None:
    return disk_counters(path) if path is not None else None


def upload_w2(bench: Bench) -> None:
    """A big upload with W=2 and with W=1, alternating which goes first in each round; and
    the disk's share: one copy written with fdatasync, and two at once, as W=2's two copies
    are written when the masters share a disk.

    With masters of its own (``--local``), each upload is also accounted for: what the disk
    holding them wrote while it ran, and the masters' CPU time. The disk's best pace in the run
    bounds what W=2 can reach here, since every copy it waits for lands on that disk."""
    size = bench.opts.size_mb * MiB
    data = pattern(size)
    uploads: dict[int, list[Upload]] = {1: [], 2: []}
    disk: dict[int, list[float]] = {1: [], 2: []}
    paces: list[float] = []  # bytes per second the disk wrote, in each timed write
    where = bench.lc.data_dir if bench.lc is not None else None
    pids: list[int] = []
    if bench.lc is not None:
        # The leader first: its share is what stays on its machine when each master has one.
        leader = bench.lc.leader().pid
        pids = [leader] + [m.pid for m in bench.lc.masters if m.pid != leader]
    keys: list[str] = []
    with bench.client() as c:
        c.cluster_summary()
        for r in range(bench.opts.repeat):
            for quorum in (1, 2) if r % 2 == 0 else (2, 1):
                key = f"{bench.prefix}-w{quorum}-{r}"
                keys.append(key)
                bench.created.append(key)
                u = measured_upload(c, key, data, quorum, where, pids)
                uploads[quorum].append(u)
                if u.written is not None and u.busy_ms is not None:
                    paces.append(u.written / u.secs)
                    bench.log.say(f"W={quorum}: {u.secs:.2f} s; the disk wrote"
                                  f" {u.written / MiB:.0f} MiB at {paces[-1] / 1e6:.0f} MB/s,"
                                  f" busy {u.busy_ms / 1000 / u.secs:.0%} of the time; the"
                                  f" masters used {sum(u.cpu):.2f} CPU-s, the leader"
                                  f" {u.cpu[0]:.2f}")
            bench.log.say(f"round {r + 1}/{bench.opts.repeat} of {size // MiB} MiB: upload"
                          f" W=2 {uploads[2][-1].secs:.2f} s, W=1 {uploads[1][-1].secs:.2f} s")
        # After the uploads, not between them: a deleted file sets the disk trimming it
        # (ext4 mounted with discard), and an upload right after would measure that.
        for r in range(bench.opts.repeat):
            disk[1].append(disk_write_secs(bench.disk_dir, size))
            disk[2].append(disk_writes_at_once_secs(bench.disk_dir, size, 2))
            paces += [size / disk[1][-1], 2 * size / disk[2][-1]]
            bench.log.say(f"round {r + 1}/{bench.opts.repeat} of {size // MiB} MiB: disk, one"
                          f" copy {disk[1][-1]:.2f} s, two at once {disk[2][-1]:.2f} s")
        _remove(bench, c, keys)
    med = statistics.median
    w1_mbps = mb_per_s(size, med(u.secs for u in uploads[1]))
    bench.add("upload_w2_mbps", mb_per_s(size, med(u.secs for u in uploads[2])), "MB/s",
              "upload_w1_mbps", w1_mbps)
    # What two writers at once get of the disk, against one: where W=1 runs at the disk's
    # pace, W=2's ratio follows this one.
    bench.add("upload_w2_disk_mbps", mb_per_s(size, med(disk[2])), "MB/s",
              "disk_fdatasync_write_mbps", mb_per_s(size, med(disk[1])))
    if pids:
        bench.add("upload_w2_cpu_s", med(sum(u.cpu) for u in uploads[2]), "s",
                  "upload_w1_cpu_s", med(sum(u.cpu) for u in uploads[1]))
        bench.add("upload_w2_leader_cpu_s", med(u.cpu[0] for u in uploads[2]), "s",
                  "upload_w1_leader_cpu_s", med(u.cpu[0] for u in uploads[1]))
    written = {q: [u.written for u in uploads[q] if u.written is not None] for q in (1, 2)}
    if written[1] and written[2]:
        bench.add("upload_w2_disk_written_mb", med(written[2]) / 1e6, "MB",
                  "upload_w1_disk_written_mb", med(written[1]) / 1e6)
        # A W=2 upload is over only when its bytes on this disk are: it cannot go faster
        # than the disk's best pace in this run over them. Its ratio is W=2's ceiling here.
        bench.add("upload_w2_disk_ceiling_mbps", max(paces) * size / med(written[2]) / 1e6,
                  "MB/s", "upload_w1_mbps", w1_mbps)


def small_ops_w2(bench: Bench) -> None:
    """4 KiB creates per second with W=2 and with W=1, for one client and for several: in
    :data:`_SLICES` slices each, alternating which quorum goes first, so a change in the
    machine's load while they run falls on both figures alike."""
    secs = bench.opts.small_ops_seconds
    data = os.urandom(SMALL_BLOB)
    for threads in (1, CONCURRENT_CLIENTS):
        ops = {1: 0, 2: 0}
        took = {1: 0.0, 2: 0.0}
        bench.log.say(f"4 KiB creates, W=2 and W=1, {threads} client(s), for {secs:g} s each"
                      f" in {_SLICES} slices")
        for r in range(_SLICES):
            for quorum in (2, 1) if r % 2 == 0 else (1, 2):
                tag = f"{bench.prefix}-sw{quorum}c{threads}s{r}"

                def create(c: Client, i: int, tag: str = tag, quorum: int = quorum) -> None:
                    c.create(f"{tag}-{i}", data, replication_factor=3, write_quorum=quorum)
                    if bench.lc is None:
                        bench.created.append(f"{tag}-{i}")

                res = bench.driver(create).run(threads, seconds=secs / _SLICES)
                bench.note_errors(f"small creates with W={quorum}", res)
                ops[quorum] += res.ops
                took[quorum] += res.secs
        rates = {q: ops[q] / took[q] if took[q] > 0 else 0.0 for q in (1, 2)}
        bench.add(f"small_ops_w2_per_s_create_c{threads}", rates[2], "op/s",
                  f"small_ops_w1_per_s_create_c{threads}", rates[1])


def replication_latency_w2(bench: Bench) -> None:
    """From the start of a 1 MiB create until three masters hold it, with W=2 and with W=1
    (alternating): what a job waiting for three replicas waits."""
    data = os.urandom(MiB)
    rounds = min(bench.opts.count, _LATENCY_ROUNDS_MAX)
    waited: dict[int, list[float]] = {1: [], 2: []}
    keys: list[str] = []
    bench.log.say(f"time to 3 replicas over {rounds} creates of 1 MiB each with W=2 and W=1")
    with bench.client() as c:
        c.cluster_summary()
        for i in range(rounds):
            for quorum in (2, 1) if i % 2 == 0 else (1, 2):
                key = f"{bench.prefix}-lw{quorum}-{i}"
                t0 = time.perf_counter()
                c.create(key, data, replication_factor=3, write_quorum=quorum)
                keys.append(key)
                bench.created.append(key)
                if not c.wait_for_replication([key], 3, timeout=60).reached:
                    raise RuntimeError(f"{key} did not reach 3 replicas within 60 s")
                waited[quorum].append((time.perf_counter() - t0) * 1000)
        _remove(bench, c, keys)
    for q in (50, 99):
        bench.add(f"replication_latency_w2_ms_p{q}", percentile(waited[2], q), "ms",
                  f"replication_latency_w1_ms_p{q}", percentile(waited[1], q))


def tls_transfers(bench: Bench, groups: set[str]) -> None:
    """A big upload and download over TLS and in plaintext, alternating, each against a local
    cluster of its own kind: the run's, and one started beside it."""
    assert bench.lc is not None
    size = bench.opts.size_mb * MiB
    data = pattern(size)
    up: dict[bool, list[float]] = {False: [], True: []}
    down: dict[bool, list[float]] = {False: [], True: []}
    with _other_cluster(bench) as other:
        clusters = {bench.lc.tls: (bench.lc, bench.credentials),
                    other.tls: (other, other.credentials("admin") if other.tls else None)}
        for r in range(bench.opts.repeat):
            for secure in (True, False) if r % 2 == 0 else (False, True):
                lc, creds = clusters[secure]
                with bench_client(lc.cluster, creds) as c:
                    c.cluster_summary()
                    key = f"{bench.prefix}-tls{int(secure)}-{r}"
                    t0 = time.perf_counter()
                    c.create(key, data, replication_factor=1, write_quorum=1)
                    up[secure].append(time.perf_counter() - t0)
                    if "download_tls_mbps" in groups:
                        down[secure].append(download_secs(lc, c, key, size))
                    c.delete(key)
            bench.log.say(f"round {r + 1}/{bench.opts.repeat} of {size // MiB} MiB: upload TLS"
                          f" {up[True][-1]:.2f} s, plaintext {up[False][-1]:.2f} s; download"
                          f" TLS {down[True][-1] if down[True] else 0:.2f} s, plaintext"
                          f" {down[False][-1] if down[False] else 0:.2f} s")
    med = statistics.median
    if "upload_tls_mbps" in groups:
        bench.add("upload_tls_mbps", mb_per_s(size, med(up[True])), "MB/s",
                  "upload_plaintext_mbps", mb_per_s(size, med(up[False])))
    if "download_tls_mbps" in groups:
        bench.add("download_tls_mbps", mb_per_s(size, med(down[True])), "MB/s",
                  "download_plaintext_mbps", mb_per_s(size, med(down[False])))


@contextlib.contextmanager
def _other_cluster(bench: Bench) -> Iterator[LocalCluster]:
    """A local cluster like the run's, with TLS if the run's has none and without if it has."""
    assert bench.lc is not None
    with tempfile.TemporaryDirectory(prefix="blobha-bench-") as tmp:
        lc = LocalCluster(Path(tmp) / "other", nodes=3, base_port=0, overrides={
            "zookeeper.session.timeout.ms": bench.opts.session_timeout_ms,
            "blobstore.disk.reserved.bytes": 0,
        }, spread_cpus=True, tls=not bench.lc.tls)
        kind = "TLS" if lc.tls else "plaintext"
        bench.log.say(f"starting a {kind} local cluster beside this run's, to compare with")
        try:
            lc.start()
            yield lc
        finally:
            lc.stop()


def _remove(bench: Bench, c: Client, keys: list[str]) -> None:
    for key in keys:
        c.delete(key)
        bench.created.remove(key)


def local_credentials(lc: LocalCluster) -> Credentials | None:
    """What the bench's clients present to a local cluster it started (an admin's token with
    TLS, nothing without)."""
    return lc.credentials("admin") if lc.tls else None
