"""Cancelling gRPC streams that receive nothing for too long.

A paused or cut-off master accepts a call and then never answers: its TCP connection stays
open, so only the call's whole deadline would end the call. Clients (downloads) and masters
(sync fetches from each other) watch their streams with a :class:`StallWatch` and move on to
another replica instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["StallWatch", "Stalled", "Watched"]

log = logging.getLogger(__name__)


class Stalled(Exception):
    """A watched stream was cancelled: it received nothing for its limit (empty message), or
    :meth:`StallWatch.cancel` ended it (its reason)."""


class Watched:
    """One stream under a :class:`StallWatch`."""

    __slots__ = ("call", "fired", "held", "last", "limit", "reason", "tag")

    def __init__(self, call: Any, limit: float, tag: str = "") -> None:
        self.call = call
        self.limit = limit
        self.tag = tag
        self.last = time.monotonic()
        #: True while the consumer works on a message: the master is not being waited for.
        self.held = False
        self.fired = False
        #: Why the stream was cancelled, when not for silence (see :meth:`StallWatch.cancel`).
        self.reason = ""

    def hold(self) -> None:
        self.held = True

    def wait_again(self) -> None:
        self.last = time.monotonic()  # before clearing held: the watch never sees a stale time
        self.held = False

    def due(self, now: float) -> float:
        """When this stream counts as stalled (held: not before a full limit from now)."""
        return now + self.limit if self.held else self.last + self.limit


class StallWatch:
    """Cancels the streams it watches that receive nothing for their limit. One thread serves
    every stream (a thread per stream would cost more than a small read does); it sleeps until
    the earliest stall deadline and is started on first use."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: set[Watched] = set()
        self._thread: threading.Thread | None = None
        #: When the thread will look next (None: not before it is woken).
        self._wake_at: float | None = None
        self._closed = False

    def watch(self, call: Any, limit: float, tag: str = "") -> Watched:
        """Watch ``call`` (anything with ``cancel()``); ``tag`` names it for :meth:`cancel`."""
        w = Watched(call, limit, tag)
        with self._cond:
            self._watched.add(w)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="blobha-stall-watch",
                                                daemon=True)
                self._thread.start()
            if self._wake_at is None or w.last + limit < self._wake_at:
                # Woken only when it would look too late: a small read must not cost the
                # thread a turn.
                self._cond.notify()
        return w

    def messages(self, call: Any, limit: float, tag: str = "") -> Iterator[Any]:
        """The messages of the server stream ``call``, watched; raises :class:`Stalled` when
        the watch cancelled it, saying why (``tag`` names the sender). The time the consumer
        spends on a message does not count, and the call is cancelled when the consumer stops
        early."""
        w = self.watch(call, limit, tag)
        try:
            for message in call:
                w.hold()  # a slow consumer (a busy disk) is not a stalled master
                yield message
                w.wait_again()
        except Exception:
            if w.fired:
                raise Stalled(w.reason or f"{tag or 'the master'} sent nothing for {limit:g} s"
                              " (paused, overloaded or cut off)") from None
            raise
        finally:
            self.unwatch(w)
            call.cancel()  # a no-op once it has ended

    def unwatch(self, w: Watched) -> None:
        with self._cond:
            self._watched.discard(w)

    def cancel(self, tag: str, reason: str) -> int:
        """Cancel every stream watched under ``tag`` now (its master is known to be gone),
        giving ``reason``; how many there were."""
        with self._cond:
            hit = [w for w in self._watched if w.tag == tag]
            for w in hit:
                self._watched.discard(w)
                w.reason = reason
                w.fired = True
        self._cancel(hit)
        return len(hit)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [w for w in self._watched if w.due(now) <= now]
                if not due:
                    # Waiting again only moves a deadline later, and a held stream is looked
                    # at once per limit, so waking at the earliest deadline as it stands never
                    # misses a stall.
                    wake = min((w.due(now) for w in self._watched), default=None)
                    self._wake_at = wake
                    self._cond.wait(None if wake is None else wake - now)
                    self._wake_at = None
                    continue
                for w in due:
                    self._watched.discard(w)
                    w.fired = True
            self._cancel(due)

    @staticmethod
    def _cancel(calls: list[Watched]) -> None:
        for w in calls:
            # Outside the lock: gRPC may run callbacks inline. A failure must not end the
            # thread, which watches every other stream too.
            try:
                w.call.cancel()
            except Exception:
                log.debug("cancelling a stream failed", exc_info=True)
