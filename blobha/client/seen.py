"""What one client has seen of each key (read-your-writes, monotonic reads): the newest
version it wrote or read, kept for the most recently used keys."""

from __future__ import annotations

import threading
from collections import OrderedDict

from blobha.core.consistency import DELETED, MinVersion
from blobha.core.errors import InvalidArgument

#: Keys remembered by default: each costs a few hundred bytes with its name, so a few MB in all.
DEFAULT_REMEMBERED_KEYS = 10_000


class SeenVersions:
    """A bounded LRU of key -> :class:`MinVersion`, shared by a client's threads. A key it
    drops (the least recently used beyond ``capacity``) is read as if never seen: any
    master's view serves it."""

    def __init__(self, capacity: int = DEFAULT_REMEMBERED_KEYS) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgument(
                f"remembered_keys must be a whole number of keys, 0 or more, not {capacity!r}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, MinVersion] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def minimum(self, key: str) -> MinVersion | None:
        """The oldest view of ``key`` this client accepts, or None (never seen, or dropped)."""
        with self._lock:
            seen = self._keys.get(key)
            if seen is not None:
                self._keys.move_to_end(key)
            return seen

    def saw(self, key: str, version: int, created_at: float) -> None:
        """``version`` of ``key`` (created at ``created_at``) was written or read. A master
        that does not say when the key was created (an older release) teaches nothing: its
        version number alone cannot be compared across a delete and create."""
        if version <= 0 or created_at <= 0:
            return
        self._remember(key, MinVersion(version, created_at))

    def deleted(self, key: str, created_at: float) -> None:
        """This client deleted the key created at ``created_at``: none of that incarnation's
        versions may be read again; the key absent, or created again since, may."""
        if created_at > 0:
            self._remember(key, MinVersion(DELETED, created_at))

    def _remember(self, key: str, seen: MinVersion) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            old = self._keys.get(key)
            self._keys[key] = seen if old is None else old.merge(seen)
            self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)
