"""Staged copies: versions a leader forwarded while committing them, kept until the commit names
them (see blobha.master.forward).

A forward's versions are appended together to the current file of ``staged/``, each a record:
a 4-byte length, a JSON header (key, size, digest), the bytes. The file is synced once per
forward, then the records are indexed by (key, digest) in memory; only then is the leader
told the copies are here. A run appends to files of its own, rolled by size and age. A
streamed upload's copy is a file of its own (``.blob``), received as a :class:`TempBlob` and
described, once synced and checked, by a ``.json`` beside it (key, size, digest, chunk
digests): installed, it is moved in whole (LocalStore.install_staged). A staged copy is never a
version: the synchroniser installs it (:meth:`StagedCopies.take`) only once it sees a commit of
that key with that digest, so a deposed leader's forward, which nothing commits, only waits
for its expiry. The files survive a restart (their index is read back at start-up) and expire
as abandoned uploads do: the upload reaper removes those idle longer than the upload
expiration.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blobha.core.digest import Digester
from blobha.store.files import fsync_dir, pwrite_all, write_json_atomic
from blobha.store.temp import TempBlob

log = logging.getLogger("blobha.store")

_LENGTH = struct.Struct(">I")
_SUFFIX = ".staged"
#: A file forwards are appended to is rolled at this size or age: one sync per forward (no
#: file made, renamed and its directory synced each time), and old files can go.
ROLL_BYTES = 64 * 1024 * 1024
ROLL_SECS = 60.0


@dataclass(frozen=True)
class _Entry:
    path: Path
    offset: int
    size: int
    #: A streamed copy's chunk digests (a file of its own); () for a record of a batch.
    chunks: tuple[str, ...] = ()


class StagedCopies:
    """The staged copies of one store, in ``root``. Thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: dict[tuple[str, str], _Entry] = {}
        #: Entries not taken yet, per file: a file goes once it has none (and, for the file
        #: appended to now, once it is rolled).
        self._left: dict[Path, int] = {}
        #: Serialises appends to the current file (``_current``, ``_fd``, ``_end``).
        self._append = threading.Lock()
        self._current: Path | None = None
        self._fd = -1
        self._end = 0
        self._opened_at = 0.0
        self._load()

    def _load(self) -> None:
        for p in sorted(self.root.iterdir()):
            if p.suffix == ".json":
                self._load_whole(p)
                continue
            if p.suffix == ".blob":
                if not p.with_suffix(".json").exists():
                    p.unlink(missing_ok=True)  # a stream cut short, never confirmed
                continue
            if not p.name.endswith(_SUFFIX):
                p.unlink(missing_ok=True)  # a forward that crashed before its sync
                continue
            found = 0
            for key, digest, entry in _scan(p):
                self._index[(key, digest)] = entry
                found += 1
            if found:
                self._left[p] = found
            else:
                p.unlink(missing_ok=True)

    def _load_whole(self, meta: Path) -> None:
        blob = meta.with_suffix(".blob")
        try:
            d = json.loads(meta.read_bytes())
            entry = _Entry(blob, 0, int(d["size"]), tuple(str(c) for c in d["chunks"]))
            key, digest = str(d["key"]), str(d["digest"])
            if blob.stat().st_size != entry.size:
                raise ValueError("size")
        except (OSError, ValueError, KeyError, TypeError):
            meta.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            return
        self._index[(key, digest)] = entry
        self._left[blob] = 1

    def new_part(self) -> TempBlob:
        """A file to receive a streamed copy into (:meth:`adopt` or discard it)."""
        return TempBlob(self.root / f"{uuid.uuid4().hex}.part")

    def adopt(self, key: str, size: int, digest: str, temp: TempBlob) -> bool:
        """Sync ``temp`` and keep it as the staged copy of ``key`` if it is ``size`` bytes
        with ``digest``; otherwise discard it. Whether it was kept."""
        try:
            actual, chunks, actual_size = temp.finish()
        except BaseException:
            temp.discard()
            raise
        if actual_size != size or actual != digest:
            log.warning("a forwarded upload of %r is %d bytes with digest %s, not %d with %s;"
                        " not staged", key, actual_size, actual, size, digest)
            temp.path.unlink(missing_ok=True)
            return False
        # Received anywhere in the store (a session's file is in tmp/): moved here.
        blob = self.root / f"{uuid.uuid4().hex}.blob"
        os.replace(temp.path, blob)
        write_json_atomic(blob.with_suffix(".json"), {
            "key": key, "size": size, "digest": digest, "chunks": list(chunks)})
        fsync_dir(self.root)
        with self._lock:
            old = self._index.get((key, digest))
            if old is not None:
                self._drop_locked(old)
            self._index[(key, digest)] = _Entry(blob, 0, size, tuple(chunks))
            self._left[blob] = 1
        return True

    def claim(self, key: str, digest: str, size: int) -> tuple[Path, tuple[str, ...]] | None:
        """Take the streamed copy of ``key`` with ``digest`` out of the index to install it:
        (its file, its chunk digests); None if there is none. :meth:`release` after."""
        with self._lock:
            entry = self._index.get((key, digest))
            if entry is None or not entry.chunks or entry.size != size:
                return None
            del self._index[(key, digest)]
            self._left.pop(entry.path, None)
        return entry.path, entry.chunks

    def release(self, path: Path) -> None:
        """Remove what is left of a claimed copy (its file, if it was not moved, and its
        description)."""
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)

    def is_whole(self, key: str, digest: str) -> bool:
        """Whether the staged copy of ``key`` with ``digest`` is a streamed one."""
        with self._lock:
            entry = self._index.get((key, digest))
        return entry is not None and bool(entry.chunks)

    def stage(self, versions: list[tuple[str, int, str, bytes]]) -> list[bool]:
        """Keep each (key, size, digest, data) whose bytes match its size and digest: one
        file, one sync. One entry per version: whether it is staged now (False: it did not
        match, and was not kept)."""
        good: list[tuple[str, int, str, bytes]] = []
        out: list[bool] = []
        for key, size, digest, data in versions:
            d = Digester()
            d.update(data)
            ok = len(data) == size and d.hexdigest() == digest
            out.append(ok)
            if ok:
                good.append((key, size, digest, data))
            else:
                log.warning("a forwarded copy of %r does not match its digest %s; not staged",
                            key, digest)
        if not good:
            return out
        placed: list[tuple[str, str, _Entry]] = []
        with self._append:
            path, fd, at = self._log()
            pieces: list[bytes] = []
            offset = at
            for key, size, digest, data in good:
                header = json.dumps({"key": key, "size": size, "digest": digest},
                                    ensure_ascii=False).encode()
                pieces += [_LENGTH.pack(len(header)), header, data]
                offset += _LENGTH.size + len(header)
                placed.append((key, digest, _Entry(path, offset, size)))
                offset += size
            try:
                pwrite_all(fd, b"".join(pieces), at)
                os.fdatasync(fd)
            except BaseException:
                # What follows a torn record would never be read back: a new file then.
                self._roll()
                raise
            self._end = offset
            with self._lock:
                for key, digest, entry in placed:
                    old = self._index.get((key, digest))
                    if old is not None:
                        self._drop_locked(old)
                    self._index[(key, digest)] = entry
                self._left[path] = self._left.get(path, 0) + len(placed)
        return out

    def _log(self) -> tuple[Path, int, int]:
        """The file forwards are appended to now (made, or rolled when full or old): its
        path, descriptor and end. Caller holds ``_append``."""
        now = time.monotonic()
        if (self._fd >= 0 and self._end < ROLL_BYTES
                and now - self._opened_at < ROLL_SECS):
            assert self._current is not None
            return self._current, self._fd, self._end
        self._roll()
        path = self.root / f"{uuid.uuid4().hex}{_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fsync_dir(self.root)  # the name first: a record in a file not found is lost
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._current = path
            self._left.setdefault(path, 0)
        self._fd, self._end, self._opened_at = fd, 0, now
        return path, fd, 0

    def _roll(self) -> None:
        """Stop appending to the current file; it goes once nothing in it is wanted. Caller
        holds ``_append``."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with self._lock:
            old, self._current = self._current, None
            if old is not None and not self._left.get(old, 0):
                self._left.pop(old, None)
                old.unlink(missing_ok=True)

    def close(self) -> None:
        with self._append:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def has(self, key: str, digest: str) -> bool:
        with self._lock:
            return (key, digest) in self._index

    def read(self, key: str, digest: str, size: int) -> bytes | None:
        """The staged bytes of ``key`` with ``digest``, checked again; None if none are here
        (or they no longer match: then they are dropped)."""
        with self._lock:
            entry = self._index.get((key, digest))
        if entry is None or entry.size != size or entry.chunks:
            return None  # a streamed copy is moved in whole (LocalStore.install_staged)
        try:
            with open(entry.path, "rb") as f:
                f.seek(entry.offset)
                data = f.read(size)
        except OSError:
            data = b""
        d = Digester()
        d.update(data)
        if len(data) != size or d.hexdigest() != digest:
            log.error("CORRUPT: the staged copy of %r (%s) fails its digest; dropped", key, digest)
            self.take(key, digest)
            return None
        return data

    def take(self, key: str, digest: str) -> None:
        """Forget the staged copy of ``key`` with ``digest`` (installed, or no longer wanted)."""
        with self._lock:
            entry = self._index.pop((key, digest), None)
            if entry is not None:
                self._drop_locked(entry)

    def _drop_locked(self, entry: _Entry) -> None:
        left = self._left.get(entry.path, 1) - 1
        if left > 0 or entry.path == self._current:
            self._left[entry.path] = max(left, 0)
            return
        self._left.pop(entry.path, None)
        entry.path.unlink(missing_ok=True)
        if entry.chunks:
            entry.path.with_suffix(".json").unlink(missing_ok=True)

    def count(self) -> int:
        with self._lock:
            return len(self._index)

    def expire(self, max_idle_secs: float, now: float | None = None,
               wanted: Callable[[str, str], bool] | None = None) -> int:
        """Remove the staged files written more than ``max_idle_secs`` ago (a forward that no
        commit named, or one whose commit this master installed from elsewhere), except a
        file holding a copy ``wanted(key, digest)`` says a commit names: a confirmed copy may
        be one of the W an acknowledged version counts on, however long its install waits
        (ZooKeeper out, say)."""
        now = time.time() if now is None else now
        removed = 0
        if self._append.acquire(blocking=False):
            try:
                current = self._current
                if current is not None and now - current.stat().st_mtime > max_idle_secs:
                    self._roll()  # idle that long: nothing more goes in it
            except FileNotFoundError:
                pass
            finally:
                self._append.release()
        with self._lock:
            for path in list(self._left):
                if path == self._current:
                    continue
                try:
                    age = now - path.stat().st_mtime
                except FileNotFoundError:
                    age = max_idle_secs + 1
                if age <= max_idle_secs:
                    continue
                if wanted is not None and any(
                        wanted(k[0], k[1]) for k, e in self._index.items() if e.path == path):
                    continue
                del self._left[path]
                for k in [k for k, e in self._index.items() if e.path == path]:
                    del self._index[k]
                path.unlink(missing_ok=True)
                if path.suffix == ".blob":
                    path.with_suffix(".json").unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("removed %d staged forward(s) that no commit installed", removed)
        return removed


def _scan(path: Path) -> list[tuple[str, str, _Entry]]:
    """The records of a staged file; a torn one at its end (a crash before the sync, never
    confirmed) ends the scan."""
    out: list[tuple[str, str, _Entry]] = []
    try:
        data = path.read_bytes()
    except OSError:
        return out
    at = 0
    while at + _LENGTH.size <= len(data):
        (n,) = _LENGTH.unpack_from(data, at)
        start = at + _LENGTH.size
        try:
            header = json.loads(data[start:start + n])
            key, size, digest = str(header["key"]), int(header["size"]), str(header["digest"])
        except (ValueError, KeyError, TypeError):
            break
        body = start + n
        if body + size > len(data):
            break
        out.append((key, digest, _Entry(path, body, size)))
        at = body + size
    return out
