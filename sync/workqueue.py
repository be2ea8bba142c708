"""A keyed work queue: each key is queued at most once, handled by one worker at a time.

A key queued again while a worker handles it runs once more afterwards, so no event is lost and
none is handled twice in parallel. Failed keys come back after a per-key backoff.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time


class WorkQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: dict[str, None] = {}  # insertion-ordered set
        self._running: set[str] = set()
        self._delayed: list[tuple[float, str]] = []
        self._closed = False

    def put(self, key: str, delay: float = 0.0) -> None:
        with self._cond:
            if delay > 0:
                heapq.heappush(self._delayed, (time.monotonic() + delay, key))
            else:
                self._ready[key] = None
            self._cond.notify()

    def put_many(self, keys: list[str]) -> None:
        with self._cond:
            for k in keys:
                self._ready[k] = None
            self._cond.notify_all()

    def get_batch(self, limit: int) -> list[str]:
        """Block until at least one key is due; take up to ``limit`` due keys that no worker
        handles (each is then running until :meth:`done_many`). Empty once closed.

        Batches let the synchroniser pipeline its ZooKeeper reads and replica registrations:
        one round trip for many keys instead of one per key."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    self._ready[heapq.heappop(self._delayed)[1]] = None
                batch = [k for k in itertools.islice(
                    (k for k in self._ready if k not in self._running), limit)]
                if batch:
                    for key in batch:
                        del self._ready[key]
                        self._running.add(key)
                    return batch
                timeout = self._delayed[0][0] - now if self._delayed else None
                self._cond.wait(timeout)
            return []

    def done_many(self, keys: list[str]) -> None:
        with self._cond:
            self._running.difference_update(keys)
            self._cond.notify_all()

    def depth(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._running) + len(self._delayed)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
