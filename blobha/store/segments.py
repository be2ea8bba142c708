"""Small versions appended to shared segment files: no file, and no inode, per version.

A master installs every small version (:meth:`blobha.store.local.LocalStore.install_many`: group
commits on the leader, batched copies on the followers) as a record appended to the current
segment, ``segments/<n>.seg``; a batch is one write and one ``fdatasync``. A file per version
cost each master a file create, a directory per new key, a rename and two file-system syncs
per batch: many times the CPU of an append here for a small version, and on ext4 without a
journal much more, as every new inode passes over each one freed in the minutes before.

A record is::

    magic (8) | record length (4) | data length (8) | live (1) | check (8) | record | data

``record`` is the version's JSON record (key, seq, size, digests), ``data`` its bytes, and
``check`` the xxh3-64 of the two lengths and the record: a torn or overwritten header is
recognised as such. ``live`` is the one byte ever written in place: 0 once the version is
deleted or replaced. Its bytes are checked, as every version's, against the chunk digests of
its record on every read.

At start-up every segment is read through, header by header, into an in-memory index of
the live records (the later of two copies of a version wins: segments are numbered in the
order they were written, and compaction copies forward), up to the first place that holds no
whole, valid record (see :func:`scan`). A new segment takes the appends of
each run, and of each :data:`SEGMENT_BYTES`. A segment most of whose bytes are dead is
compacted: its live records are copied forward, then the file is removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from blobha.store import files

log = logging.getLogger("blobha.segments")

MAGIC = b"BLOBHAs1"
#: magic, record length, data length, live flag, check (xxh3-64 of the lengths and record).
_HEADER = struct.Struct("<8sIQB8s")
HEADER_SIZE = _HEADER.size
_LIVE_AT = 20  # the live flag's offset in a header
_LENGTHS = struct.Struct("<IQ")
#: A segment takes appends until it holds this much; then the next one does.
SEGMENT_BYTES = 64 * 1024 * 1024
#: A record longer than this is no record (a corrupt length): small versions are at most
#: a few MiB, their records a few hundred bytes.
MAX_RECORD = 1024 * 1024
MAX_DATA = 64 * 1024 * 1024
#: A closed segment is compacted once its live bytes are less than this share of it.
COMPACT_BELOW = 0.5
#: A record's header and record are read at once with this much.
_HEAD_READ = 4096
_SUFFIX = ".seg"


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one record lies: its segment, its header's offset, and its whole length."""

    segment: int
    offset: int
    length: int


def encode(record: dict[str, Any], data: bytes) -> list[bytes]:
    """The pieces of one live record, for ``pwritev``. ValueError for one too large for the
    scan to take as a record (it would be lost at the next start)."""
    raw = json.dumps(record, separators=(",", ":")).encode("utf-8")
    if len(raw) > MAX_RECORD or len(data) > MAX_DATA:
        raise ValueError(f"a segment record holds at most {MAX_DATA} bytes of data and"
                         f" {MAX_RECORD} of record, not {len(data)} and {len(raw)}")
    lengths = _LENGTHS.pack(len(raw), len(data))
    check = xxhash.xxh3_64_digest(lengths + raw)
    return [_HEADER.pack(MAGIC, len(raw), len(data), 1, check), raw, data]


def decode_head(buf: bytes) -> tuple[int, int, bool] | None:
    """(record length, data length, live) of a header at the start of ``buf``, whose record
    must follow it in ``buf`` whole when the lengths allow it; None if it is no valid header
    (torn, overwritten, not a record)."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, rlen, dlen, live, check = _HEADER.unpack_from(buf)
    if magic != MAGIC or rlen > MAX_RECORD or dlen > MAX_DATA:
        return None
    if len(buf) < HEADER_SIZE + rlen:
        return rlen, dlen, live == 1  # the caller reads the rest, then calls check_record
    if xxhash.xxh3_64_digest(_LENGTHS.pack(rlen, dlen) + buf[HEADER_SIZE:HEADER_SIZE + rlen]
                             ) != check:
        return None
    return rlen, dlen, live == 1


def check_record(head: bytes, record: bytes) -> bool:
    _magic, rlen, dlen, _, check = _HEADER.unpack_from(head)
    return bool(xxhash.xxh3_64_digest(_LENGTHS.pack(rlen, dlen) + record) == check)


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"{number:08d}{_SUFFIX}"


def read_record(fd: int, offset: int, end: int) -> tuple[dict[str, Any], int, int, bool] | None:
    """(record, record length, data length, live) of the record at ``offset`` of an open
    segment ``end`` bytes long; None where there is no whole, valid record."""
    buf = os.pread(fd, min(_HEAD_READ, end - offset), offset)
    head = decode_head(buf)
    if head is None:
        return None
    rlen, dlen, live = head
    if offset + HEADER_SIZE + rlen + dlen > end:
        return None  # torn: the data was never all written
    raw = buf[HEADER_SIZE:HEADER_SIZE + rlen]
    if len(raw) < rlen:
        raw = os.pread(fd, rlen, offset + HEADER_SIZE)
        if len(raw) < rlen or not check_record(buf[:HEADER_SIZE], raw):
            return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return record, rlen, dlen, live


def scan(path: Path) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """Every record of segment ``path``, in order: (offset, length, its record if live, else
    None). The first place that holds no whole, valid record ends it: the torn tail a crash
    leaves, or damage. It does not search on for the next magic: the bytes there may be a
    blob's, and a blob may hold what looks like a record (of any key); the versions lost past
    damage are fetched again from other replicas. Reading a segment file needs no lock (tests
    use it on a running master's files)."""
    with open(path, "rb") as f:
        fd = f.fileno()
        end = os.fstat(fd).st_size
        offset = 0
        while offset + HEADER_SIZE <= end:
            found = read_record(fd, offset, end)
            if found is None:
                break
            record, rlen, dlen, live = found
            length = HEADER_SIZE + rlen + dlen
            yield offset, length, record if live else None
            offset += length
        if offset < end:
            log.warning("segment %s: no whole record at byte %d of %d (a write a crash cut"
                        " short, or damage); the %d bytes from there are left out", path.name,
                        offset, end, end - offset)


class SegmentLog:
    """The segment files of one store and the index of their live records. Thread-safe; the
    store serialises the changes to any one key (its key lock) around the calls here."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        #: Appends and their fdatasync run one batch at a time: the error a failed write-back
        #: leaves is reported to one fdatasync of the shared descriptor, which must be the
        #: one of the batch whose pages it lost.
        self._append_lock = threading.RLock()
        self._index: dict[str, dict[int, Slot]] = {}
        #: Per segment: [bytes in it, bytes of its live records].
        self._sizes: dict[int, list[int]] = {}
        self._load()
        self._active = -1
        self._fd = -1
        self._end = 0
        self._open_active(max(self._sizes, default=0) + 1)

    # ---- start-up -----------------------------------------------------------------------

    def _load(self) -> None:
        numbers = sorted(int(p.name[:-len(_SUFFIX)]) for p in self.dir.iterdir()
                         if p.name.endswith(_SUFFIX) and p.name[:-len(_SUFFIX)].isdigit())
        for n in numbers:
            path = segment_path(self.dir, n)
            size = path.stat().st_size
            self._sizes[n] = [size, 0]
            for offset, length, record in scan(path):
                if record is None:
                    continue
                try:
                    key, seq = str(record["key"]), int(record["seq"])
                except (KeyError, TypeError, ValueError):
                    continue
                self._put(key, seq, Slot(n, offset, length))
        for n, (_, live) in list(self._sizes.items()):
            if live == 0:
                self._remove(n)
        if self._index:
            log.info("segments: %d small versions of %d keys in %d segment(s)",
                     sum(len(s) for s in self._index.values()), len(self._index),
                     len(self._sizes))

    def _open_active(self, number: int) -> None:
        """Make segment ``number`` the one appended to; on a failure (a full disk) the one
        before stays so, and the next append tries again."""
        path = segment_path(self.dir, number)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            # The new name must outlast a crash before any record in it is acknowledged.
            files.fsync_dir(self.dir)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._sizes[number] = [0, 0]
        old, self._fd, self._active, self._end = self._fd, fd, number, 0
        if old >= 0:
            os.close(old)

    def close(self) -> None:
        with self._append_lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)

    # ---- index --------------------------------------------------------------------------

    def _put(self, key: str, seq: int, slot: Slot) -> Slot | None:
        """Index ``slot`` as version ``seq`` of ``key`` (lock held or start-up); the slot it
        replaces, if any (its bytes now count as dead)."""
        seqs = self._index.setdefault(key, {})
        old = seqs.get(seq)
        seqs[seq] = slot
        self._sizes[slot.segment][1] += slot.length
        if old is not None:
            self._sizes[old.segment][1] -= old.length
        return old

    def slot(self, key: str, seq: int) -> Slot | None:
        with self._lock:
            seqs = self._index.get(key)
            return seqs.get(seq) if seqs else None

    def seqs(self, key: str) -> list[int]:
        with self._lock:
            seqs = self._index.get(key)
            return list(seqs) if seqs else []

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def footprint(self, key: str) -> tuple[bool, int]:
        """(whether ``key`` has a version here, their records' bytes)."""
        with self._lock:
            seqs = self._index.get(key)
            if not seqs:
                return False, 0
            return True, sum(s.length for s in seqs.values())

    def usage(self) -> dict[str, int]:
        """Bytes of each key's records."""
        with self._lock:
            return {k: sum(s.length for s in seqs.values()) for k, seqs in self._index.items()}

    # ---- appending ----------------------------------------------------------------------

    def append(self, records: list[tuple[dict[str, Any], bytes]]) -> list[Slot]:
        """Append records, make them durable (one write, one fdatasync), and return their
        slots; nothing is indexed yet (:meth:`install`). On a failure nothing of the batch
        stays valid: what was written is cut off again, or, past a failed fdatasync, marked
        dead."""
        pieces: list[bytes] = []
        lengths: list[int] = []
        for record, data in records:
            parts = encode(record, data)
            pieces.extend(parts)
            lengths.append(sum(len(p) for p in parts))
        with self._append_lock:
            if self._fd < 0:
                raise OSError(9, "the segment log is closed")
            if self._end >= SEGMENT_BYTES:
                self._roll()
            start = self._end
            try:
                files.pwritev_all(self._fd, pieces, start)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                raise
            self._end = start + sum(lengths)
            with self._lock:
                self._sizes[self._active][0] = self._end
            slots = []
            offset = start
            for n in lengths:
                slots.append(Slot(self._active, offset, n))
                offset += n
            try:
                os.fdatasync(self._fd)
            except BaseException:
                for s in slots:
                    self.discard(s)
                raise
            return slots

    def _roll(self) -> None:
        self._open_active(self._active + 1)

    def install(self, key: str, seq: int, slot: Slot) -> None:
        """Index a durable record as version ``seq`` of ``key``; the copy it replaces is
        marked dead."""
        with self._lock:
            old = self._put(key, seq, slot)
        if old is not None:
            self.discard(old)
            self.drop_if_empty(old.segment)

    def kill(self, key: str, seq: int) -> bool:
        """Remove version ``seq`` of ``key``: out of the index, and marked dead on disk (not
        synced: a copy that comes back after a crash is one the synchroniser removes, as it
        does a file whose unlink was lost). Whether there was one."""
        with self._lock:
            seqs = self._index.get(key)
            slot = seqs.pop(seq, None) if seqs else None
            if slot is None:
                return False
            if not seqs:
                del self._index[key]
            self._sizes[slot.segment][1] -= slot.length
        self.discard(slot)
        self.drop_if_empty(slot.segment)
        return True

    def sync_dead_marks(self, segment: int) -> None:
        """Make the dead marks written in ``segment`` durable: a replaced copy must not come
        back over the one that replaced it in a file of its own."""
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(segment_path(self.dir, segment), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def discard(self, slot: Slot) -> None:
        """Mark the record in ``slot`` dead on disk: one removed from the index, or appended
        and never indexed (a copy made redundant)."""
        try:
            with self._append_lock:  # the active descriptor stays open meanwhile
                if slot.segment == self._active and self._fd >= 0:
                    os.pwrite(self._fd, b"\0", slot.offset + _LIVE_AT)
                    return
            fd = os.open(segment_path(self.dir, slot.segment), os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, b"\0", slot.offset + _LIVE_AT)
            finally:
                os.close(fd)
        except OSError as e:
            # The index no longer has it, so it is not served; a restart would find it live
            # and the synchroniser would remove it then.
            log.warning("could not mark a removed small version dead in segment %d: %s",
                        slot.segment, e)

    def drop_if_empty(self, segment: int) -> None:
        """Remove ``segment`` if it is closed and holds no live record."""
        with self._lock:
            sizes = self._sizes.get(segment)
            empty = sizes is not None and sizes[1] == 0 and segment != self._active
        if empty:
            self._remove(segment)

    def _remove(self, segment: int) -> None:
        with self._lock:
            self._sizes.pop(segment, None)
        with contextlib.suppress(FileNotFoundError):
            segment_path(self.dir, segment).unlink()

    # ---- compaction ---------------------------------------------------------------------

    def sparse(self) -> list[int]:
        """Closed segments whose live bytes are below :data:`COMPACT_BELOW` of their size."""
        with self._lock:
            return [n for n, (size, live) in sorted(self._sizes.items())
                    if n != self._active and size and live < COMPACT_BELOW * size]

    def live_in(self, segment: int) -> list[tuple[str, int, Slot]]:
        with self._lock:
            return [(k, seq, s) for k, seqs in self._index.items() for seq, s in seqs.items()
                    if s.segment == segment]

    def stats(self) -> tuple[int, int, int]:
        """(segments, their bytes, their live records' bytes)."""
        with self._lock:
            return (len(self._sizes), sum(s for s, _ in self._sizes.values()),
                    sum(v for _, v in self._sizes.values()))
