"""A keyed work queue: each key is queued at most once, handled by one worker at a time.

A key queued again while a worker handles it runs once more afterwards, so no event is lost and
none is handled twice in parallel. Failed keys come back after a per-key backoff.

Under load, keys wait a little for company (``linger``): a key that becomes ready while another
batch is being handled is held until more keys join it, that batch ends, or ``linger`` has
passed since it arrived. Handing each key of a stream of small creates to its own worker made
every master pay the fixed costs of a batch (its pipelined ZooKeeper reads, a FetchVersions
call, two file-system syncs, a registration transaction) once per key, with the workers'
batches competing for the same cores; held back, they share them.

A steady trickle (one client creating key after key) mostly finds nothing running: each
follower replicated each key alone, one batch per create. So a key is also held while a stream
goes on: when the last batch ended less than ``linger`` ago and showed one, by carrying more
than one key, or by being the second batch in a row with a key that arrived while another batch
was being handled (one such key can be a lone write that came just as the batch before
finished). A key that finds the queue idle after a batch that showed none (a lone write, or one
client that waits for each write's replication before the next) goes at once, so it
replicates as soon as before.

A writer whose write quorum is above 1 waits for a follower's copy, so in a stream each of its
writes would wait out the linger as well, which cut such writers' rate several times over.
The synchroniser learns the quorum only from the state it reads after the hold; when a batch
shows a writer waiting, it calls :meth:`WorkQueue.hurry`, and for a while no batch is held
longer than :data:`HURRIED_LINGER`: short enough for such writers, long enough for their keys
to share batches (with no hold at all, they wrote more slowly).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

#: The longest hold while writers wait for copies (see :meth:`WorkQueue.hurry`).
HURRIED_LINGER = 0.03


class WorkQueue:
    def __init__(self, linger: float = 0.0) -> None:
        if linger < 0:
            raise ValueError("linger must not be negative")
        self._cond = threading.Condition()
        #: Keys due, in the order they became due, each with when it did (for the linger).
        self._ready: dict[str, float] = {}
        self._running: set[str] = set()
        self._linger = linger
        #: Batches handed out, and the keys in them, since start (read by the metrics).
        self.batches = 0
        self.batched_keys = 0
        self._delayed: list[tuple[float, str]] = []
        self._closed = False
        #: When the last batch ended, and whether the last one handed out showed a stream:
        #: it had company, or it and the one before each had a key that arrived while another
        #: batch was being handled (``_busy_arrival``, since the hand-out before; ``_busy_run``
        #: such batches in a row). See :meth:`_hold`.
        self._last_end = float("-inf")
        self._stream = False
        self._busy_arrival = False
        self._busy_run = 0
        #: Until when no batch is held longer than HURRIED_LINGER (see :meth:`hurry`).
        self._hurry_until = float("-inf")
        #: Workers waiting out a hold, and the batch size that ends one (see :meth:`put`).
        self._holding = 0
        self._hold_limit = 0

    def put(self, key: str, delay: float = 0.0) -> None:
        with self._cond:
            if delay > 0:
                heapq.heappush(self._delayed, (time.monotonic() + delay, key))
                self._cond.notify()
                return
            self._arrive(key, time.monotonic())
            # A worker holding a batch takes this key with it when the hold ends; waking it
            # changes nothing unless the batch is now full. In a stream of creates every key
            # woke the worker (a context switch and a pass over the queue each, many a batch),
            # which cost a follower much time holding the GIL.
            if not self._holding or len(self._ready) >= self._hold_limit:
                self._cond.notify()

    def put_many(self, keys: list[str]) -> None:
        with self._cond:
            now = time.monotonic()
            for k in keys:
                self._arrive(k, now)
            self._cond.notify_all()

    def _arrive(self, key: str, now: float) -> None:
        if key not in self._ready:
            self._ready[key] = now
            if self._running and key not in self._running:
                self._busy_arrival = True

    def get_batch(self, limit: int) -> list[str]:
        """Block until at least one key is due; take up to ``limit`` due keys that no worker
        handles (each is then running until :meth:`done_many`). Empty once closed.

        Batches let the synchroniser pipeline its ZooKeeper reads and replica registrations:
        one round trip for many keys instead of one per key. While another batch is being
        handled, a batch short of ``limit`` is held for up to the linger (see the module)."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    self._ready.setdefault(heapq.heappop(self._delayed)[1], now)
                batch = [k for k in itertools.islice(
                    (k for k in self._ready if k not in self._running), limit)]
                timeout = self._delayed[0][0] - now if self._delayed else None
                if batch:
                    hold = self._hold(batch, limit, now)
                    if hold <= 0:
                        for key in batch:
                            del self._ready[key]
                            self._running.add(key)
                        self.batches += 1
                        self.batched_keys += len(batch)
                        self._busy_run = self._busy_run + 1 if self._busy_arrival else 0
                        self._busy_arrival = False
                        self._stream = len(batch) >= 2 or self._busy_run >= 2
                        return batch
                    timeout = hold if timeout is None else min(hold, timeout)
                    self._holding += 1
                    self._hold_limit = limit
                    try:
                        self._cond.wait(timeout)
                    finally:
                        self._holding -= 1
                    continue
                self._cond.wait(timeout)
            return []

    def hurry(self, secs: float) -> None:
        """Hold no batch longer than :data:`HURRIED_LINGER` for the next ``secs`` seconds, a
        batch held now included: writers wait for this master's copies (a write quorum above
        1), and each of their writes would wait out the linger."""
        with self._cond:
            self._hurry_until = max(self._hurry_until, time.monotonic() + secs)
            self._cond.notify_all()

    def _hold(self, batch: list[str], limit: int, now: float) -> float:
        """Seconds ``batch`` should still wait for more keys (from its first key's arrival):
        none when it is full, nor when no other batch is being handled unless a stream goes on
        (the last batch showed one and ended within the linger; a key retried after its
        backoff shows none). done_many wakes the waiter when a running batch ends."""
        linger = self._linger if now >= self._hurry_until else min(self._linger,
                                                                    HURRIED_LINGER)
        if not linger or len(batch) >= limit:
            return 0.0
        if not self._running and not (self._stream and now - self._last_end < linger):
            return 0.0
        return self._ready[batch[0]] + linger - now

    def done_many(self, keys: list[str]) -> None:
        with self._cond:
            self._running.difference_update(keys)
            self._last_end = time.monotonic()
            self._cond.notify_all()

    def depth(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._running) + len(self._delayed)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
