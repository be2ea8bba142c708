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
    staged/                     copies a leader forwarded, kept until a commit names them
                                (see blobha.store.staged); expire as abandoned uploads do
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

import dataclasses
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import BinaryIO

from blobha.core.digest import CHUNK_SIZE, ChunkDigests, Digester
from blobha.core.errors import ChecksumMismatch, ResourceExhausted
from blobha.core.keys import key_dirname
from blobha.store import files
from blobha.store.compaction import Compactor
from blobha.store.datadir import DataDirInUse, lock_data_dir
from blobha.store.files import libc_function, write_json_atomic
from blobha.store.keydirs import KeyDirs
from blobha.store.reads import VersionReader
from blobha.store.recent import RECENT_BYTES, RECENT_VERSIONS, RecentVersions
from blobha.store.records import VersionInfo, footprint, info_json, remove_version_files
from blobha.store.segments import SegmentLog
from blobha.store.staged import StagedCopies
from blobha.store.temp import FLUSH_BYTES, BlobBuffer, TempBlob

# The rest of blobha imports these from here. Each is defined in the module named above: a
# test patches it there, since a patch of this module's copy reaches none of its callers.
__all__ = [
    "FLUSH_BYTES",
    "BlobBuffer",
    "DataDirInUse",
    "LocalStore",
    "TempBlob",
    "VersionInfo",
    "libc_function",
    "write_json_atomic",
]

log = logging.getLogger("blobha.store")


class LocalStore:
    """One master's blobs on disk. Thread-safe: operations on one key are serialised. The
    directory is locked against other stores (:func:`lock_data_dir`) until :meth:`close`.

    The one object the rest of blobha uses; its parts are :class:`KeyDirs` (each key's lock,
    directory and the running count), :class:`VersionReader` (:attr:`reads`),
    :class:`RecentVersions` and :class:`Compactor`. Installs and removals are here."""

    def __init__(self, root: Path, reserved_bytes: int = 0, *,
                 recent_bytes: int = RECENT_BYTES,
                 recent_versions: int = RECENT_VERSIONS,
                 on_locked: Callable[[], None] | None = None) -> None:
        """``on_locked`` is called once the directory's lock is held, before anything in it is
        read: what waits on a dead predecessor is dealt with then, not after the load, which
        grows with what the store holds."""
        self.root = root
        self.reserved_bytes = reserved_bytes
        self._lock_fd = lock_data_dir(root)
        try:
            if on_locked is not None:
                on_locked()
            self.keys_dir = root / "keys"
            self.tmp_dir = root / "tmp"
            self.keys_dir.mkdir(parents=True, exist_ok=True)
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
            self.segments_dir = root / "segments"
            self.segments = SegmentLog(self.segments_dir)
            #: Forwarded copies not committed yet (blobha.store.staged).
            self.staged = StagedCopies(root / "staged")
            #: Called with (key, seq) after a corrupt version was removed, so the master can
            #: unregister that replica and fetch a healthy copy.
            self.on_corrupt: Callable[[str, int], None] | None = None
            self._dirs = KeyDirs(self.keys_dir, self.segments)
            self.reads = VersionReader(self.segments, self._dirs, self.delete_version,
                                       self.discard_corrupt)
            self._recent = RecentVersions(recent_bytes, recent_versions)
            self._compactor = Compactor(self.segments, self._dirs, self.reads)
            self.clean_temp()
            self._dirs.recount(self.usage())
        except BaseException:
            self.close()
            raise
        # Segments left sparse by the removals of an earlier run are compacted now, not at
        # this run's first removal.
        self._compactor.soon()

    def close(self) -> None:
        """Let the directory go (another store may open it now). Idempotent."""
        compactor: Compactor | None = getattr(self, "_compactor", None)
        if compactor is not None:
            compactor.close()
        segments: SegmentLog | None = getattr(self, "segments", None)
        if segments is not None:
            segments.close()
        staged: StagedCopies | None = getattr(self, "staged", None)
        if staged is not None:
            staged.close()
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
            self._dirs.names.add(d.name)
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
        files.fsync_dir(self.keys_dir)
        return removed

    def key_lock(self, key: str) -> threading.RLock:
        """The lock serialising changes to ``key``; the leader's commit path holds it from
        install to ZooKeeper commit, so a concurrent clean-up never removes a fresh version."""
        return self._dirs.lock(key)

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
        self._place(temp.path, info)
        return info

    def install_staged(self, key: str, seq: int, digest: str, size: int) -> bool:
        """Make the staged copy of a streamed upload (blobha.store.staged) version ``seq`` of
        ``key``, by moving its file in: synced and checked against ``digest`` when it was
        staged, so as durable as :meth:`install`'s. False if no such copy is here."""
        claimed = self.staged.claim(key, digest, size)
        if claimed is None:
            return False
        path, chunks = claimed
        try:
            self._place(path, VersionInfo(key, seq, size, digest, CHUNK_SIZE, chunks))
        finally:
            self.staged.release(path)
        return True

    def _place(self, source: Path, info: VersionInfo) -> None:
        """Move the synced file ``source`` in as the version ``info`` describes."""
        key, seq = info.key, info.seq
        with self._dirs.changing(key) as d:
            self._recent.forget(key, seq)  # what install_many left of an earlier version seq
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
            self._dirs.names.add(d.name)
            os.replace(source, d / f"v{seq}.blob")
            try:
                files.write_json_atomic(d / f"v{seq}.json", info_json(info))
                files.fsync_dir(d)
            except BaseException:
                # A blob file without its record is no version: it would only fill the disk
                # until a restart's clean-up.
                self.delete_version(key, seq)
                raise
            if new_dir:
                # Only a new key directory changes keys/ itself.
                files.fsync_dir(self.keys_dir)

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
        slots = self.segments.append([(info_json(info), data) for _, info, data in staged])
        done = 0
        try:
            for (at, info, data), slot in zip(staged, slots, strict=True):
                placed = dataclasses.replace(info, segment=slot.segment,
                                             offset=slot.offset + slot.length - len(data))
                with self._dirs.changing(info.key) as d:
                    self.segments.install(info.key, info.seq, slot)
                    done += 1
                    # An earlier copy in files of its own goes (the record read first wins
                    # over it should a crash keep it).
                    if d.name in self._dirs.names:
                        remove_version_files(d, info.seq)
                    # Under the key's lock, as the index: a delete of the version forgets it
                    # under the same lock, so no removed version is remembered.
                    self._recent.remember(placed, data)
                out[at] = placed
            return out
        finally:
            for slot in slots[done:]:
                self.segments.discard(slot)

    # ---- reading (see VersionReader) ------------------------------------------------------

    def recent(self, key: str, seq: int) -> tuple[VersionInfo, bytes] | None:
        """Version ``seq`` of ``key`` and its bytes, if :meth:`install_many` installed it lately
        (None: read it with :meth:`info` and :meth:`read`). The bytes are the very ones whose
        digest the install checked before writing them, so they need no check against the
        disk; a version removed since (deleted, pruned, found corrupt) is never given."""
        return self._recent.get(key, seq)

    def info(self, key: str, seq: int) -> VersionInfo | None:
        return self.reads.info(key, seq)

    def has_version(self, key: str, seq: int) -> bool:
        """Whether version ``seq`` is installed (its record exists); no parsing."""
        return self.reads.has_version(key, seq)

    def versions(self, key: str) -> list[int]:
        """Installed versions of ``key``, oldest first."""
        return self.reads.versions(key)

    def latest(self, key: str) -> VersionInfo | None:
        return self.reads.latest(key)

    def find_by_digest(self, key: str, digest: str, size: int) -> VersionInfo | None:
        return self.reads.find_by_digest(key, digest, size)

    def keys(self) -> list[str]:
        """Every key with at least one installed version."""
        return self.reads.keys()

    def read(self, key: str, seq: int, offset: int = 0, length: int = 0) -> Iterator[bytes]:
        """Yield the bytes of a version, each chunk verified before it is yielded
        (:meth:`VersionReader.read`)."""
        return self.reads.read(key, seq, offset, length)

    def send_verified(self, info: VersionInfo, offset: int, end: int, opened: Callable[[], None],
                      send: Callable[[BinaryIO, int, int], object], checker: Executor) -> None:
        """Send bytes ``[offset, end)`` of a version, each chunk checked before its part is
        sent (:meth:`VersionReader.send_verified`)."""
        self.reads.send_verified(info, offset, end, opened, send, checker)

    def verify(self, key: str, seq: int) -> bool:
        """Re-read a whole version against its digests (removing it if corrupt)."""
        return self.reads.verify(key, seq)

    def discard_corrupt(self, key: str, seq: int, what: str) -> None:
        """Remove a version found corrupt (``what`` says how) so it is never served, and tell
        ``on_corrupt`` so a healthy replica is fetched."""
        log.error("CORRUPT: %s of version %d of %r fails its digest; removing this copy so it is"
                  " never served and a healthy replica is fetched", what, seq, key)
        self.delete_version(key, seq)
        if self.on_corrupt is not None:
            self.on_corrupt(key, seq)

    # ---- removal --------------------------------------------------------------------------

    def delete_version(self, key: str, seq: int) -> None:
        with self._dirs.changing(key) as d:
            self._recent.forget(key, seq)
            if self.segments.kill(key, seq):
                self._compactor.soon()
            if d.name not in self._dirs.names:
                return
            # The record goes first: without it the version does not exist, even mid-delete.
            (d / f"v{seq}.json").unlink(missing_ok=True)
            (d / f"v{seq}.ver").unlink(missing_ok=True)
            (d / f"v{seq}.blob").unlink(missing_ok=True)

    def prune(self, key: str, keep: int) -> None:
        """Keep only the newest ``keep`` versions of ``key``."""
        with self._dirs.changing(key):
            for seq in self.versions(key)[:-keep] if keep > 0 else self.versions(key):
                self.delete_version(key, seq)

    def delete_through(self, key: str, seq: int) -> None:
        """Delete the versions of ``key`` up to ``seq``, and the key's directory if none is left.
        A newer version stays: one the leader installed and committed while the caller waited
        for the key's lock is not the caller's to remove."""
        with self._dirs.changing(key) as d:
            left = False
            for version in self.versions(key):
                if version <= seq:
                    self.delete_version(key, version)
                else:
                    left = True
            if not left:
                self._dirs.remove(d)

    def delete_key(self, key: str) -> None:
        with self._dirs.changing(key) as d:
            for seq in self.versions(key):
                self.delete_version(key, seq)
            self._dirs.remove(d)

    # ---- figures --------------------------------------------------------------------------

    def counted_usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored, as :meth:`usage` counts them, without a scan: counted at
        start and kept by every change the store makes. Files changed behind its back (by
        hand) are counted again at the next start."""
        return self._dirs.counted()

    def usage(self) -> tuple[int, int]:
        """(blobs, bytes) stored: each key counted once, every retained version's bytes. A
        scan of every key directory; :meth:`counted_usage` gives the same figures at once."""
        logged = self.segments.usage()
        count = len(logged)
        total = sum(logged.values())
        logged_dirs = {key_dirname(k) for k in logged}
        with os.scandir(self.keys_dir) as dirs:
            for d in dirs:
                found, stored = footprint(d.path)
                count += found and d.name not in logged_dirs
                total += stored
        return count, total

    # ---- compaction (see Compactor) -------------------------------------------------------

    def compact(self) -> int:
        """Copy the live records of every sparse segment forward, then remove it (see
        blobha.store.segments); the number of records copied."""
        return self._compactor.compact()
