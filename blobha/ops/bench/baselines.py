"""The baselines measured on this machine in the same run, and a master's status asked directly.

The disk, a raw gRPC stream, the parts of a small create's floor, process memory, ZooKeeper's
answers.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from blobha.core.digest import CHUNK_SIZE, chunk_digest, digest_bytes
from blobha.ops.bench.driver import timed_ms, zk_close, zk_delete_tree, zk_open
from blobha.ops.bench.options import SMALL_BLOB, USER, MiB
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.peers import CHANNEL_OPTIONS, USER_METADATA_KEY

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


def fenced_commit_ms(connect: str, rounds: int, seconds: float) -> float:
    """Median ms of a ZooKeeper transaction shaped as the one that commits a small create: the
    leader's two fences (its candidacy and the epoch), the key's metadata, its replica node
    (ephemeral) and the change journal's record."""
    zk = zk_open(connect)
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

        return timed_ms(commit, rounds, seconds)
    finally:
        zk_delete_tree(zk, base)
        zk_close(zk)


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

            return timed_ms(install, rounds, seconds)
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


#: Numbers the bench's scratch files (see disk_write_secs).
_DD_FILES = itertools.count()


def disk_write_secs(directory: Path, size: int, block: int = MiB,
                    start: threading.Barrier | None = None) -> float:
    """dd bs=1M conv=fdatasync, in Python: write ``size`` bytes in ``block`` buffers, fdatasync,
    and return the seconds it took (from ``start``'s release, when given). The file is
    deleted afterwards."""
    buf = os.urandom(block)
    # A number of this process's own: writers at once (disk_writes_at_once_secs) may read one
    # clock value, and a pool's thread ident comes back for its next task.
    path = directory / (f".blobha-bench-dd-{os.getpid()}-{next(_DD_FILES)}"
                        f"-{time.monotonic_ns()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if start is not None:
            start.wait()
        t0 = time.perf_counter()
        left = size
        while left > 0:
            left -= os.write(fd, buf if left >= block else buf[:left])
        os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def disk_writes_at_once_secs(directory: Path, size: int, writers: int) -> float:
    """:func:`disk_write_secs` in ``writers`` threads at once (a write lets go of the GIL),
    each its own file, as that many masters sharing the disk write their copies: the seconds
    until the last is synced."""
    # Every writer in a thread of its own, started together: a pool thread that finished
    # early would otherwise take a second write, after the others.
    start = threading.Barrier(writers + 1)
    with ThreadPoolExecutor(writers, thread_name_prefix="bench-dd") as pool:
        futures = [pool.submit(disk_write_secs, directory, size, MiB, start)
                   for _ in range(writers)]
        start.wait()
        t0 = time.perf_counter()
        for f in futures:
            f.result()
        return time.perf_counter() - t0


_RAW_SERVICE = "blobha.ops.bench.Raw"
_RAW_METHOD = f"/{_RAW_SERVICE}/Stream"


def raw_grpc_server_main(chunk: int = CHUNK_SIZE) -> None:
    """A gRPC server streaming N bytes (the request, in ASCII) in ``chunk`` pieces: no disk, no
    hashing, no protobuf. Run in a child process so it does not share our GIL, as a master
    would not. Prints its port, exits when its stdin closes."""
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
            [sys.executable, "-c",
             "from blobha.ops.bench.baselines import raw_grpc_server_main as m; m()"],
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


class Discard(io.RawIOBase):
    """A write-only sink: downloads are timed without a destination disk in the way."""

    def writable(self) -> bool:
        return True

    def write(self, b: ReadableBuffer, /) -> int:
        return memoryview(b).nbytes


def read_file_into_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass


@dataclass(frozen=True)
class DiskCounters:
    """A block device's totals since boot, from ``/proc/diskstats``."""

    written: int  #: bytes written
    busy_ms: int  #: milliseconds with a request in flight (``io_ticks``)


def parse_diskstats(text: str, major: int, minor: int) -> DiskCounters | None:
    """The counters of device ``major:minor`` in the text of ``/proc/diskstats``; None if the
    text has no line for it."""
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 13 and f[0] == str(major) and f[1] == str(minor):
            return DiskCounters(written=int(f[9]) * 512, busy_ms=int(f[12]))
    return None


def disk_counters(path: Path, proc: Path = Path("/proc")) -> DiskCounters | None:
    """The counters of the block device holding ``path``; None where its file system has no
    block device of its own (tmpfs, overlay, btrfs) or the kernel does not say."""
    try:
        dev = os.stat(path).st_dev
        text = (proc / "diskstats").read_text()
    except OSError:
        return None
    return parse_diskstats(text, os.major(dev), os.minor(dev))


def parse_cpu_secs(stat_text: str, ticks_per_sec: int) -> float:
    """User plus system CPU seconds of every thread of a process, from the text of
    ``/proc/<pid>/stat`` (fields 14 and 15, counted after the command's closing parenthesis,
    which may itself hold spaces)."""
    fields = stat_text.rpartition(")")[2].split()
    if len(fields) < 13:
        raise ValueError(f"unexpected /proc/<pid>/stat text: {stat_text[:200]!r}")
    return (int(fields[11]) + int(fields[12])) / ticks_per_sec


def cpu_secs(pid: int) -> float:
    return parse_cpu_secs(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))


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


def node_status(address: str, timeout: float = 60.0) -> pb.MasterSummary:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.BlobStoreStub(ch)  # type: ignore[no-untyped-call]
        reply: pb.MasterSummary = stub.NodeStatus(
            pb.NodeStatusRequest(), timeout=timeout, metadata=((USER_METADATA_KEY, USER),)
        )
        return reply
