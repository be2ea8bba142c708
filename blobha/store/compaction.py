"""Segment compaction: live records of sparse segments copied forward by a background thread."""

from __future__ import annotations

import logging
import threading
from typing import Any

from blobha.core.errors import ChecksumMismatch, KeyNotFound
from blobha.store.keydirs import KeyDirs
from blobha.store.reads import VersionReader
from blobha.store.records import VersionInfo
from blobha.store.segments import SegmentLog, Slot

log = logging.getLogger("blobha.store")

#: Records compaction copies forward in one append (and one fdatasync).
COMPACT_BATCH = 256


class Compactor:
    """Copies the live records of sparse segments forward (see blobha.store.segments), on a
    thread of its own started at the first :meth:`soon`, or at once with :meth:`compact`."""

    def __init__(self, segments: SegmentLog, dirs: KeyDirs, reader: VersionReader) -> None:
        self.segments = segments
        self.dirs = dirs
        self.reader = reader
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False

    def soon(self) -> None:
        """Have the compactor look at the segments (after a removal made some bytes dead)."""
        if self._closed or not self.segments.sparse():
            return
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="segment-compactor", daemon=True)
                    self._thread.start()
        self._wake.set()

    def close(self) -> None:
        """Stop compacting (a pass under way stops between batches) and wait for the thread."""
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._wake.set()
            thread.join()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self.compact()
            except Exception:  # the thread must outlive one failure; the next removal retries
                log.exception("segment compaction failed")

    def compact(self) -> int:
        """Copy the live records of every sparse segment forward, then remove it; the number
        of records copied."""
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
            found = self.reader.slot_record(key, seq, slot)
            if found is None:
                continue
            try:
                # Checked chunk by chunk (a corrupt copy is removed by the read itself). The
                # version may have moved meanwhile: the index check below drops such a copy.
                data = b"".join(self.reader.read(key, seq))
            except (ChecksumMismatch, KeyNotFound):
                continue
            copies.append((*found, data, slot))
        if not copies:
            return 0
        # The records as they were (their install time too): a copy is the same version.
        slots = self.segments.append([(record, data) for record, _, data, _ in copies])
        moved = 0
        for (_, info, _, old), new in zip(copies, slots, strict=True):
            with self.dirs.changing(info.key):
                if self.segments.slot(info.key, info.seq) == old:
                    self.segments.install(info.key, info.seq, new)
                    moved += 1
                    continue
            self.segments.discard(new)
        return moved
