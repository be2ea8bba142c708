"""The small versions a store installed last, kept in memory for the other masters' fetches."""

from __future__ import annotations

import collections
import threading

from blobha.store.records import VersionInfo

#: Bytes, and versions, of the small versions last installed together that a store keeps in
#: memory: the other masters fetch each new version within milliseconds of its install, and
#: reading it back from disk (its record, then its file) is a large share of a busy leader's
#: Python time. The bound is seconds of creates at the rates a cluster reaches, for a few MiB
#: of memory with small blobs (each version held costs some RSS beyond its bytes).
RECENT_BYTES = 16 * 1024 * 1024
RECENT_VERSIONS = 1024


class RecentVersions:
    """(key, seq) -> (record, bytes) of the versions last remembered, oldest dropped first
    once there are more than ``max_versions`` or more than ``max_bytes`` of bytes."""

    def __init__(self, max_bytes: int = RECENT_BYTES,
                 max_versions: int = RECENT_VERSIONS) -> None:
        self.max_bytes = max_bytes
        self.max_versions = max_versions
        # Oldest first.
        self._recent: collections.OrderedDict[tuple[str, int], tuple[VersionInfo, bytes]] = (
            collections.OrderedDict())
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str, seq: int) -> tuple[VersionInfo, bytes] | None:
        with self._lock:
            return self._recent.get((key, seq))

    def remember(self, info: VersionInfo, data: bytes) -> None:
        with self._lock:
            entry = (info.key, info.seq)
            old = self._recent.pop(entry, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._recent[entry] = (info, data)
            self._bytes += len(data)
            while self._recent and (self._bytes > self.max_bytes
                                    or len(self._recent) > self.max_versions):
                _, (_, dropped) = self._recent.popitem(last=False)
                self._bytes -= len(dropped)

    def forget(self, key: str, seq: int) -> None:
        with self._lock:
            old = self._recent.pop((key, seq), None)
            if old is not None:
                self._bytes -= len(old[1])
