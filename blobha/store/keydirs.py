"""Each key's lock and directory under keys/, and the store's running count of what it holds."""

from __future__ import annotations

import contextlib
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

from blobha.core.keys import key_dirname
from blobha.store.records import footprint
from blobha.store.segments import SegmentLog


class KeyDirs:
    """The per-key side of a :class:`~blobha.store.local.LocalStore`: the lock serialising a
    key's changes, its directory under ``keys/`` (if it has one), and (blobs, bytes) stored,
    kept current by every change made under :meth:`changing`."""

    def __init__(self, keys_dir: Path, segments: SegmentLog) -> None:
        self.keys_dir = keys_dir
        self._segments = segments
        # Weak: a key's lock lives while someone holds or waits for it, so 100,000s of keys
        # do not keep one lock each forever; whoever holds it keeps the same object alive.
        self._locks: weakref.WeakValueDictionary[str, threading.RLock] = (
            weakref.WeakValueDictionary())
        self._locks_guard = threading.Lock()
        #: Names of the key directories under keys/: only a version in files of its own (a
        #: large one, or one of an earlier release) has one, so most keys have none, and
        #: asking the file system about each would be a failing listing or two per key and
        #: install, each giving up the interpreter lock on the leader's commit path.
        #: Changed only under the key's lock, where the directory is made or removed.
        self.names: set[str] = set()
        # (blobs, bytes) as LocalStore.usage() counts them, kept current by every change
        # (each measures its key's directory before and after, under the key's lock): a status
        # call or a metrics scrape then costs nothing, where a scan of every key directory
        # takes seconds on a large store.
        self._counted_lock = threading.Lock()
        self._counted = (0, 0)
        self._changing_here = threading.local()

    def lock(self, key: str) -> threading.RLock:
        """The lock serialising changes to ``key``."""
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.RLock()
            return lock

    def path(self, key: str) -> Path:
        """``key``'s directory, whether it exists or not."""
        return self.keys_dir / key_dirname(key)

    def files_dir(self, key: str) -> Path | None:
        """``key``'s directory if it has one (see :attr:`names`), else None."""
        name = key_dirname(key)
        return self.keys_dir / name if name in self.names else None

    def remove(self, d: Path) -> None:
        """Remove key directory ``d`` and all in it; caller holds its key's lock."""
        # Whether listed or not: a directory made by hand, or by a release that kept none,
        # goes with the key too.
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            self.names.discard(d.name)

    @contextlib.contextmanager
    def changing(self, key: str) -> Iterator[Path]:
        """Hold ``key``'s lock while its directory (yielded) changes, and count the change
        into :meth:`counted`. Nested uses on one thread (prune -> delete_version) count
        once, at the outermost."""
        with self.lock(key):
            d = self.path(key)
            active: set[str] | None = getattr(self._changing_here, "keys", None)
            if active is None:
                active = self._changing_here.keys = set()
            if key in active:
                yield d
                return
            active.add(key)
            had, before = self.footprint(key, d)
            try:
                yield d
            finally:
                active.discard(key)
                has, after = self.footprint(key, d)
                if (had, before) != (has, after):
                    with self._counted_lock:
                        blobs, stored = self._counted
                        self._counted = (blobs + has - had, stored + after - before)

    def footprint(self, key: str, d: Path) -> tuple[bool, int]:
        """(whether ``key`` has a version here, their bytes): its files and its records."""
        found, stored = footprint(d) if d.name in self.names else (False, 0)
        in_log, logged = self._segments.footprint(key)
        return found or in_log, stored + logged

    def counted(self) -> tuple[int, int]:
        """(blobs, bytes) stored: as last :meth:`recount`, plus every change since."""
        with self._counted_lock:
            return self._counted

    def recount(self, usage: tuple[int, int]) -> None:
        """Start counting from ``usage``, as a scan found it."""
        with self._counted_lock:
            self._counted = usage
