"""The node cache's counters on disk, shared by every process, and the reports made of them."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import NamedTuple

from blobha.cache.layout import Layout
from blobha.core.lazy import LazyLogger
from blobha.core.locks import lock_file

__all__ = ["CacheStats", "CleanupReport", "Counters"]

log = LazyLogger("blobha.cache")

_STAT_FIELDS = (
    "downloads",
    "hits",
    "evictions",
    "bytes_downloaded",
    "corrupt",
    "removed_versions",
    "checks",
    "verifications",
    "bytes_from_peers",
)


class CacheStats(NamedTuple):
    """Counters kept on disk, so they cover every process that used this cache directory,
    plus what the cache holds now."""

    downloads: int
    hits: int
    #: Current versions removed by cleanup (over the soft limit, or deleted remotely).
    evictions: int
    #: Bytes held now (blobs and unpacked trees).
    bytes: int
    bytes_downloaded: int
    #: Cached versions held now.
    entries: int
    #: Cached files that failed their digest check and were fetched again.
    corrupt: int
    #: Older versions removed once nobody referenced them.
    removed_versions: int
    #: Questions to the cluster about a key's current version (and the user's right to read
    #: it); answers recorded for the node spare the others.
    checks: int = 0
    #: Cached files hashed again to check their digest (a file the node's cache had not
    #: checked since the node started, or that changed since).
    verifications: int = 0
    #: Of ``bytes_downloaded``, the bytes other nodes' caches served (blobha.cache.peers).
    bytes_from_peers: int = 0


class CleanupReport(NamedTuple):
    """What one cleanup pass did. Keys are reported as ``(key, version)``."""

    #: Unreferenced and seen for the first time: deletable from the next pass on, once
    #: ``retention_secs`` have passed.
    staged: tuple[tuple[str, int], ...] = ()
    #: Current versions deleted (deleted remotely, or LRU while over the soft limit).
    evicted: tuple[tuple[str, int], ...] = ()
    #: Older versions deleted because no live process references them.
    removed_versions: tuple[tuple[str, int], ...] = ()
    #: References of dead processes removed.
    stale_refs: int = 0
    freed_bytes: int = 0
    #: Bytes held after the pass.
    total_bytes: int = 0
    #: Keys skipped because another thread or process held them (downloading, say).
    busy: tuple[str, ...] = ()
    #: False when another pass was running and this one (started by ``get``) stood aside.
    ran: bool = True


class Counters:
    """``stats.json``: download, hit, eviction... counters of every process on the node."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._lock = threading.Lock()
        #: Deltas held back while batched (see batched), else None.
        self._held: dict[str, int] | None = None

    def read(self) -> dict[str, int]:
        counters = dict.fromkeys(_STAT_FIELDS, 0)
        path = self._layout.root / "stats.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return counters
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)
            return counters
        for name in _STAT_FIELDS:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                counters[name] = int(data[name])
        return counters

    def bump(self, **deltas: int) -> None:
        """Add to the counters on disk; a read-modify-write under a lock every process takes.
        Best effort: counters lost on a full disk must not fail a read or a cleanup."""
        with self._lock:
            if self._held is not None:
                for name, delta in deltas.items():
                    self._held[name] = self._held.get(name, 0) + delta
                return
            self._add(deltas)

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Bumps made meanwhile (by any thread) reach the disk together, at the end.

        For a process that makes a few gets and ends (the Spark worker hook): each write
        replaces ``stats.json``, a rename over a file that some file systems (ext4) make
        flush the new file's data first, and one is enough."""
        with self._lock:
            if self._held is not None:
                outer = False  # nested: the outer batch writes
            else:
                self._held, outer = {}, True
        try:
            yield
        finally:
            if outer:
                with self._lock:
                    held, self._held = self._held, None
                    if held:
                        self._add(held)

    def _add(self, deltas: dict[str, int]) -> None:
        root = self._layout.root
        try:
            fd = lock_file(root / "stats.lock", blocking=True)
            assert fd is not None
            try:
                counters = self.read()
                for name, delta in deltas.items():
                    counters[name] += delta
                self._layout.write_atomic(root / "stats.json", json.dumps(counters).encode())
            finally:
                os.close(fd)
        except OSError as e:
            log.debug("cache counters under %s not updated: %s", root, e)
