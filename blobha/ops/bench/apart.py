"""W=2 with the holder's copy apart from the leader's: what a W=2 upload costs where each
master has a disk and CPUs of its own, as a deployment runs them, measured on one machine.

On one machine the three masters share a disk, and a W=2 upload puts twice the bytes on it
(``upload_w2_disk_written_mb``); that, not the forward, is what ``upload_w2_mbps`` mostly
measures here. This group starts a cluster of its own whose followers keep their data in
memory (``/dev/shm``) and run on a CPU of their own, while the leader and the bench's client
share the other; so the leader's disk and CPU do for W=2 what they do for W=1, plus the
forward. Memory is touched and freed before each upload, so both quorums write into pages the
machine holds (a VM's balloon may have handed free pages back to its host, and a page taken
back costs a fault on the host when written again: W=2 would pay for two copies' worth).
The holder's copy in memory is synced for free, so this is the forward's cost with a holder
that keeps up: the figure a deployment with one disk per master can reach, not a floor.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

from blobha.core.affinity import pin_threads
from blobha.ops.bench.baselines import pattern
from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import bench_client
from blobha.ops.bench.options import MiB
from blobha.ops.bench.production import Upload, measured_upload
from blobha.ops.bench.report import mb_per_s
from blobha.ops.localcluster import LocalCluster, MasterProcess

#: Where the followers keep their data: memory, apart from the leader's disk.
MEMORY_DIR = Path("/dev/shm")
#: Memory touched before each upload, in uploads' sizes (two copies, and some to spare).
WARM_UPLOADS = 3


def upload_w2_apart(bench: Bench) -> None:
    """The ``--size-mb`` upload with W=2 and with W=1, alternating, on a cluster whose
    followers keep their data in memory on a CPU of their own."""
    assert bench.lc is not None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or file_system_type(MEMORY_DIR) != "tmpfs":
        bench.log.note("upload_w2_apart_mbps needs two CPUs and a tmpfs at /dev/shm: skipped")
        return
    size = bench.opts.size_mb * MiB
    data = pattern(size)
    uploads: dict[int, list[Upload]] = {1: [], 2: []}
    with _apart_cluster(bench) as (lc, leader), _pinned_self({cpus[0]}):
        pin_threads(leader.pid, {cpus[0]})
        for m in lc.masters:
            if m is not leader:
                pin_threads(m.pid, {cpus[1]})
        credentials = lc.credentials("admin") if lc.tls else None
        with bench_client(lc.cluster, credentials) as c:
            c.cluster_summary()
            for r in range(bench.opts.repeat):
                for quorum in (1, 2) if r % 2 == 0 else (2, 1):
                    key = f"{bench.prefix}-apart-w{quorum}-{r}"
                    warm_memory(min(WARM_UPLOADS * size, available_memory() // 2))
                    uploads[quorum].append(
                        measured_upload(c, key, data, quorum, lc.data_dir, pids=()))
                    # At once, unlike upload_w2_mbps: the followers' copies take memory.
                    # The disk's trim of the leader's copy falls on both quorums alike.
                    c.delete(key)
                bench.log.say(f"round {r + 1}/{bench.opts.repeat} of {size // MiB} MiB, the"
                              f" holder's copy apart: upload W=2 {uploads[2][-1].secs:.2f} s,"
                              f" W=1 {uploads[1][-1].secs:.2f} s")
    med = statistics.median
    bench.add("upload_w2_apart_mbps", mb_per_s(size, med(u.secs for u in uploads[2])), "MB/s",
              "upload_w1_apart_mbps", mb_per_s(size, med(u.secs for u in uploads[1])))
    written = {q: [u.written for u in uploads[q] if u.written is not None] for q in (1, 2)}
    if written[1] and written[2]:
        # One copy on the leader's disk for either quorum: the set-up does what it says.
        bench.add("upload_w2_apart_disk_written_mb", med(written[2]) / 1e6, "MB",
                  "upload_w1_apart_disk_written_mb", med(written[1]) / 1e6)


@contextlib.contextmanager
def _apart_cluster(bench: Bench) -> Iterator[tuple[LocalCluster, MasterProcess]]:
    """A cluster like the run's (TLS or not) whose followers keep their data in memory; and
    its leader."""
    assert bench.lc is not None
    with tempfile.TemporaryDirectory(prefix="blobha-bench-", dir=bench.lc.data_dir.parent) as tmp, \
            tempfile.TemporaryDirectory(prefix="blobha-bench-", dir=MEMORY_DIR) as memory:
        lc = LocalCluster(Path(tmp) / "apart", nodes=3, base_port=0, overrides={
            "zookeeper.session.timeout.ms": bench.opts.session_timeout_ms,
            "blobstore.disk.reserved.bytes": 0,
        }, tls=bench.lc.tls)
        bench.log.say("starting a local cluster whose followers keep their data in memory")
        try:
            lc.start()
            leader = lc.leader()
            for m in lc.masters:
                if m is not leader:
                    _move_data(lc, m, Path(memory))
            lc.wait_ready(60, expect=3)
            if lc.leader() is not leader:
                raise RuntimeError("the leader changed while its followers moved their data")
            yield lc, leader
        finally:
            lc.stop()


def _move_data(lc: LocalCluster, m: MasterProcess, to: Path) -> None:
    """Restart follower ``m`` with its (still empty) data directory in ``to``."""
    m.terminate()
    data = lc.store_dir(m)
    shutil.rmtree(data, ignore_errors=True)
    (to / data.name).mkdir()
    data.symlink_to(to / data.name)
    lc.start_master(m)


@contextlib.contextmanager
def _pinned_self(cpus: set[int]) -> Iterator[None]:
    """Every thread of this process on ``cpus`` (the client's, with the leader), then back."""
    before = os.sched_getaffinity(0)
    pin_threads(os.getpid(), cpus)
    try:
        yield
    finally:
        pin_threads(os.getpid(), before)


def warm_memory(size: int) -> None:
    """Write ``size`` bytes of anonymous memory and give it back, so the page cache's next
    pages are ones the machine holds (see the module's docstring)."""
    if size <= 0:
        return
    block = 64 * MiB
    chunk = b"\x01" * min(block, size)
    with mmap.mmap(-1, size) as m:
        for off in range(0, size, block):
            n = min(block, size - off)
            m[off:off + n] = chunk[:n]


def available_memory() -> int:
    """Bytes of memory free now (free pages, not counting the page cache)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def file_system_type(path: Path, mounts: Path = Path("/proc/self/mounts")) -> str | None:
    """The type of the file system ``path`` is on (the longest mount point holding it); None
    if the kernel's list cannot be read."""
    try:
        lines = mounts.read_text().splitlines()
        target = os.path.realpath(path)
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind
