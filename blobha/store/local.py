"""A master's local blob store: immutable version files, installed durably, verified on read.

Layout under the store root::

    keys/<dirname>/v<seq>.blob  the bytes of one committed version, never modified
    keys/<dirname>/v<seq>.json  its record: its key (dirname is an encoding, see blobha.core.keys),
                                size, xxh3-128 digest and per-chunk xxh3-64 digests
    segments/<n>.seg            small versions installed together (install_many): each a
                                record appended to a shared file (see blobha.store.segments)
    keys/<dirname>/v<seq>.ver   a small version as an earlier release stored it: its bytes and
                                its record in one file, the record after the bytes (read only)
    tmp/                        uploads and downloads in progress; emptied at start-up
    LOCK                        held (flock) by the process using the store; holds its pid
    zk-session                  not the store's: the master's ZooKeeper session, which its
                                successor on this directory ends (blobha.sync.SessionRecord)

A version exists only once its record is in place: a ``.json`` is renamed in after its
``.blob``, a segment's record is indexed after its fdatasync. So a crash at any point leaves
either the old state or the new one, plus debris in ``tmp/`` that start-up removes, or a torn
record at a segment's end that its scan passes over.

Every read checks each chunk against its stored digest before handing it out: a corrupt chunk
raises :class:`ChecksumMismatch` and the version is removed, so it is never served twice and
the synchroniser fetches a healthy copy. The one exception is
:meth:`LocalStore.recent`: the small versions last installed together, kept in memory for the
other masters' fetches, as the bytes whose digest the install checked.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, BinaryIO

from blobha.core.digest import CHUNK_SIZE, ChunkDigests, Digester, chunk_digest
from blobha.core.errors import ChecksumMismatch, InvalidArgument, KeyNotFound, ResourceExhausted
from blobha.core.keys import key_dirname, key_of_dirname
from blobha.core.locks import lock_file
from blobha.store.segments import (
    HEADER_SIZE,
    SegmentLog,
    Slot,
    fsync_dir,
    read_record,
    segment_path,
)

log = logging.getLogger("blobha.store")
# Temp-file names of version records (see write_json_atomic).
_temp_names = count()


@dataclass(frozen=True)
class VersionInfo:
    key: str
    seq: int
    size: int
    digest: str
    chunk_size: int
    chunks: tuple[str, ...]
    #: Stored with its record: a record of a segment (``segment`` >= 0), or a ``.ver`` file
    #: of an earlier release (else ``.blob`` and ``.json``).
    packed: bool = False
    #: The segment holding it and the offset of its bytes there; -1: a file of its own.
    segment: int = -1
    offset: int = 0


#: The last bytes of a ``.ver`` file: its record's length (4 bytes, little-endian), then this.
_PACKED_MAGIC = b"BLOBHAv1"
_PACKED_FOOTER = 4 + len(_PACKED_MAGIC)


#: Bytes, and versions, of the small versions last installed together that a store keeps in
#: memory (:meth:`LocalStore.recent`): the other masters fetch each new version within
#: milliseconds of its install, and reading it back from disk (its record, then its file)
#: was a tenth of a busy leader's Python time. 1,024 versions are seconds of creates at the
#: rates a cluster reaches, and cost about 2 MiB for 1 KiB blobs (4,096 took 9 MiB: 450
#: bytes of RSS a key in the bench's 20,000-key scale run).
RECENT_BYTES = 16 * 1024 * 1024
RECENT_VERSIONS = 1024
#: Records compaction copies forward in one append (and one fdatasync).
COMPACT_BATCH = 256
#: How much a temp file accumulates before its write-back to disk is started.
WRITEBACK_BYTES = 8 * 1024 * 1024
#: How much a temp file accumulates between two flushes in the background (see TempBlob).
FLUSH_BYTES = 32 * 1024 * 1024


def libc_function(name: str) -> Any:
    """A function of the C library this process runs on (ctypes), or None where it has none
    (not Linux, not glibc)."""
    try:
        return getattr(_LIBC, name) if _LIBC is not None else None
    except AttributeError:
        return None


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)  # the one already loaded in this process
    except OSError:
        return None


_LIBC = _load_libc()


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` (Linux), or None elsewhere."""
    fn = libc_function("sync_file_range")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start write-back of dirty pages, do not wait for it

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, write)  # advisory: a failure only means the fsync does it all

    return start


_start_writeback = _load_sync_file_range()
class BlobBuffer:
    """A small blob received into memory for :meth:`LocalStore.install_many`; appends behave
    as :meth:`TempBlob.write_at` (a retried chunk is skipped, a gap refused)."""

    def __init__(self) -> None:
        self._data = bytearray()

    @property
    def size(self) -> int:
        return len(self._data)

    def write_at(self, offset: int, data: bytes | memoryview) -> int:
        if offset > self.size:
            raise InvalidArgument(f"chunk at offset {offset} leaves a gap after {self.size} bytes")
        skip = self.size - offset
        if skip >= len(data):
            return 0
        self._data += memoryview(data)[skip:]
        return len(data) - skip

    def value(self) -> bytes:
        return bytes(self._data)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until all of ``data`` is written (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``os.pwrite`` of all of ``data`` at ``offset``. At an explicit offset, not the file's
    position: a write that stored part of its bytes and then failed (a full disk) moves the
    position, and the resumed upload's bytes would land that far off, shifted."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def write_json_atomic(path: Path, obj: object, sync: bool = True, mode: int = 0o644) -> None:
    """Write ``obj`` to a temp file and rename it to ``path``; ``sync=False`` leaves the fsync
    to the caller's file-system sync (a batch), or to nobody where a lost record costs little.

    One ``write`` of the encoded record on a raw descriptor, and a temp name from a counter:
    a buffered text file and a random name cost as much again, for a record written per
    version installed (100,000s when a master catches up)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{next(_temp_names)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        _write_all(fd, json.dumps(obj).encode("utf-8"))
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)


class TempBlob:
    """A file being received in ``tmp/``, with its running digests.

    ``write_at`` makes appends idempotent: bytes below the current size were already received
    (a retried chunk) and are skipped; bytes past it would leave a gap and are refused.

    The whole-blob digest and the per-chunk digests are computed from the very bytes handed to
    the file as they arrive, so installing needs no second pass over the data: reading the file
    back right after writing it would only re-read the page cache, not the disk.

    Durability is paid for while the bytes arrive, not after the last one: write-back starts
    every ``WRITEBACK_BYTES``, and every ``FLUSH_BYTES`` a thread of the file's own runs an
    fdatasync, so the fsync of :meth:`finish` (which the sender waits for) finds little left.
    A failed background flush fails the file, since Linux may report the next one as clean.
    ``discard`` may come from another thread (an expired upload) while a stream writes: the
    stream's next write raises ValueError, as on a closed file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # -1 once finished or discarded; guarded by _lock, as discard may come from another
        # thread.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._digester = Digester()
        self._chunks = ChunkDigests()
        self._lock = threading.Lock()
        self._flushed = 0  # bytes whose write-back to disk was started
        self._unsynced = 0  # bytes written since the last background flush began
        self._flusher: ThreadPoolExecutor | None = None
        self._flush: Future[None] | None = None

    @property
    def size(self) -> int:
        return self._digester.size

    def write_at(self, offset: int, data: bytes | memoryview) -> int:
        """Write ``data`` that starts at ``offset``; return how many new bytes were written."""
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"{self.path.name} was discarded")
            if offset > self.size:
                raise InvalidArgument(
                    f"chunk at offset {offset} leaves a gap: {self.size} bytes received so far;"
                    " resume from the offset GetUploadStatus reports"
                )
            skip = self.size - offset
            if skip >= len(data):
                return 0
            view = memoryview(data)[skip:]
            _pwrite_all(self._fd, view, self.size)
            self._digester.update(view)
            self._chunks.update(view)
            if _start_writeback is not None and self.size - self._flushed >= WRITEBACK_BYTES:
                # Start writing to disk now, while more bytes arrive, instead of leaving a whole
                # blob of dirty pages for the final fsync: a large upload then costs about the
                # longer of network and disk, not their sum.
                _start_writeback(self._fd, self._flushed, self.size - self._flushed)
                self._flushed = self.size
            self._unsynced += len(view)
            if self._unsynced >= FLUSH_BYTES and (self._flush is None or self._flush.done()):
                self._flush_in_background()
            return len(view)

    def _flush_in_background(self) -> None:
        # Written-back pages may still sit in the device's cache (a virtual disk's is the
        # host's page cache): flush them too while bytes arrive, since the final fsync of a
        # 1 GiB upload spent 1.4-1.7 s on that with the sender waiting. Caller holds _lock.
        if self._flush is not None:
            self._flush.result()  # a failed flush fails this write, and the upload
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(1, thread_name_prefix="blob-flush")
        self._flush = self._flusher.submit(os.fdatasync, self._fd)
        self._unsynced = 0

    def finish(self) -> tuple[str, list[str], int]:
        """fsync and close; return (whole digest, chunk digests, size) of what was received."""
        with self._lock:
            if self._fd < 0:
                raise ValueError(f"{self.path.name} was discarded")
            try:
                if self._flush is not None:
                    self._flush.result()
                on_disk = os.fstat(self._fd).st_size
                if on_disk > self.size:
                    # Bytes of a write that failed part way, never written over since.
                    os.ftruncate(self._fd, self.size)
                elif on_disk < self.size:
                    raise OSError(errno.EIO, f"{self.path.name} holds {on_disk} bytes of the"
                                  f" {self.size} written")
                os.fsync(self._fd)
            finally:
                self._release()
        return self._digester.hexdigest(), self._chunks.digests(), self.size

    def discard(self) -> None:
        with self._lock:
            self._release()
        self.path.unlink(missing_ok=True)

    def _release(self) -> None:
        # Caller holds _lock. The flush first: a descriptor number closed under it could be
        # reused by another file, and that file flushed instead.
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
            self._flusher = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DataDirInUse(OSError):
    """Another process (or another store object in this one) holds the store's directory."""


#: The store's lock file, under its root.
LOCK_NAME = "LOCK"


def lock_data_dir(root: Path) -> int:
    """Take ``root``'s lock (:func:`lock_file`) for as long as the returned descriptor stays
    open, and write our pid in it. A second master started with the same data directory (a
    copied configuration, a unit started twice) would otherwise empty tmp/ under the first
    one's uploads at its start-up and serve the same files as a second replica; it stops here
    instead, before it touches anything."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    fd = lock_file(path, blocking=False)
    if fd is None:
        try:
            holder = path.read_text("ascii", "replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise DataDirInUse(
            f"the data directory {root} is in use by another blobha master (pid {holder});"
            " stop that one first, or give this master a blobstore.dir of its own")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


class LocalStore:
    """One master's blobs on disk. Thread-safe: operations on one key are serialised. The
    directory is locked against other stores (:func:`lock_data_dir`) until :meth:`close`."""

    def __init__(self, root: Path, reserved_bytes: int = 0) -> None:
        self.root = root
        self.reserved_bytes = reserved_bytes
        self._lock_fd = lock_data_dir(root)
        try:
            self.keys_dir = root / "keys"
            self.tmp_dir = root / "tmp"
            self.keys_dir.mkdir(parents=True, exist_ok=True)
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
            self.segments_dir = root / "segments"
            self.segments = SegmentLog(self.segments_dir)
            self._compactor: threading.Thread | None = None
            self._compact_wake = threading.Event()
            self._closed = False
            #: Called with (key, seq) after a corrupt version was removed, so the master can
            #: unregister that replica and fetch a healthy copy.
            self.on_corrupt: Callable[[str, int], None] | None = None
            # Weak: a key's lock lives while someone holds or waits for it, so 100,000s of keys
            # do not keep one lock each forever; whoever holds it keeps the same object alive.
            self._locks: weakref.WeakValueDictionary[str, threading.RLock] = (
                weakref.WeakValueDictionary())
            self._locks_guard = threading.Lock()
            # (key, seq) -> (info, bytes) of recent install_many versions, oldest first.
            self._recent: collections.OrderedDict[tuple[str, int], tuple[VersionInfo, bytes]] = (
                collections.OrderedDict())
            self._recent_bytes = 0
            self._recent_lock = threading.Lock()
            #: Names of the key directories under keys/: only a version in files of its own (a
            #: large one, or one of an earlier release) has one, so most keys have none, and
            #: asking the file system about each was a failing listing or two per key and
            #: install, each giving up the interpreter lock on the leader's commit path (a
            #: tenth of its committing thread's time under eight writers, py-spy --idle).
            #: Changed only under the key's lock, where the directory is made or removed.
            self._dirs: set[str] = set()
            self.clean_temp()
            # (blobs, bytes) as usage() would count them, kept current by every change below
            # (each measures its key's directory before and after, under the key's lock): a
            # status call or a metrics scrape then costs nothing, where a scan of 100,000 key
            # directories took seconds, and tens of them on a master busy catching up.
            self._counted_lock = threading.Lock()
            self._counted = self.usage()
        except BaseException:
            self.close()
            raise
        self._changing_here = threading.local()
        # Segments left sparse by the removals of an earlier run are compacted now, not at
        # this run's first removal.
        self._compact_soon()

    def close(self) -> None:
        """Let the directory go (another store may open it now). Idempotent."""
        self._closed = True
        compactor = getattr(self, "_compactor", None)
        if compactor is not None:
            self._compact_wake.set()
            compactor.join()
        segments = getattr(self, "segments", None)
        if segments is not None:
            segments.close()
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    # ---- housekeeping -------------------------------------------------------------------

    def clean_temp(self) -> int:
        """Remove debris of crashed writes: everything in tmp/ and half-installed versions."""
        removed = 0
        for p in self.tmp_dir.iterdir():
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed += 1
        for d in self.keys_dir.iterdir():
            if not d.is_dir():
                continue  # not ours (the store only makes directories here); leave it alone
            self._dirs.add(d.name)
            for p in d.iterdir():
                name = p.name
                orphan_blob = name.endswith(".blob") and not p.with_suffix(".json").exists()
                if ".tmp-" in name or orphan_blob:
                    p.unlink(missing_ok=True)
                    removed += 1
        if removed:
            log.info("start-up: removed %d temporary or half-installed files", removed)
        # install() syncs keys/ only when it makes a key's directory; one made before a crash
        # and not yet synced would otherwise never be.
        fsync_dir(self.keys_dir)
        return removed

    def key_lock(self, key: str) -> threading.RLock:
        """The lock serialising changes to ``key``; the leader's commit path holds it from
        install to ZooKeeper commit, so a concurrent clean-up never removes a fresh version."""
        return self._lock(key)

    def _lock(self, key: str) -> threading.RLock:
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.RLock()
            return lock

    def _dir(self, key: str) -> Path:
        return self.keys_dir / key_dirname(key)

    def _files_dir(self, key: str) -> Path | None:
        """``key``'s directory if it has one (see ``_dirs``), else None."""
        name = key_dirname(key)
        return self.keys_dir / name if name in self._dirs else None

    @contextlib.contextmanager
    def _changing(self, key: str) -> Iterator[Path]:
        """Hold ``key``'s lock while its directory (yielded) changes, and count the change
        into :meth:`counted_usage`. Nested uses on one thread (prune -> delete_version) count
        once, at the outermost."""
        with self._lock(key):
            d = self._dir(key)
            active: set[str] | None = getattr(self._changing_here, "keys", None)
            if active is None:
                active = self._changing_here.keys = set()
            if key in active:
                yield d
                return
            active.add(key)
            had, before = self._footprint(key, d)
            try:
                yield d
            finally:
                active.discard(key)
                has, after = self._footprint(key, d)
                if (had, before) != (has, after):
                    with self._counted_lock:
                        blobs, stored = self._counted
                        self._counted = (blobs + has - had, stored + after - before)

    def _footprint(self, key: str, d: Path) -> tuple[bool, int]:
        """(whether ``key`` has a version here, their bytes): its files and its records."""
        found, stored = _footprint(d) if d.name in self._dirs else (False, 0)
        in_log, logged = self.segments.footprint(key)
        return found or in_log, stored + logged

    # ---- space ---------------------------------------------------------------------------

    def disk_free(self) -> int:
        return shutil.disk_usage(self.root).free

    def reserve(self, nbytes: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) if writing ``nbytes`` would eat into the reservation."""
        free = self.disk_free()
        if free - nbytes < self.reserved_bytes:
            raise ResourceExhausted(
                f"not enough disk space: {nbytes} bytes would leave {max(free - nbytes, 0)} free,"
                f" below blobstore.disk.reserved.bytes={self.reserved_bytes}; free space on the"
                " masters or delete blobs"
            )

    # ---- writing --------------------------------------------------------------------------

    def new_temp(self, label: str) -> TempBlob:
        return TempBlob(self.tmp_dir / f"{label}-{uuid.uuid4().hex}.part")

    def install(self, key: str, seq: int, temp: TempBlob, size: int, digest: str) -> VersionInfo:
        """Make ``temp`` version ``seq`` of ``key``: fsync, verify, rename, fsync the directory.

        Raises :class:`ChecksumMismatch` (and deletes ``temp``) if the bytes written are not
        exactly ``size`` bytes with ``digest``.
        """
        try:
            actual_digest, chunks, actual_size = temp.finish()
            if actual_size != size or actual_digest != digest:
                raise ChecksumMismatch(
                    f"the data received for {key!r} does not match: expected {size} bytes with"
                    f" xxh3-128 {digest}, got {actual_size} bytes with {actual_digest}; nothing"
                    " was stored, upload again"
                )
        except BaseException:
            temp.discard()
            raise
        info = VersionInfo(key, seq, size, digest, CHUNK_SIZE, tuple(chunks))
        with self._changing(key) as d:
            self._forget(key, seq)  # what install_many left of an earlier version seq
            # Replaced, not kept: read first, an earlier packed copy would hide this one, so
            # its removal is made durable before this one exists.
            old = self.segments.slot(key, seq)
            if old is not None and self.segments.kill(key, seq):
                self.segments.sync_dead_marks(old.segment)
            (d / f"v{seq}.ver").unlink(missing_ok=True)
            try:
                d.mkdir()
                new_dir = True
            except FileExistsError:
                new_dir = False
            self._dirs.add(d.name)
            os.replace(temp.path, d / f"v{seq}.blob")
            try:
                write_json_atomic(d / f"v{seq}.json", _info_json(info))
                fsync_dir(d)
            except BaseException:
                # A blob file without its record is no version: it would only fill the disk
                # until a restart's clean-up.
                self.delete_version(key, seq)
                raise
            if new_dir:
                # Only a new key directory changes keys/ itself.
                fsync_dir(self.keys_dir)
        return info

    def install_copy(self, key: str, seq: int, source: VersionInfo) -> VersionInfo:
        """Install version ``seq`` with the same bytes as a local version (a roll-back, or a
        sync that finds the bytes here already): a second copy, so it needs its own room."""
        self.reserve(source.size)
        temp = self.new_temp("copy")
        try:
            for data in self.read(source.key, source.seq):
                temp.write_at(temp.size, data)
        except BaseException:
            temp.discard()
            raise
        return self.install(key, seq, temp, source.size, source.digest)

    def install_many(self, items: list[tuple[str, int, bytes, int, str]]
                     ) -> list[VersionInfo | ChecksumMismatch]:
        """Install many small versions, each ``(key, seq, data, size, digest)``, with the durability
        of :meth:`install` for each: verify each blob's size and digest (from the very bytes to
        be written, as :class:`TempBlob` does) -> append them with their records to the current
        segment in one write -> fdatasync -> index them. Nothing is returned (so nothing
        registered) before the sync. One entry per item: its VersionInfo, or the
        ChecksumMismatch that kept it out."""
        out: list[VersionInfo | ChecksumMismatch] = []
        staged: list[tuple[int, VersionInfo, bytes]] = []
        for key, seq, data, size, digest in items:
            whole, chunks = Digester(), ChunkDigests()
            whole.update(data)
            chunks.update(data)
            if len(data) != size or whole.hexdigest() != digest:
                out.append(ChecksumMismatch(
                    f"the copy of {key!r} v{seq} does not match: expected {size} bytes"
                    f" with xxh3-128 {digest}, got {len(data)} bytes with"
                    f" {whole.hexdigest()}"
                ))
                continue
            info = VersionInfo(key, seq, size, digest, CHUNK_SIZE, tuple(chunks.digests()),
                               packed=True)
            staged.append((len(out), info, data))
            out.append(info)
        if not staged:
            return out
        slots = self.segments.append([(_info_json(info), data) for _, info, data in staged])
        done = 0
        try:
            for (at, info, data), slot in zip(staged, slots, strict=True):
                placed = dataclasses.replace(info, segment=slot.segment,
                                             offset=slot.offset + slot.length - len(data))
                with self._changing(info.key) as d:
                    self.segments.install(info.key, info.seq, slot)
                    done += 1
                    # An earlier copy in files of its own goes (the record read first wins
                    # over it should a crash keep it).
                    if d.name in self._dirs:
                        _remove_version_files(d, info.seq)
                    # Under the key's lock, as the index: a delete of the version forgets it
                    # under the same lock, so no removed version is remembered.
                    self._remember(placed, data)
                out[at] = placed
            return out
        finally:
            for slot in slots[done:]:
                self.segments.discard(slot)

    def _remember(self, info: VersionInfo, data: bytes) -> None:
        with self._recent_lock:
            entry = (info.key, info.seq)
            old = self._recent.pop(entry, None)
            if old is not None:
                self._recent_bytes -= len(old[1])
            self._recent[entry] = (info, data)
            self._recent_bytes += len(data)
            while self._recent and (self._recent_bytes > RECENT_BYTES
                                    or len(self._recent) > RECENT_VERSIONS):
                _, (_, dropped) = self._recent.popitem(last=False)
                self._recent_bytes -= len(dropped)

    def _forget(self, key: str, seq: int) -> None:
        with self._recent_lock:
            old = self._recent.pop((key, seq), None)
            if old is not None:
                self._recent_bytes -= len(old[1])

    # ---- reading --------------------------------------------------------------------------

    def recent(self, key: str, seq: int) -> tuple[VersionInfo, bytes] | None:
        """Version ``seq`` of ``key`` and its bytes, if :meth:`install_many` installed it lately
        (None: read it with :meth:`info` and :meth:`read`). The bytes are the very ones whose
        digest the install checked before writing them, so they need no check against the
        disk; a version removed since (deleted, pruned, found corrupt) is never given."""
        with self._recent_lock:
            return self._recent.get((key, seq))

    def info(self, key: str, seq: int) -> VersionInfo | None:
        for _ in range(3):  # a record compaction moves is looked up again where it went
            slot = self.segments.slot(key, seq)
            if slot is None:
                break
            found = self._slot_info(key, seq, slot)
            if found is not None:
                return found
        d = self._files_dir(key)
        if d is None:
            return None
        path = d / f"v{seq}.ver"
        try:
            try:
                return _read_packed(path, key)
            except FileNotFoundError:
                pass
            path = d / f"v{seq}.json"
            with open(path, encoding="utf-8") as f:
                return _info_from(json.load(f), key)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            log.error("unreadable version record %s; removing the version", path)
            self.delete_version(key, seq)
            return None

    def _slot_info(self, key: str, seq: int, slot: Slot) -> VersionInfo | None:
        """The record in ``slot`` of a version of ``key``, or None once it is gone (compacted
        away, deleted) or unreadable (then removed, as an unreadable file record is)."""
        found = self._slot_record(key, seq, slot)
        return found[1] if found is not None else None

    def _slot_record(self, key: str, seq: int, slot: Slot
                     ) -> tuple[dict[str, Any], VersionInfo] | None:
        """:meth:`_slot_info`, with the record as stored (compaction copies it as it is)."""
        try:
            fd = os.open(segment_path(self.segments_dir, slot.segment),
                         os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            found = read_record(fd, slot.offset, slot.offset + slot.length)
        finally:
            os.close(fd)
        try:
            if found is None or not found[3]:
                raise ValueError("no live record")
            record, rlen, _, _ = found
            info = _info_from(record, key, packed=True)
            return record, dataclasses.replace(info, segment=slot.segment,
                                               offset=slot.offset + HEADER_SIZE + rlen)
        except (ValueError, KeyError, TypeError):
            log.error("unreadable record of %r v%d in segment %d at %d; removing the version",
                      key, seq, slot.segment, slot.offset)
            with self._changing(key):
                if self.segments.slot(key, seq) == slot:
                    self.segments.kill(key, seq)
            return None

    def has_version(self, key: str, seq: int) -> bool:
        """Whether version ``seq`` is installed (its record exists); no parsing."""
        if self.segments.slot(key, seq) is not None:
            return True
        d = self._files_dir(key)
        if d is None:
            return False
        return (d / f"v{seq}.ver").exists() or (d / f"v{seq}.json").exists()

    def versions(self, key: str) -> list[int]:
        """Installed versions of ``key``, oldest first."""
        logged = self.segments.seqs(key)
        d = self._files_dir(key)
        on_disk = _versions_in(d) if d is not None else []
        return sorted({*logged, *on_disk}) if logged else on_disk

    def latest(self, key: str) -> VersionInfo | None:
        for seq in reversed(self.versions(key)):
            info = self.info(key, seq)
            if info is not None:
                return info
        return None

    def find_by_digest(self, key: str, digest: str, size: int) -> VersionInfo | None:
        for seq in reversed(self.versions(key)):
            info = self.info(key, seq)
            if info is not None and info.digest == digest and info.size == size:
                return info
        return None

    def keys(self) -> list[str]:
        """Every key with at least one installed version."""
        out = self.segments.keys()
        logged = set(out)
        with os.scandir(self.keys_dir) as dirs:
            for d in dirs:
                if not d.is_dir(follow_symlinks=False):
                    continue  # a stray file; start-up logs it
                # The name decodes to the key unless it is a hashed one: one listing per key.
                # Reading a record of each was 8% of a catching-up master's CPU (py-spy).
                key = key_of_dirname(d.name)
                if key is None:
                    key = _key_of_dir(Path(d.path))
                if key is not None and key not in logged and _versions_in(d.path):
                    out.append(key)
        return out

    def read(self, key: str, seq: int, offset: int = 0, length: int = 0) -> Iterator[bytes]:
        """Yield the bytes of a version, each chunk verified before it is yielded.

        ``length`` 0 means to the end. A mismatch removes the version and raises
        :class:`ChecksumMismatch`; nothing of the bad chunk is yielded.
        """
        info = self.info(key, seq)
        if info is None:
            raise KeyNotFound(f"version {seq} of {key!r} is not stored on this master")
        if offset > info.size:
            raise InvalidArgument(f"offset {offset} is past the end of {key!r} ({info.size} bytes)")
        end = info.size if length == 0 else min(info.size, offset + length)
        f, info = self._open_version(info)
        with f:
            index = offset // info.chunk_size
            f.seek(info.offset + index * info.chunk_size)
            pos = index * info.chunk_size
            while pos < end:
                # Not past the version's bytes: a packed file's record follows them.
                data = f.read(min(info.chunk_size, info.size - pos))
                self._check_chunk(info, index, data)
                lo = max(offset - pos, 0)
                hi = min(end - pos, len(data))
                yield data[lo:hi] if (lo, hi) != (0, len(data)) else data
                pos += len(data)
                index += 1

    def send_verified(self, info: VersionInfo, offset: int, end: int, opened: Callable[[], None],
                      send: Callable[[BinaryIO, int, int], object], checker: Executor) -> None:
        """Have ``send(file, position, count)`` send bytes ``[offset, end)`` of a version from
        its file (the data channel's ``sendfile``, which hands the page cache's pages to the
        socket without copying them), each chunk checked against its stored digest before its
        part is sent. ``opened`` is called once the file is open, so the caller can answer "not
        held here" before promising data.

        The check of the next chunk runs on ``checker`` while this one is sent (xxhash and
        ``sendfile`` both let go of the GIL): a master's CPU per byte is then the larger of the
        two, not their sum. A mismatch removes the version and raises
        :class:`ChecksumMismatch` before anything of the bad chunk is sent, as :meth:`read`
        does."""
        f, info = self._open_version(info)
        with f:
            opened()
            fd = f.fileno()
            base = info.offset
            buffer = memoryview(bytearray(info.chunk_size))

            def check(index: int) -> None:
                # pread, not the file's position: the sender's sendfile moves that. Not past
                # the version's bytes: a packed file's record follows them.
                start = index * info.chunk_size
                n = os.preadv(fd, [buffer[:max(0, min(info.chunk_size, info.size - start))]],
                              base + start)
                self._check_chunk(info, index, buffer[:n])

            index = offset // info.chunk_size
            pending = checker.submit(check, index) if offset < end else None
            try:
                while pending is not None:
                    pending.result()
                    lo = max(offset, index * info.chunk_size)
                    hi = min(end, (index + 1) * info.chunk_size)
                    index += 1
                    pending = checker.submit(check, index) if hi < end else None
                    send(f, base + lo, hi - lo)
            finally:
                if pending is not None and not pending.cancel():
                    # Still reading into the buffer: wait before the file closes.
                    with contextlib.suppress(Exception):
                        pending.result()

    def _open_version(self, info: VersionInfo) -> tuple[BinaryIO, VersionInfo]:
        """The open file of a version's bytes, and its record: ``info``, or where compaction
        moved the same bytes since (its ``offset`` is that of the bytes in the file)."""
        try:
            if info.segment >= 0:
                try:
                    return open(segment_path(self.segments_dir, info.segment), "rb"), info
                except FileNotFoundError:
                    moved = self.info(info.key, info.seq)
                    if moved is None or moved.digest != info.digest or moved.segment < 0:
                        raise
                    return open(segment_path(self.segments_dir, moved.segment), "rb"), moved
            name = f"v{info.seq}.ver" if info.packed else f"v{info.seq}.blob"
            return open(self._dir(info.key) / name, "rb"), info
        except FileNotFoundError:
            raise KeyNotFound(
                f"version {info.seq} of {info.key!r} is not stored on this master") from None

    def _check_chunk(self, info: VersionInfo, index: int, data: bytes | memoryview) -> None:
        """Chunk ``index`` as read must have its stored digest and length, else the version
        is removed (:meth:`_corrupt`)."""
        expected = min(info.chunk_size, info.size - index * info.chunk_size)
        if index >= len(info.chunks) or len(data) != expected or (
                chunk_digest(data) != info.chunks[index]):
            self._corrupt(info, index)

    def discard_corrupt(self, key: str, seq: int, what: str) -> None:
        """Remove a version found corrupt (``what`` says how) so it is never served, and tell
        ``on_corrupt`` so a healthy replica is fetched."""
        log.error("CORRUPT: %s of version %d of %r fails its digest; removing this copy so it is"
                  " never served and a healthy replica is fetched", what, seq, key)
        self.delete_version(key, seq)
        if self.on_corrupt is not None:
            self.on_corrupt(key, seq)

    def _corrupt(self, info: VersionInfo, index: int) -> None:
        with self._lock(info.key):
            # The record as it is now, under the lock installs hold: a version replaced at the
            # same number since this reader loaded ``info`` (a key deleted and created again)
            # fails the old digests without being corrupt, and is the new, good copy.
            now = self.info(info.key, info.seq)
            if now is None or now.digest != info.digest:
                raise ChecksumMismatch(
                    f"version {info.seq} of {info.key!r} was replaced while it was read; retry")
            self.discard_corrupt(info.key, info.seq, f"chunk {index}")
        raise ChecksumMismatch(
            f"this master's copy of {info.key!r} version {info.seq} is corrupt and was removed;"
            " retry, another replica will serve it"
        )

    def verify(self, key: str, seq: int) -> bool:
        """Re-read a whole version against its digests (removing it if corrupt)."""
        try:
            for _ in self.read(key, seq):
                pass
        except (ChecksumMismatch, KeyNotFound):
            return False
        return True

    # ---- removal --------------------------------------------------------------------------

    def delete_version(self, key: str, seq: int) -> None:
        with self._changing(key) as d:
            self._forget(key, seq)
            if self.segments.kill(key, seq):
                self._compact_soon()
            if d.name not in self._dirs:
                return
            # The record goes first: without it the version does not exist, even mid-delete.
            (d / f"v{seq}.json").unlink(missing_ok=True)
            (d / f"v{seq}.ver").unlink(missing_ok=True)
            (d / f"v{seq}.blob").unlink(missing_ok=True)

    def prune(self, key: str, keep: int) -> None:
        """Keep only the newest ``keep`` versions of ``key``."""
        with self._changing(key):
            for seq in self.versions(key)[:-keep] if keep > 0 else self.versions(key):
                self.delete_version(key, seq)

    def delete_through(self, key: str, seq: int) -> None:
        """Delete the versions of ``key`` up to ``seq``, and the key's directory if none is left.
        A newer version stays: one the leader installed and committed while the caller waited
        for the key's lock is not the caller's to remove."""
        with self._changing(key) as d:
            left = False
            for version in self.versions(key):
                if version <= seq:
                    self.delete_version(key, version)
                else:
                    left = True
            if not left:
                self._remove_dir(d)

    def delete_key(self, key: str) -> None:
        with self._changing(key) as d:
            for seq in self.versions(key):
                self.delete_version(key, seq)
            self._remove_dir(d)

    def _remove_dir(self, d: Path) -> None:
        # Whether listed or not: a directory made by hand, or by a release that kept none,
        # goes with the key too.
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            self._dirs.discard(d.name)

    # ---- figures --------------------------------------------------------------------------

    def counted_usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored, as :meth:`usage` counts them, without a scan: counted at
        start and kept by every change the store makes. Files changed behind its back (by
        hand) are counted again at the next start."""
        with self._counted_lock:
            return self._counted

    def usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored: each key counted once, every retained version's bytes. A
        scan of every key directory; :meth:`counted_usage` gives the same figures at once."""
        logged = self.segments.usage()
        count = len(logged)
        total = sum(logged.values())
        logged_dirs = {key_dirname(k) for k in logged}
        with os.scandir(self.keys_dir) as dirs:
            for d in dirs:
                found, stored = _footprint(d.path)
                count += found and d.name not in logged_dirs
                total += stored
        return count, total

    # ---- compaction -----------------------------------------------------------------------

    def _compact_soon(self) -> None:
        """Have the compactor look at the segments (after a removal made some bytes dead)."""
        if self._closed or not self.segments.sparse():
            return
        if self._compactor is None:
            with self._locks_guard:
                if self._compactor is None:
                    self._compactor = threading.Thread(
                        target=self._compact_loop, name="segment-compactor", daemon=True)
                    self._compactor.start()
        self._compact_wake.set()

    def _compact_loop(self) -> None:
        while True:
            self._compact_wake.wait()
            self._compact_wake.clear()
            if self._closed:
                return
            try:
                self.compact()
            except Exception:  # the thread must outlive one failure; the next removal retries
                log.exception("segment compaction failed")

    def compact(self) -> int:
        """Copy the live records of every sparse segment forward, then remove it (see
        blobha.store.segments); the number of records copied."""
        moved = 0
        for segment in self.segments.sparse():
            live = self.segments.live_in(segment)
            for start in range(0, len(live), COMPACT_BATCH):
                if self._closed:
                    return moved
                moved += self._copy_forward(live[start:start + COMPACT_BATCH])
            self.segments.drop_if_empty(segment)
        return moved

    def _copy_forward(self, live: list[tuple[str, int, Slot]]) -> int:
        """Append checked copies of ``live`` records, then index each copy where its version
        still lies where it was read (under the key's lock: a version deleted or replaced
        meanwhile keeps its own fate, and the copy is dropped)."""
        copies: list[tuple[dict[str, Any], VersionInfo, bytes, Slot]] = []
        for key, seq, slot in live:
            found = self._slot_record(key, seq, slot)
            if found is None:
                continue
            try:
                # Checked chunk by chunk (a corrupt copy is removed by the read itself). The
                # version may have moved meanwhile: the index check below drops such a copy.
                data = b"".join(self.read(key, seq))
            except (ChecksumMismatch, KeyNotFound):
                continue
            copies.append((*found, data, slot))
        if not copies:
            return 0
        # The records as they were (their install time too): a copy is the same version.
        slots = self.segments.append([(record, data) for record, _, data, _ in copies])
        moved = 0
        for (_, info, _, old), new in zip(copies, slots, strict=True):
            with self._changing(info.key):
                if self.segments.slot(info.key, info.seq) == old:
                    self.segments.install(info.key, info.seq, new)
                    moved += 1
                    continue
            self.segments.discard(new)
        return moved


def _remove_version_files(d: Path, seq: int) -> None:
    """Remove version ``seq``'s files from key directory ``d``, if it has any: its record
    first, so it is gone even if the rest is not."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return
    for suffix in (".json", ".ver", ".blob"):
        if f"v{seq}{suffix}" in names:
            (d / f"v{seq}{suffix}").unlink(missing_ok=True)


def _footprint(d: str | Path) -> tuple[bool, int]:
    """(whether it holds a version file, their bytes) of key directory ``d``: a packed
    version's bytes include its record's few hundred."""
    found = False
    total = 0
    try:
        with os.scandir(d) as files:
            for f in files:
                if f.name.startswith("v") and f.name.endswith((".blob", ".ver")):
                    try:
                        total += f.stat().st_size
                        found = True
                    except FileNotFoundError:
                        pass
    except (FileNotFoundError, NotADirectoryError):
        pass
    return found, total


def _versions_in(d: str | Path) -> list[int]:
    """The installed versions in key directory ``d``, oldest first."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    seqs = set()
    for n in names:
        if n.startswith("v") and n.endswith(".json") and n[1:-5].isdigit():
            seqs.add(int(n[1:-5]))
        elif n.startswith("v") and n.endswith(".ver") and n[1:-4].isdigit():
            seqs.add(int(n[1:-4]))
    return sorted(seqs)


def _key_of_dir(d: Path) -> str | None:
    """The key a directory under keys/ holds: named in each version record (the directory name
    is an encoding that long keys make one-way); stores written before that have a ``key``
    file."""
    try:
        names = sorted(n for n in os.listdir(d)
                       if n.startswith("v") and n.endswith((".json", ".ver")))
    except OSError:
        return None
    for name in [*names, "key"]:
        try:
            if name.endswith(".ver"):
                return _read_packed(d / name, None).key
            with open(d / name, encoding="utf-8") as f:
                return str(json.load(f)["key"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _info_from(raw: dict[str, Any], key: str, packed: bool = False) -> VersionInfo:
    return VersionInfo(
        key, int(raw["seq"]), int(raw["size"]), str(raw["digest"]),
        int(raw["chunk_size"]), tuple(raw["chunks"]), packed,
    )


#: A packed file's tail read at once: the record of a small version comes with its footer.
_PACKED_TAIL_READ = 4096


def _read_packed(path: Path, key: str | None) -> VersionInfo:
    """The record at the end of packed version file ``path`` (for ``key``; None: the key it
    names). ValueError if the file does not end in a whole record that accounts for its every
    byte (a truncated or overwritten file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end = os.fstat(fd).st_size
        take = min(end, _PACKED_TAIL_READ)
        tail = os.pread(fd, take, end - take)
        if len(tail) < _PACKED_FOOTER or not tail.endswith(_PACKED_MAGIC):
            raise ValueError(f"{path.name} has no record at its end")
        n = int.from_bytes(tail[-_PACKED_FOOTER:-len(_PACKED_MAGIC)], "little")
        if n + _PACKED_FOOTER > end:
            raise ValueError(f"{path.name}'s record is longer than the file")
        if n + _PACKED_FOOTER <= take:
            record = tail[take - _PACKED_FOOTER - n:take - _PACKED_FOOTER]
        else:
            record = os.pread(fd, n, end - _PACKED_FOOTER - n)
    finally:
        os.close(fd)
    raw = json.loads(record)
    info = _info_from(raw, str(raw["key"]) if key is None else key, packed=True)
    if info.size + n + _PACKED_FOOTER != end:
        raise ValueError(f"{path.name} holds {end} bytes, not its {info.size} and its record")
    return info


def _info_json(info: VersionInfo) -> dict[str, object]:
    return {
        "key": info.key,
        "seq": info.seq,
        "size": info.size,
        "digest": info.digest,
        "chunk_size": info.chunk_size,
        "chunks": list(info.chunks),
        "installed_at": time.time(),
    }
