"""Group commit: concurrent small writes share one durable install and one ZooKeeper commit.

A whole small blob (:meth:`blobha.master.facade.Master.put`) costs the leader a few file syncs
and one fenced ZooKeeper transaction, whose fixed costs (the fences, the change journal's record, a
round trip, ZooKeeper's own log sync) do not grow with the number of keys in it. Writers that
arrive while a commit is in flight therefore wait for the next one and go in it together, as
databases group their log flushes: with one writer nothing waits longer than before, with many
each batch costs about what one write did.

:class:`GroupCommitter` is only the batching: a queue, one committing thread, and a future per
write. What a batch does is the ``handler`` it is given. Writes to the same key never share a
batch, so the handler can take each key's lock and read its state once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

from blobha.core.errors import Unavailable

log = logging.getLogger("blobha.groupcommit")

T = TypeVar("T")
R = TypeVar("R")

#: Writes committed together at most. A ZooKeeper multi-op is one request, bounded by
#: jute.maxbuffer (1 MiB by default); 64 keys of metadata stay far below it.
MAX_BATCH = 64


class Later:
    """A handler's answer for an item it cannot take now (its key is busy elsewhere): the item
    goes back to the head of the queue once ``ready()`` returns. ``ready`` runs on a thread of
    its own, so the batches of every other key go on meanwhile; what it raises goes to the
    item's submitter."""

    def __init__(self, ready: Callable[[], None]) -> None:
        self.ready = ready


class GroupCommitter(Generic[T, R]):
    """Runs ``handler`` on batches of submitted items, on one thread, in arrival order.

    ``handler(batch)`` returns one entry per item, in order: the item's result, the
    exception to raise in its submitter, or :class:`Later`. An exception raised by the handler
    itself fails the whole batch. ``weight(item)`` bounds a batch by size as well as by count
    (``max_weight``); an item heavier than the bound goes alone.
    """

    def __init__(
        self,
        handler: Callable[[Sequence[T]], Sequence[R | BaseException | Later]],
        key: Callable[[T], str],
        name: str = "group-commit",
        max_batch: int = MAX_BATCH,
        weight: Callable[[T], int] = lambda item: 0,
        max_weight: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._handler = handler
        self._key = key
        self._weight = weight
        self._max_weight = max_weight
        self._max_batch = max_batch
        self._pending: deque[tuple[T, Future[R]]] = deque()
        #: Keys with a write waiting off the queue for its key (Later).
        self._later: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        #: Batches committed and the writes in them, since start (read by the metrics).
        self.batches = 0
        self.writes = 0
        #: The most writes one batch has held.
        self.largest = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> R:
        """Commit ``item`` with whatever else is waiting; block until its batch is done."""
        return self.submit_async(item).result()

    def submit_async(self, item: T) -> Future[R]:
        future: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise Unavailable("this master is stopping; retry (the client finds another)")
            self._pending.append((item, future))
            self._cond.notify()
        return future

    def close(self, timeout: float | None = None) -> None:
        """Commit what is queued, then stop; later submissions fail with UNAVAILABLE."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _take(self) -> list[tuple[T, Future[R]]]:
        """The next batch (empty once closed and drained): oldest first, one item per key, at
        most ``max_batch`` items and ``max_weight`` of weight. Items left out keep their place
        at the head of the queue."""
        with self._cond:
            while not self._takeable() and not self._closed:
                self._cond.wait()
            batch: list[tuple[T, Future[R]]] = []
            skipped: list[tuple[T, Future[R]]] = []
            keys: set[str] = set()
            weight = 0
            while self._pending and len(batch) < self._max_batch:
                item, future = self._pending.popleft()
                k, w = self._key(item), self._weight(item)
                if k in keys or k in self._later:
                    # A second write to a key waits its turn, as do writes behind one that
                    # waits for its key (Later): a key's writes keep their order.
                    skipped.append((item, future))
                    continue
                if batch and self._max_weight and weight + w > self._max_weight:
                    self._pending.appendleft((item, future))
                    break
                batch.append((item, future))
                keys.add(k)
                weight += w
            self._pending.extendleft(reversed(skipped))
            return batch

    def _takeable(self) -> bool:
        return any(self._key(item) not in self._later for item, _ in self._pending)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                with self._cond:  # closed: what waits behind a Later is not committed
                    stranded, self._pending = list(self._pending), deque()
                for _, future in stranded:
                    future.set_exception(
                        Unavailable("this master is stopping; retry (the client finds another)"))
                return
            items = [item for item, _ in batch]
            self.batches += 1
            self.writes += len(items)
            self.largest = max(self.largest, len(items))
            try:
                results: Sequence[R | BaseException | Later] = self._handler(items)
                if len(results) != len(items):
                    raise RuntimeError(f"group commit handler gave {len(results)} results for"
                                       f" {len(items)} items")
            except Exception as e:  # the thread must outlive any one batch
                log.exception("group commit of %d write(s) failed", len(items))
                results = [e] * len(items)
            for (item, future), result in zip(batch, results, strict=True):
                if isinstance(result, Later):
                    with self._cond:
                        self._later.add(self._key(item))
                    threading.Thread(target=self._again_when_ready, args=(item, future, result),
                                     name=f"{self._thread.name}-later", daemon=True).start()
                elif isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _again_when_ready(self, item: T, future: Future[R], later: Later) -> None:
        failure: BaseException | None = None
        try:
            later.ready()
        except BaseException as e:
            failure = e
        with self._cond:
            self._later.discard(self._key(item))
            if failure is None and self._closed:
                failure = Unavailable("this master is stopping; retry (the client finds another)")
            if failure is None:
                self._pending.appendleft((item, future))
            self._cond.notify()  # the key's later writes may go now
        if failure is not None:
            future.set_exception(failure)
