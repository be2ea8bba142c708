"""Blobs being received: a temp file (written, fsynced, digested as it goes) or a memory buffer."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from blobha.core.digest import ChunkDigests, Digester
from blobha.core.errors import InvalidArgument
from blobha.store.files import pwrite_all, start_writeback

#: How much a temp file accumulates before its write-back to disk is started.
WRITEBACK_BYTES = 8 * 1024 * 1024
#: How much a temp file accumulates between two flushes in the background (see TempBlob).
FLUSH_BYTES = 32 * 1024 * 1024


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


class TempBlob:
    """A file being received in ``tmp/``, with its running digests.

    ``write_at`` makes appends idempotent: bytes below the current size were already received
    (a retried chunk) and are skipped; bytes past it would leave a gap and are refused.

    The whole-blob digest and the per-chunk digests are computed from the very bytes handed to
    the file as they arrive, so installing needs no second pass over the data: reading the file
    back right after writing it would only re-read the page cache, not the disk.

    Durability is paid for while the bytes arrive, not after the last one: write-back starts
    every ``writeback_bytes``, and every ``flush_bytes`` a thread of the file's own runs an
    fdatasync, so the fsync of :meth:`finish` (which the sender waits for) finds little left.
    A failed background flush fails the file, since Linux may report the next one as clean.
    ``discard`` may come from another thread (an expired upload) while a stream writes: the
    stream's next write raises ValueError, as on a closed file.
    """

    def __init__(self, path: Path, flush_bytes: int = FLUSH_BYTES,
                 writeback_bytes: int = WRITEBACK_BYTES) -> None:
        self.path = path
        self._flush_bytes = flush_bytes
        self._writeback_bytes = writeback_bytes
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
            pwrite_all(self._fd, view, self.size)
            self._digester.update(view)
            self._chunks.update(view)
            if (start_writeback is not None
                    and self.size - self._flushed >= self._writeback_bytes):
                # Start writing to disk now, while more bytes arrive, instead of leaving a whole
                # blob of dirty pages for the final fsync: a large upload then costs about the
                # longer of network and disk, not their sum.
                start_writeback(self._fd, self._flushed, self.size - self._flushed)
                self._flushed = self.size
            self._unsynced += len(view)
            if self._unsynced >= self._flush_bytes and (
                    self._flush is None or self._flush.done()):
                self._flush_in_background()
            return len(view)

    def _flush_in_background(self) -> None:
        # Written-back pages may still sit in the device's cache (a virtual disk's is the
        # host's page cache): flush them too while bytes arrive, since otherwise the final
        # fsync of a large upload spends long on that with the sender waiting. Caller holds
        # _lock.
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
