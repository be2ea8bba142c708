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
``spark`` (needs pyspark)
    The Spark comparison of :mod:`blobha.ops.bench_spark`: from job start until every executor
    (two separate executor processes) holds a ``--spark-size-mb`` blob (default 256 MiB),
    blobha's node cache against ``sc.addFile``, for a first and a second application.
    Baseline: ``addFile``'s time in the same run.
``failover_term_s`` / ``failover_kill_s`` (``--local``)
    From SIGTERM or SIGKILL of the leader to the first successful write through the client.
    Baseline: the configured ZooKeeper session timeout.
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
    count actually measured.

A remote cluster (``--cluster``) gets the metrics that need no master process of our own; its
ZooKeeper baselines need ``--zookeeper HOST:PORT`` (otherwise they are reported as 0, ratio
null), and its disk baselines are taken on this machine, which is only the masters' disk if
they run here.

Output is a table, or with ``--json`` one object per metric with ``name``, ``value``, ``unit``,
``baseline_name``, ``baseline_value`` and ``ratio`` (null when there is no baseline). Progress
and notes go to stderr, so ``--json`` output stays machine-readable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, TypeVar, cast

import grpc
from kazoo.client import KazooClient

from blobha.client import Client
from blobha.core.digest import CHUNK_SIZE, chunk_digest, digest_bytes
from blobha.ops.localcluster import LocalCluster, MasterProcess, cpus_allowed
from blobha.ops.zkserver import four_letter_word
from blobha.sync.peers import CHANNEL_OPTIONS, USER_METADATA_KEY
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.credentials import Credentials
from blobha.zk.layout import BLOBSTORE

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

MiB = 1024 * 1024
SESSION_TIMEOUT_MS = 6000
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
    "spark",
    "failover_term_s",
    "failover_kill_s",
    "failover_kill_restart_s",
    "scale",
)
#: Groups that kill, restart or inspect master processes: only a cluster we started.
LOCAL_ONLY = frozenset({"failover_term_s", "failover_kill_s", "failover_kill_restart_s", "scale"})


# --------------------------------------------------------------------------------------------
# Results and formatting (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float

    @property
    def ratio(self) -> float:
        if not self.baseline_value or not math.isfinite(self.baseline_value):
            return float("nan")
        return self.value / self.baseline_value

    def as_dict(self) -> dict[str, object]:
        ratio = self.ratio
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline_name": self.baseline_name,
            "baseline_value": self.baseline_value,
            # NaN is not JSON: no baseline means no ratio.
            "ratio": round(ratio, 4) if math.isfinite(ratio) else None,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def format_number(value: float) -> str:
    """A figure with as many decimals as its size deserves: 12,345 / 123.4 / 1.234."""
    if not math.isfinite(value):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def format_table(metrics: Sequence[Metric]) -> str:
    header = ("metric", "value", "unit", "baseline", "baseline value", "ratio")
    rows = [
        (m.name, format_number(m.value), m.unit, m.baseline_name or "-",
         format_number(m.baseline_value) if m.baseline_name else "-",
         f"{m.ratio:.2f}x" if math.isfinite(m.ratio) else "-")
        for m in metrics
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {1, 4, 5}  # numbers line up on the right

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_json(metrics: Sequence[Metric]) -> str:
    return json.dumps([m.as_dict() for m in metrics], indent=2)


def parse_metrics(text: str | None) -> tuple[str, ...]:
    """``"scale,upload_mbps"`` -> the groups in run order; None or "all" -> every group.

    Raises ValueError naming the valid groups for anything else.
    """
    if text is None or text.strip() in ("", "all"):
        return METRIC_GROUPS
    wanted = {t.strip() for t in text.split(",") if t.strip()}
    unknown = sorted(wanted - set(METRIC_GROUPS))
    if unknown:
        raise ValueError(
            f"unknown metric {', '.join(unknown)}; choose from {', '.join(METRIC_GROUPS)}"
        )
    return tuple(g for g in METRIC_GROUPS if g in wanted)


def parse_wchs(text: str) -> int:
    """Total watches from ZooKeeper's ``wchs`` answer ("...\\nTotal watches:42")."""
    match = re.search(r"Total watches:\s*(\d+)", text)
    if match is None:
        raise ValueError(f"unexpected wchs answer: {text[:200]!r}")
    return int(match.group(1))


def parse_mntr(text: str) -> dict[str, str]:
    """``mntr``'s tab-separated ``name value`` lines as a dict."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        name, sep, value = raw.partition("\t")
        if sep:
            out[name.strip()] = value.strip()
    return out


def parse_vmrss_kib(status_text: str) -> int:
    """VmRSS in KiB from the text of ``/proc/<pid>/status``."""
    match = re.search(r"^VmRSS:\s*(\d+)\s*kB", status_text, re.MULTILINE)
    if match is None:
        raise ValueError("no VmRSS line (a kernel thread, or the process is gone)")
    return int(match.group(1))


def mb_per_s(nbytes: int, secs: float) -> float:
    """Throughput in MB/s (10^6 bytes, as dd reports it)."""
    return nbytes / 1e6 / secs if secs > 0 else float("inf")


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


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
    metrics: tuple[str, ...] = METRIC_GROUPS
    #: A remote cluster's ZooKeeper ("host:port"), for the ZooKeeper baselines.
    zookeeper: str | None = None
    #: Where disk baselines write for a remote cluster (a local one uses its data directory).
    baseline_dir: str | None = None

    def check(self, local: bool, explicit_metrics: bool) -> None:
        """Raise ValueError for a combination that cannot run."""
        if min(self.size_mb, self.count, self.scale_keys, self.repeat, self.spark_size_mb) < 1:
            raise ValueError("--size-mb, --count, --scale-keys, --repeat and --spark-size-mb must"
                             " be at least 1")
        if not self.small_ops_seconds > 0:
            raise ValueError("--small-ops-seconds must be positive")
        if not local and explicit_metrics:
            needs_local = sorted(set(self.metrics) & LOCAL_ONLY, key=METRIC_GROUPS.index)
            if needs_local:
                raise ValueError(
                    f"{', '.join(needs_local)}: only with a cluster of our own; add --local"
                )


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


class Log:
    """Progress lines on stderr, stamped with the time since the run began."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._t0 = time.monotonic()
        self.notes: list[str] = []

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self._t0:7.1f}s] {message}", file=self._stream, flush=True)

    def note(self, message: str) -> None:
        """Something a reader of the results must know; repeated under the table."""
        self.notes.append(message)
        self.say(f"note: {message}")


# --------------------------------------------------------------------------------------------
# Load generation
# --------------------------------------------------------------------------------------------

C = TypeVar("C")


@dataclass
class DriveResult:
    ops: int
    secs: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.secs if self.secs > 0 else 0.0


class Driver(Generic[C]):
    """Runs ``op(conn, i)`` from ``threads`` threads, each with its own connection, for a time
    or a total count; ``i`` is a run-wide sequence number (unique keys without coordination).

    Connections are opened and warmed (``warm``) before the clock starts, so the rate measures
    steady-state operations, not connection set-up or leader discovery.
    """

    def __init__(
        self,
        open_conn: Callable[[], C],
        close_conn: Callable[[C], None],
        op: Callable[[C, int], object],
        warm: Callable[[C], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.open_conn = open_conn
        self.close_conn = close_conn
        self.op = op
        self.warm = warm
        self.clock = clock

    def run(
        self, threads: int, seconds: float | None = None, total: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> DriveResult:
        """``progress(ops done)`` is called about every second from the calling thread."""
        if seconds is None and total is None:
            raise ValueError("give seconds or total")
        lock = threading.Lock()
        issued = [0]  # sequence numbers handed out
        completed = [0]
        stop = threading.Event()
        result = DriveResult(0, 0.0)
        started = [0.0]
        deadline = [math.inf]

        def start_clock() -> None:
            # Run by the barrier before it lets any thread go: no operation starts before the
            # clock does (the workers' first ones used to, while the caller had yet to read it).
            started[0] = self.clock()
            if seconds is not None:
                deadline[0] = started[0] + seconds

        barrier = threading.Barrier(threads + 1, action=start_clock)

        def worker() -> None:
            conn: C | None = None
            latencies: list[float] = []
            try:
                conn = self.open_conn()
                if self.warm is not None:
                    self.warm(conn)
                barrier.wait()
                while not stop.is_set() and self.clock() < deadline[0]:
                    with lock:
                        i = issued[0]
                        issued[0] += 1
                    if total is not None and i >= total:
                        break
                    t0 = time.perf_counter()
                    self.op(conn, i)
                    latencies.append((time.perf_counter() - t0) * 1000)
                    with lock:
                        completed[0] += 1
            except threading.BrokenBarrierError:
                pass
            except BaseException as e:
                with lock:
                    result.errors.append(e)
                stop.set()
                barrier.abort()
            finally:
                with lock:
                    result.latencies_ms.extend(latencies)
                if conn is not None:
                    with contextlib.suppress(Exception):
                        self.close_conn(conn)

        pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for t in pool:
            t.start()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            for t in pool:
                t.join()
            raise result.errors[0] from None
        for t in pool:
            while t.is_alive():
                t.join(timeout=1.0 if progress is not None else None)
                if progress is not None:
                    progress(completed[0])
        result.secs = self.clock() - started[0]
        result.ops = completed[0]
        if result.errors and result.ops == 0:
            raise result.errors[0]
        return result


def _bench_user() -> str | None:
    """The user the bench acts as: on a secure cluster whoever the credentials (token or client
    certificate, from the command line or ``BLOBHA_*``) say; otherwise a user of its own."""
    creds = Credentials.from_env()
    return None if creds.token_file or creds.cert else USER


def _bench_client(cluster: str) -> Client:
    return Client(cluster, user=_bench_user(), timeout=120)


def client_driver(cluster: str, op: Callable[[Client, int], object]) -> Driver[Client]:
    # Leader discovery and channel set-up happen in warm-up, outside the clock.
    return Driver(lambda: _bench_client(cluster), Client.close, op,
                  warm=lambda c: c.cluster_summary())


def _zk_open(connect: str) -> KazooClient:
    zk = KazooClient(hosts=connect)
    zk.start(timeout=15)
    return zk


def _zk_close(zk: KazooClient) -> None:
    zk.stop()
    zk.close()


def zk_delete_tree(zk: KazooClient, base: str) -> None:
    """Delete ``base`` and its children, pipelined: kazoo's recursive delete does one
    synchronous round trip per child, far too slow for the tens of thousands a baseline makes."""
    with contextlib.suppress(Exception):
        names = zk.get_children(base)
        for start in range(0, len(names), 2000):
            asyncs = [zk.delete_async(f"{base}/{n}") for n in names[start:start + 2000]]
            for a in asyncs:
                with contextlib.suppress(Exception):
                    a.get(timeout=30)
        zk.delete(base)


def zk_create_rate(connect: str, threads: int, seconds: float) -> DriveResult:
    """Raw synchronous ZooKeeper creates per second with ``threads`` kazoo clients."""
    admin = _zk_open(connect)
    base = f"/blobha-bench-{os.getpid()}-{time.monotonic_ns()}"
    admin.create(base)
    payload = b"x" * ZK_NODE_BYTES
    try:
        return Driver(lambda: _zk_open(connect), _zk_close,
                      lambda zk, i: zk.create(f"{base}/n{i}", payload)).run(threads, seconds)
    finally:
        zk_delete_tree(admin, base)
        _zk_close(admin)


def zk_get_rate(connect: str, threads: int, seconds: float, nodes: int = 1000) -> DriveResult:
    """Raw synchronous ZooKeeper gets per second with ``threads`` kazoo clients."""
    admin = _zk_open(connect)
    base = f"/blobha-bench-{os.getpid()}-{time.monotonic_ns()}"
    admin.create(base)
    payload = b"x" * ZK_NODE_BYTES
    try:
        for a in [admin.create_async(f"{base}/n{i}", payload) for i in range(nodes)]:
            a.get(timeout=30)
        return Driver(lambda: _zk_open(connect), _zk_close,
                      lambda zk, i: zk.get(f"{base}/n{i % nodes}")).run(threads, seconds)
    finally:
        zk_delete_tree(admin, base)
        _zk_close(admin)


def _timed_ms(op: Callable[[int], object], rounds: int, seconds: float) -> float:
    """Median milliseconds of ``op(i)`` over at most ``rounds`` calls and about ``seconds``,
    one after the other; the first failure is raised."""
    res = Driver(lambda: None, lambda _: None, lambda _, i: op(i)).run(
        1, seconds=seconds, total=rounds)
    if res.errors:
        raise res.errors[0]
    return statistics.median(res.latencies_ms)


def fenced_commit_ms(connect: str, rounds: int, seconds: float) -> float:
    """Median ms of a ZooKeeper transaction shaped as the one that commits a small create: the
    leader's two fences (its candidacy and the epoch), the key's metadata, its replica node
    (ephemeral) and the change journal's record."""
    zk = _zk_open(connect)
    base = f"/blobha-bench-{os.getpid()}-{time.monotonic_ns()}"
    try:
        zk.create(base)
        zk.create(f"{base}/epoch", b"1")
        zk.create(f"{base}/journal", b"")
        meta, record = b"m" * 260, b"j" * 60

        def commit(i: int) -> None:
            txn = zk.transaction()
            txn.check(f"{base}/epoch", 0)
            txn.check(f"{base}/epoch", 0)
            txn.create(f"{base}/k{i}", meta)
            txn.create(f"{base}/k{i}-r", b"", ephemeral=True)
            txn.set_data(f"{base}/journal", record)
            results = txn.commit()
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]

        return _timed_ms(commit, rounds, seconds)
    finally:
        zk_delete_tree(zk, base)
        _zk_close(zk)


def small_install_ms(directory: Path, rounds: int, seconds: float) -> float:
    """Median ms of the leader's durable install of one 4 KiB blob, taken as the store takes
    it, in a segment file under ``directory``: the blob's digests checked over the very bytes
    to be written, the blob and its record appended in one write, an fdatasync. Plain file
    calls rather than the store itself: the tools never import the store, and these steps are
    the whole of what an install must wait for (indexing it is memory only)."""
    root = Path(tempfile.mkdtemp(prefix="blobha-bench-install-", dir=directory))
    try:
        # Made once, its name made durable, as the store does for each new segment.
        fd = os.open(root / "segment", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _fsync_dir(root)
            data = os.urandom(SMALL_BLOB)
            digest = digest_bytes(data)
            # As long as a segment record's header (magic, lengths, check); what it holds
            # costs nothing to time.
            header = bytes(29)
            end = [0]

            def install(i: int) -> None:
                if digest_bytes(data) != digest:
                    raise RuntimeError("the blob changed under the bench")
                record = json.dumps({
                    "key": f"k{i}", "seq": 1, "size": len(data), "digest": digest,
                    "chunk_size": CHUNK_SIZE, "chunks": [chunk_digest(data)],
                    "installed_at": time.time(),
                }, separators=(",", ":")).encode("utf-8")
                pieces = [header, record, data]
                written = os.pwritev(fd, pieces, end[0])
                if written != sum(len(p) for p in pieces):
                    raise OSError(f"short write: {written} bytes")
                end[0] += written
                os.fdatasync(fd)

            return _timed_ms(install, rounds, seconds)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Machine baselines
# --------------------------------------------------------------------------------------------


def pattern(size: int) -> bytearray:
    """``size`` bytes of incompressible data, made from a repeated random block (cheap to build
    at 1 GiB; nothing on the path compresses or deduplicates)."""
    block = os.urandom(min(size, 64 * MiB))
    buf = bytearray(size)
    view = memoryview(buf)
    for off in range(0, size, len(block)):
        n = min(len(block), size - off)
        view[off:off + n] = block[:n]
    return buf


def disk_write_secs(directory: Path, size: int, block: int = MiB) -> float:
    """dd bs=1M conv=fdatasync, in Python: write ``size`` bytes in ``block`` buffers, fdatasync,
    and return the seconds it took. The file is deleted afterwards."""
    buf = os.urandom(block)
    path = directory / f".blobha-bench-dd-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        left = size
        while left > 0:
            left -= os.write(fd, buf if left >= block else buf[:left])
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


_RAW_SERVICE = "blobha.ops.bench.Raw"
_RAW_METHOD = f"/{_RAW_SERVICE}/Stream"


def raw_grpc_server_main(chunk: int = CHUNK_SIZE) -> None:
    """A gRPC server streaming N bytes (the request, in ASCII) in ``chunk`` pieces: no disk, no
    hashing, no protobuf. Run in a child process so it does not share our GIL, as a master
    would not. Prints its port, exits when its stdin closes."""
    from concurrent.futures import ThreadPoolExecutor

    block = os.urandom(chunk)

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        left = int(request.decode("ascii"))
        while left > 0:
            n = min(chunk, left)
            # A fresh copy per message, as a master's file read makes one.
            yield block[:n] if n < chunk else bytes(block)
            left -= n

    handler = grpc.method_handlers_generic_handler(
        _RAW_SERVICE, {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)


def raw_grpc_download_secs(size: int) -> float:
    """Seconds to receive ``size`` bytes over a raw gRPC stream from a child process."""
    with tempfile.TemporaryDirectory(prefix="blobha-bench-raw-") as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from blobha.ops.bench import raw_grpc_server_main as m; m()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            # Not the current directory: '-c' puts it on sys.path, and a source checkout there
            # would shadow the installed package.
            cwd=cwd,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            port = int(proc.stdout.readline())
            options = [(k, v) for k, v in CHANNEL_OPTIONS if "keepalive" not in k]
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                call = channel.unary_stream(_RAW_METHOD, None, None)  # raw bytes both ways
                grpc.channel_ready_future(channel).result(timeout=30)
                t0 = time.perf_counter()
                got = 0
                for message in call(str(size).encode("ascii"), timeout=600):
                    got += len(message)
                secs = time.perf_counter() - t0
            if got != size:
                raise RuntimeError(f"raw gRPC stream delivered {got} of {size} bytes")
            return secs
        finally:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _Discard(io.RawIOBase):
    """A write-only sink: downloads are timed without a destination disk in the way."""

    def writable(self) -> bool:
        return True

    def write(self, b: ReadableBuffer, /) -> int:
        return memoryview(b).nbytes


def read_file_into_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass


def rss_kib(pid: int) -> int:
    return parse_vmrss_kib(Path(f"/proc/{pid}/status").read_text())


def unjournaled_ext4(path: Path, proc: Path = Path("/proc"), sys_dir: Path = Path("/sys")
                     ) -> str | None:
    """The block device (its kernel name) of the file system holding ``path`` when that is
    ext4 without a journal; None for any other file system, or when it cannot be told.

    There, ext4 passes over every inode freed in the last minutes (``recently_deleted()``,
    checked only without a journal) each time it allocates one, so a small create costs more
    for minutes after a large deletion: another run's clean-up, say."""
    try:
        dev = os.stat(path).st_dev
        name = (sys_dir / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").resolve().name
    except OSError:
        return None
    if not (proc / "fs" / "ext4" / name).is_dir():
        return None  # not ext4, or a device with no block entry (overlay, tmpfs)
    try:
        journals = os.listdir(proc / "fs" / "jbd2")  # "<device>-<journal inode>"
    except OSError:
        journals = []  # jbd2 not loaded: no file system has a journal
    if any(j.rpartition("-")[0] == name for j in journals):
        return None
    return name


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


class Bench:
    def __init__(
        self, cluster: str, opts: BenchOptions, log: Log, lc: LocalCluster | None,
        zk_connect: str | None, disk_dir: Path,
    ) -> None:
        self.cluster = cluster
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
        return _bench_client(self.cluster)

    def run(self) -> list[Metric]:
        groups = set(self.opts.metrics)
        if groups & {"upload_mbps", "replication_1g_s", "download_mbps"}:
            self.big_blob(groups)
        if "replication_latency_ms" in groups:
            self.replication_latency()
        if "small_ops_per_s" in groups:
            self.small_ops()
        if "spark" in groups:
            self.spark()
        for name, sig, restart in (("failover_term_s", signal.SIGTERM, False),
                                   ("failover_kill_s", signal.SIGKILL, False),
                                   ("failover_kill_restart_s", signal.SIGKILL, True)):
            if name in groups and self.lc is not None:
                self.failover(name, sig, restart)
        if "scale" in groups and self.lc is not None:
            self.scale()
        return self.metrics

    # ---- ZooKeeper baselines (measured once, shared) -------------------------------------

    def zk_create_rate(self, threads: int) -> float:
        if self.zk_connect is None:
            return 0.0
        if threads not in self._zk_create_rates:
            secs = min(self.opts.small_ops_seconds, 10.0)
            self._zk_create_rates[threads] = zk_create_rate(self.zk_connect, threads, secs).rate
        return self._zk_create_rates[threads]

    # ---- upload, replication of the big blob, download ------------------------------------

    def big_blob(self, groups: set[str]) -> None:
        """Upload, replication and download of the big blob, ``--repeat`` rounds, each round
        next to its baselines; medians are reported, so one burst of a noisy neighbour does
        not decide a figure."""
        size = self.opts.size_mb * MiB
        rounds = self.opts.repeat
        up: list[float] = []
        rep: list[float] = []
        down: list[float] = []
        dd1: list[float] = []
        dd2: list[float] = []
        raw: list[float] = []
        data = pattern(size)
        with self.client() as c:
            c.cluster_summary()  # leader discovery outside the clock
            keys = [f"{self.prefix}-big-{r}" for r in range(rounds)]
            for r, key in enumerate(keys):
                if "upload_mbps" in groups:
                    dd1.append(disk_write_secs(self.disk_dir, size))
                t0 = time.perf_counter()
                c.create(key, data, replication_factor=3, write_quorum=1)
                up.append(time.perf_counter() - t0)
                self.created.append(key)
                t0 = time.perf_counter()
                reached = c.wait_for_replication([key], 3, timeout=max(600.0, size / 20e6))
                rep.append(time.perf_counter() - t0)
                if not reached.reached:
                    raise RuntimeError(f"{key} did not reach 3 replicas in {rep[-1]:.0f} s")
                if "replication_1g_s" in groups:
                    dd2.append(disk_write_secs(self.disk_dir, 2 * size))
                if "download_mbps" in groups:
                    down.append(self.download_secs(c, key, size))
                    raw.append(raw_grpc_download_secs(size))
                self.log.say(
                    f"round {r + 1}/{rounds} of {size // MiB} MiB: upload {up[-1]:.2f} s"
                    f" (dd {dd1[-1] if dd1 else 0:.2f} s), replication {rep[-1]:.2f} s"
                    f" (dd 2x {dd2[-1] if dd2 else 0:.2f} s), download"
                    f" {down[-1] if down else 0:.2f} s (raw gRPC {raw[-1] if raw else 0:.2f} s)"
                )
            # Gone before the later phases (a catching-up follower should copy keys, not
            # gigabytes), but only now: deleting gigabytes sets the disk trimming them for
            # seconds (ext4 mounted with discard), and the next round's upload then measured
            # that (6.9 s against 3.7 s for the first round, and 3.8 s with no delete).
            for key in keys:
                c.delete(key)
                self.created.remove(key)
        del data
        med = statistics.median
        if "upload_mbps" in groups:
            self.add("upload_mbps", mb_per_s(size, med(up)), "MB/s",
                     "disk_fdatasync_write_mbps", mb_per_s(size, med(dd1)))
        if "replication_1g_s" in groups:
            self.add("replication_1g_s", med(rep), "s", "disk_fdatasync_write_2x_s", med(dd2))
        if "download_mbps" in groups:
            self.add("download_mbps", mb_per_s(size, med(down)), "MB/s",
                     "raw_grpc_stream_mbps", mb_per_s(size, med(raw)))

    def download_secs(self, c: Client, key: str, size: int) -> float:
        if self.lc is not None:
            # "Already in the page cache": read every replica's file once, untimed.
            for path in self.lc.data_dir.glob("master-*/keys/*/v*.blob"):
                if path.stat().st_size == size:
                    read_file_into_cache(path)
        else:
            c.download(key, cast(BinaryIO, _Discard()))  # warms whichever replica it hits
        t0 = time.perf_counter()
        info = c.download(key, cast(BinaryIO, _Discard()))  # digest-verified by the client
        secs = time.perf_counter() - t0
        if info.size != size:
            raise RuntimeError(f"download delivered {info.size} of {size} bytes")
        return secs

    # ---- replication latency --------------------------------------------------------------

    def replication_latency(self) -> None:
        data = os.urandom(MiB)
        latencies = []
        self.log.say(f"replication latency over {self.opts.count} creates of 1 MiB")
        with self.client() as c:
            keys = [f"{self.prefix}-lat-{i}" for i in range(self.opts.count)]
            for key in keys:
                c.create(key, data, replication_factor=3)
                self.created.append(key)
                t0 = time.perf_counter()
                result = c.wait_for_replication([key], 3, timeout=60)
                latencies.append((time.perf_counter() - t0) * 1000)
                if not result.reached:
                    raise RuntimeError(f"{key} did not reach 3 replicas within 60 s")
            for key in keys:
                c.delete(key)
                self.created.remove(key)
        zk_ms = 0.0
        if self.zk_connect is not None:
            zk = zk_create_rate(self.zk_connect, 1, min(self.opts.small_ops_seconds, 3.0))
            zk_ms = statistics.median(zk.latencies_ms)
        for q in (50, 99):
            self.add(f"replication_latency_ms_p{q}", percentile(latencies, q), "ms",
                     "zk_sync_create_ms_p50", zk_ms)

    # ---- small operations -----------------------------------------------------------------

    def small_ops(self) -> None:
        secs = self.opts.small_ops_seconds
        data = os.urandom(SMALL_BLOB)
        created: list[str] = []
        created_lock = threading.Lock()
        for threads in (1, CONCURRENT_CLIENTS):
            tag = f"{self.prefix}-s{threads}"

            def create(c: Client, i: int, tag: str = tag) -> None:
                key = f"{tag}-{i}"
                c.create(key, data)
                with created_lock:
                    created.append(key)

            self.log.say(f"4 KiB creates with {threads} client(s) for {secs:g} s")
            res = client_driver(self.cluster, create).run(threads, seconds=secs)
            self._errors("small creates", res)
            self.add(f"small_ops_per_s_create_c{threads}", res.rate, "op/s",
                     f"zk_sync_create_per_s_c{threads}", self.zk_create_rate(threads))
            if threads == 1:
                self.create_floor(min(secs, 3.0))
        if self.lc is None:
            self.created.extend(created)
        keys = list(created)
        for threads in (1, CONCURRENT_CLIENTS):

            def read(c: Client, i: int) -> None:
                c.read(keys[i % len(keys)])

            self.log.say(f"4 KiB reads with {threads} client(s) for {secs:g} s")
            res = client_driver(self.cluster, read).run(threads, seconds=secs)
            self._errors("small reads", res)
            zk_gets = 0.0
            if self.zk_connect is not None:
                zk_gets = zk_get_rate(self.zk_connect, threads, min(secs, 10.0)).rate
            self.add(f"small_ops_per_s_read_c{threads}", res.rate, "op/s",
                     f"zk_sync_get_per_s_c{threads}", zk_gets)

    def create_floor(self, seconds: float) -> None:
        """What one client's creates could reach at most on this design: one create waits for
        a fenced ZooKeeper transaction, a durable install and a gRPC round trip, one after
        the other, whatever else it costs. Each part is measured alone, here and now."""
        if self.zk_connect is None:
            self.log.note("small_ops_per_s_create_c1_floor skipped: it needs --zookeeper")
            return
        commit = fenced_commit_ms(self.zk_connect, FLOOR_ROUNDS, seconds)
        install = small_install_ms(self.disk_dir, FLOOR_ROUNDS, seconds)
        with self.client() as c:
            summary = c.cluster_summary()
            target = summary.leader or summary.masters[0].address
            rpc = _timed_ms(lambda i: c.node_status(target), FLOOR_ROUNDS, seconds)
        floor = commit + install + rpc
        self.log.say(f"one create's floor: fenced ZooKeeper transaction {commit:.2f} ms, durable"
                     f" install {install:.2f} ms, gRPC round trip {rpc:.2f} ms")
        self.add("small_ops_per_s_create_c1_floor", 1000 / floor, "op/s",
                 "zk_sync_create_per_s_c1", self.zk_create_rate(1))

    def _errors(self, what: str, res: DriveResult) -> None:
        if res.errors:
            self.log.note(f"{what}: {len(res.errors)} client thread(s) failed and stopped early"
                          f" (first: {type(res.errors[0]).__name__}: {res.errors[0]})")

    # ---- Spark -----------------------------------------------------------------------

    def spark(self) -> None:
        """The Spark comparison (blobha.ops.bench_spark): time until every executor holds a
        ``--spark-size-mb`` blob, blobha against ``sc.addFile``, first and second application."""
        if importlib.util.find_spec("pyspark") is None:
            self.log.note("spark skipped: pyspark is not installed (deploy/setup.sh spark)")
            return
        from blobha.ops.bench_spark import run_spark_bench

        size = self.opts.spark_size_mb * MiB
        self.log.say(f"Spark: every executor gets a {self.opts.spark_size_mb} MiB blob, blobha"
                     " against sc.addFile, first and second application")
        for m in run_spark_bench(self.cluster, size, executors=SPARK_EXECUTORS,
                                 user=_bench_user()):
            self.add(str(m["name"]), float(cast(float, m["value"])), str(m["unit"]),
                     str(m["baseline_name"]), float(cast(float, m["baseline_value"])))

    # ---- failover ---------------------------------------------------------------------

    def failover(self, name: str, sig: int, restart: bool = False) -> None:
        """The leader gets ``sig``; with ``restart``, it is started again on its data
        directory as soon as it is gone, on the clock."""
        lc = self.lc
        assert lc is not None
        lc.wait_ready(60, expect=len(lc.masters))
        key = f"{self.prefix}-{name}"
        with self.client() as c:
            c.create(key, b"before", replication_factor=3)
            c.update(key, b"warm")  # the client now knows the leader: no discovery on the clock
            leader = lc.leader()
            self.log.say(f"{signal.Signals(sig).name} to the leader {leader.address}"
                         + (", restarted at once" if restart else ""))
            t0 = time.perf_counter()
            leader.signal(sig)
            if restart:
                if not leader.wait(30):
                    raise RuntimeError(f"the leader {leader.address} outlived {sig!r} by 30 s")
                lc.start_master(leader)
            while True:
                try:
                    c.update(key, b"after")
                    secs = time.perf_counter() - t0
                    break
                except Exception:
                    # The client retries with backoff by itself; this only bounds the attempt.
                    if time.perf_counter() - t0 > 300:
                        raise
        if not restart:
            leader.wait(30)
            lc.start_master(leader)
        lc.wait_ready(120, expect=len(lc.masters))
        self.add(name, secs, "s", "session_timeout_s", SESSION_TIMEOUT_MS / 1000)

    # ---- scale ------------------------------------------------------------------------

    def scale(self) -> None:
        lc = self.lc
        assert lc is not None and self.zk_connect is not None
        target = self.opts.scale_keys
        zk = _zk_open(self.zk_connect)
        try:
            self._scale(lc, zk, target)
        finally:
            _zk_close(zk)

    def _keys_in_zk(self, zk: KazooClient) -> int:
        return len(zk.get_children(CHROOT + BLOBSTORE))

    def _scale(self, lc: LocalCluster, zk: KazooClient, target: int) -> None:
        lc.wait_ready(120, expect=len(lc.masters))
        leader = lc.leader()
        followers = [m for m in lc.masters if m is not leader]
        before_keys = self._keys_in_zk(zk)
        rss_before = {m.index: rss_kib(m.pid) for m in lc.masters}

        # 1. Fill the cluster up to the target, concurrently.
        # Earlier phases' keys count towards the target, but a few are always created here so
        # the creation rate is measured even when they already reach a tiny smoke-test target.
        missing = max(target - before_keys, min(target, 10 * CONCURRENT_CLIENTS))
        data = os.urandom(SCALE_BLOB)
        tag = f"{self.prefix}-k"
        last = [time.monotonic()]

        def progress(n: int) -> None:
            if time.monotonic() - last[0] >= 30:
                last[0] = time.monotonic()
                self.log.say(f"  ... {min(n, missing):,} of {missing:,} keys")

        self.log.say(f"scale: creating {missing:,} keys ({before_keys:,} exist) with"
                     f" {CONCURRENT_CLIENTS} clients")
        res = client_driver(
            self.cluster, lambda c, i: c.create(f"{tag}-{i}", data)
        ).run(CONCURRENT_CLIENTS, total=missing, progress=progress)
        self._errors("scale creates", res)
        self.add("scale_create_per_s", res.rate, "op/s",
                 f"zk_sync_create_per_s_c{CONCURRENT_CLIENTS}",
                 self.zk_create_rate(CONCURRENT_CLIENTS))
        keys = self._keys_in_zk(zk)
        self.add("scale_keys", keys, "keys", "scale_keys_requested", target)

        # 2. Steady state: every master holds every key, so memory is measured at rest.
        self.log.say("scale: waiting until every master holds every key")
        t0 = time.monotonic()
        for m in lc.masters:
            self._wait_holds(m, keys, CATCHUP_TIMEOUT)
        self.log.say(f"scale: replicated everywhere {time.monotonic() - t0:.1f} s after the"
                     " last create")

        # 3. Memory.
        zk_stats = parse_mntr(four_letter_word(lc.zk.host, lc.zk.port, "mntr"))
        znodes = int(zk_stats["zk_znode_count"])
        zk_bytes_per_znode = int(zk_stats["zk_approximate_data_size"]) / max(znodes, 1)
        added = max(keys - before_keys, 1)
        rss_after = {m.index: rss_kib(m.pid) for m in lc.masters}
        worst = max(followers, key=lambda m: rss_after[m.index])
        for role, m in (("leader", leader), ("follower", worst)):
            self.add(f"scale_{role}_rss_mib", rss_after[m.index] / 1024, "MiB",
                     f"{role}_rss_before_keys_mib", rss_before[m.index] / 1024)
            per_key = (rss_after[m.index] - rss_before[m.index]) * 1024 / added
            self.add(f"scale_{role}_rss_per_key_b", per_key, "B",
                     "zk_data_bytes_per_znode", zk_bytes_per_znode)

        # 4. ZooKeeper load.
        wchs = four_letter_word(lc.zk.host, lc.zk.port, "wchs")
        self.add("scale_zk_watches", parse_wchs(wchs), "watches", "zk_znodes", znodes)
        self.add("scale_zk_znodes", znodes, "znodes", "keys", keys)

        # 5. Listing.
        with self.client() as c:
            c.cluster_summary()
            t0 = time.perf_counter()
            listed = sum(1 for _ in c.list())
            list_secs = time.perf_counter() - t0
        t0 = time.perf_counter()
        raw = len(zk.get_children(CHROOT + BLOBSTORE))
        raw_secs = time.perf_counter() - t0
        if listed != raw:
            self.log.note(f"the listing returned {listed:,} keys, ZooKeeper holds {raw:,}")
        self.add("scale_list_s", list_secs, "s", "zk_get_children_s", raw_secs)

        # 6. A follower with an empty disk catches up.
        new = followers[0]
        self.log.say(f"scale: wiping {new.address}'s data and restarting it")
        new.terminate()
        wiped = lc.data_dir / f"master-{new.index + 1}"
        # Renamed aside, not removed: removing 100,000 key directories stalled this VM's disk
        # for about four minutes (ext4 with discard), long enough to end the other masters'
        # ZooKeeper sessions, which then reconciled every key during the catch-up measured
        # here. It goes with the cluster's directory once the bench is over.
        wiped.rename(wiped.with_name(wiped.name + ".wiped"))
        t0 = time.monotonic()
        lc.start_master(new)
        done = self._wait_holds(new, keys, CATCHUP_TIMEOUT, progress=True)
        secs = time.monotonic() - t0
        if not done:
            self.log.note(f"the wiped follower did not catch up within {CATCHUP_TIMEOUT:.0f} s")
        zk_floor = keys / self.zk_create_rate(1) if self.zk_create_rate(1) else 0.0
        self.add("scale_catchup_s", secs, "s", "zk_sync_creates_for_all_keys_s", zk_floor)

    def _wait_holds(self, m: MasterProcess, keys: int, timeout: float,
                    progress: bool = False) -> bool:
        """Wait until master ``m`` reports at least ``keys`` blobs and no lag."""
        deadline = time.monotonic() + timeout
        last_say = time.monotonic()
        held = 0
        while time.monotonic() < deadline:
            try:
                s = node_status(m.address)
                held = s.blob_count
                if s.blob_count >= keys and s.lag_blobs == 0:
                    return True
            except grpc.RpcError:
                pass  # starting up, or busy: ask again
            if progress and time.monotonic() - last_say >= 30:
                last_say = time.monotonic()
                self.log.say(f"  ... {m.address} holds {held:,} of {keys:,} keys")
            time.sleep(1.0)
        return False

    # ---- clean-up ---------------------------------------------------------------------

    def remove_created(self) -> None:
        """A remote cluster keeps nothing of ours."""
        if not self.created:
            return
        self.log.say(f"removing {len(self.created):,} benchmark keys")
        keys = list(self.created)
        Driver(self.client, Client.close, lambda c, i: c.delete(keys[i])).run(
            min(CONCURRENT_CLIENTS, len(keys)), total=len(keys))


def node_status(address: str, timeout: float = 60.0) -> pb.MasterSummary:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.BlobStoreStub(ch)  # type: ignore[no-untyped-call]
        reply: pb.MasterSummary = stub.NodeStatus(
            pb.NodeStatusRequest(), timeout=timeout, metadata=((USER_METADATA_KEY, USER),)
        )
        return reply


def run(cluster_addr: str | None, local: bool, opts: BenchOptions, log: Log) -> list[Metric]:
    with tempfile.TemporaryDirectory(prefix="blobha-bench-") as tmp:
        lc: LocalCluster | None = None
        zk_connect = opts.zookeeper
        disk_dir = Path(opts.baseline_dir or tmp)
        if local:
            lc = LocalCluster(Path(tmp) / "cluster", nodes=3, base_port=0, overrides={
                "zookeeper.session.timeout.ms": SESSION_TIMEOUT_MS,
                "blobstore.disk.reserved.bytes": 0,
            }, spread_cpus=True)
            log.say(f"starting a local cluster of 3 masters in {lc.data_dir}")
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
                # Measured here: 32,000-52,000 files removed just before cost one client's
                # creates 21-22 % of their rate, and 27 % more CPU per create.
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
        bench = Bench(cluster_addr, opts, log, lc, zk_connect, disk_dir)
        try:
            return bench.run()
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
) -> int:
    """``blobha bench``; returns the exit status."""
    if not local and not cluster:
        print("blobha: error: give --local or --cluster", file=sys.stderr)
        return 2
    try:
        opts = BenchOptions(
            size_mb=size_mb, count=count, small_ops_seconds=small_ops_seconds,
            scale_keys=scale_keys, repeat=repeat, metrics=parse_metrics(metrics),
            spark_size_mb=spark_size_mb,
            zookeeper=zookeeper,
            baseline_dir=baseline_dir,
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
    # line turns it into an exception (cli._sigterm_interrupts).
    results = run(cluster, local, opts, log)
    if as_json:
        print(format_json(results))
    else:
        where = "a local 3-master cluster" if local else cluster
        print(f"blobha bench against {where}: --size-mb {opts.size_mb} --count {opts.count}"
              f" --small-ops-seconds {opts.small_ops_seconds:g} --scale-keys {opts.scale_keys}"
              f" --repeat {opts.repeat} --spark-size-mb {opts.spark_size_mb}")
        print(format_table(results))
        for n in log.notes:
            print(f"note: {n}")
    return 0
