"""A store's reads: version records, listings, and bytes checked chunk by chunk as they go out."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, BinaryIO

from blobha.core.digest import chunk_digest
from blobha.core.errors import ChecksumMismatch, InvalidArgument, KeyNotFound
from blobha.core.keys import key_of_dirname
from blobha.store.keydirs import KeyDirs
from blobha.store.records import VersionInfo, info_from, key_of_dir, read_packed, versions_in
from blobha.store.segments import HEADER_SIZE, SegmentLog, Slot, read_record, segment_path

log = logging.getLogger("blobha.store")


class VersionReader:
    """The read side of a :class:`~blobha.store.local.LocalStore`. A record found unreadable
    has its version removed with ``delete_version(key, seq)``; a chunk found corrupt, with
    ``discard_corrupt(key, seq, what)`` (the store's, which also has a healthy copy fetched)."""

    def __init__(self, segments: SegmentLog, dirs: KeyDirs,
                 delete_version: Callable[[str, int], None],
                 discard_corrupt: Callable[[str, int, str], None]) -> None:
        self.segments = segments
        self.dirs = dirs
        self._delete_version = delete_version
        self._discard_corrupt = discard_corrupt

    # ---- records and listings -------------------------------------------------------------

    def info(self, key: str, seq: int) -> VersionInfo | None:
        for _ in range(3):  # a record compaction moves is looked up again where it went
            slot = self.segments.slot(key, seq)
            if slot is None:
                break
            found = self.slot_info(key, seq, slot)
            if found is not None:
                return found
        try:
            return self._file_record(key, seq)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        # Again under the key's lock, which every install and removal of a version holds: a
        # record replaced or removed meanwhile reads whole or not at all then. Only one that
        # is still unreadable is damaged.
        with self.dirs.changing(key):
            try:
                return self._file_record(key, seq)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("unreadable version record of %r v%d (%s); removing the version",
                          key, seq, e)
                self._delete_version(key, seq)
                return None

    def _file_record(self, key: str, seq: int) -> VersionInfo | None:
        """The record of a version in files of its own; None if it has none."""
        d = self.dirs.files_dir(key)
        if d is None:
            return None
        try:
            return read_packed(d / f"v{seq}.ver", key)
        except FileNotFoundError:
            pass
        try:
            with open(d / f"v{seq}.json", encoding="utf-8") as f:
                return info_from(json.load(f), key)
        except FileNotFoundError:
            return None

    def slot_info(self, key: str, seq: int, slot: Slot) -> VersionInfo | None:
        """The record in ``slot`` of a version of ``key``, or None once it is gone (compacted
        away, deleted) or unreadable (then removed, as an unreadable file record is)."""
        found = self.slot_record(key, seq, slot)
        return found[1] if found is not None else None

    def slot_record(self, key: str, seq: int, slot: Slot
                    ) -> tuple[dict[str, Any], VersionInfo] | None:
        """:meth:`slot_info`, with the record as stored (compaction copies it as it is)."""
        found = self._read_slot(key, slot)
        if found is not None:
            return found
        # A removal (a prune, a delete, a replacing install, compaction's move) takes the
        # record out of the index before it marks it dead, under the key's lock: a record
        # found dead or gone once it left the index is simply not held there (any more), a
        # reader's routine race with pruning. Only one still indexed there is damaged.
        with self.dirs.changing(key):
            if self.segments.slot(key, seq) != slot:
                log.debug("record of %r v%d in segment %d at %d was removed or moved while"
                          " read", key, seq, slot.segment, slot.offset)
                return None
            found = self._read_slot(key, slot)
            if found is not None:
                return found
            log.error("unreadable record of %r v%d in segment %d at %d; removing the version",
                      key, seq, slot.segment, slot.offset)
            self.segments.kill(key, seq)
        return None

    def _read_slot(self, key: str, slot: Slot) -> tuple[dict[str, Any], VersionInfo] | None:
        """The live record in ``slot`` (None: gone, dead or unreadable)."""
        try:
            fd = os.open(segment_path(self.segments.dir, slot.segment),
                         os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            found = read_record(fd, slot.offset, slot.offset + slot.length)
        finally:
            os.close(fd)
        if found is None or not found[3]:
            return None
        record, rlen, _, _ = found
        try:
            info = info_from(record, key, packed=True)
        except (ValueError, KeyError, TypeError):
            return None
        return record, dataclasses.replace(info, segment=slot.segment,
                                           offset=slot.offset + HEADER_SIZE + rlen)

    def has_version(self, key: str, seq: int) -> bool:
        """Whether version ``seq`` is installed (its record exists); no parsing."""
        if self.segments.slot(key, seq) is not None:
            return True
        d = self.dirs.files_dir(key)
        if d is None:
            return False
        return (d / f"v{seq}.ver").exists() or (d / f"v{seq}.json").exists()

    def versions(self, key: str) -> list[int]:
        """Installed versions of ``key``, oldest first."""
        logged = self.segments.seqs(key)
        d = self.dirs.files_dir(key)
        on_disk = versions_in(d) if d is not None else []
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
        with os.scandir(self.dirs.keys_dir) as dirs:
            for d in dirs:
                if not d.is_dir(follow_symlinks=False):
                    continue  # a stray file; start-up logs it
                # The name decodes to the key unless it is a hashed one: one listing per key.
                # Reading a record of each costs a catching-up master much CPU.
                key = key_of_dirname(d.name)
                if key is None:
                    key = key_of_dir(Path(d.path))
                if key is not None and key not in logged and versions_in(d.path):
                    out.append(key)
        return out

    # ---- bytes ----------------------------------------------------------------------------

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
        f, info = self.open_version(info)
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
        f, info = self.open_version(info)
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

    def open_version(self, info: VersionInfo) -> tuple[BinaryIO, VersionInfo]:
        """The open file of a version's bytes, and its record: ``info``, or where compaction
        moved the same bytes since (its ``offset`` is that of the bytes in the file)."""
        try:
            if info.segment >= 0:
                try:
                    return open(segment_path(self.segments.dir, info.segment), "rb"), info
                except FileNotFoundError:
                    moved = self.info(info.key, info.seq)
                    if moved is None or moved.digest != info.digest or moved.segment < 0:
                        raise
                    return open(segment_path(self.segments.dir, moved.segment), "rb"), moved
            name = f"v{info.seq}.ver" if info.packed else f"v{info.seq}.blob"
            return open(self.dirs.path(info.key) / name, "rb"), info
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

    def _corrupt(self, info: VersionInfo, index: int) -> None:
        with self.dirs.lock(info.key):
            # The record as it is now, under the lock installs hold: a version replaced at the
            # same number since this reader loaded ``info`` (a key deleted and created again)
            # fails the old digests without being corrupt, and is the new, good copy.
            now = self.info(info.key, info.seq)
            if now is None or now.digest != info.digest:
                raise ChecksumMismatch(
                    f"version {info.seq} of {info.key!r} was replaced while it was read; retry")
            self._discard_corrupt(info.key, info.seq, f"chunk {index}")
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
