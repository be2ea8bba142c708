"""Ending gRPC calls to a master that has gone quiet.

A paused or cut-off master accepts a call and then never answers: its TCP connection stays
open, so only the call's whole deadline would end the call. Clients (downloads) and masters
(sync fetches from each other) watch their streams with a :class:`StallWatch` and move on to
another replica instead. A client's calls with one answer (a write, a replication wait) are
watched by a :class:`CallWatch`, which asks the master whether it is still there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["TERM_CHECK_SECS", "CallWatch", "Pending", "StallWatch", "Stalled", "Watched"]

log = logging.getLogger("blobha.stallwatch")


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


class _Watcher:
    """What both watches share: a condition, and one thread that starts on first use and ends
    with :meth:`close`."""

    _THREAD_NAME = "blobha-watch"

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def _start(self) -> None:
        """Start the thread unless it runs or the watch is closed (the condition held)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name=self._THREAD_NAME,
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        raise NotImplementedError


class StallWatch(_Watcher):
    """Cancels the streams it watches that receive nothing for their limit. One thread serves
    every stream (a thread per stream would cost more than a small read does); it sleeps until
    the earliest stall deadline and is started on first use."""

    _THREAD_NAME = "blobha-stall-watch"

    def __init__(self) -> None:
        super().__init__()
        self._watched: set[Watched] = set()
        #: When the thread will look next (None: not before it is woken).
        self._wake_at: float | None = None

    def watch(self, call: Any, limit: float, tag: str = "") -> Watched:
        """Watch ``call`` (anything with ``cancel()``); ``tag`` names it for :meth:`cancel`."""
        w = Watched(call, limit, tag)
        with self._cond:
            self._watched.add(w)
            self._start()
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


#: A call to the leader is looked at after this long without an answer (see CallWatch).
TERM_CHECK_SECS = 1.0


class Pending:
    """One blocking call under a :class:`CallWatch`."""

    __slots__ = ("address", "every", "fired", "half", "rivals", "since", "wait")

    def __init__(self, address: str, half: float, rivals: tuple[str, ...] = ()) -> None:
        self.address = address
        self.half = half
        #: For a call to the leader, the other masters, which may have elected a new one.
        self.rivals = rivals
        #: How long the call waits between looks at its master.
        self.every = min(half, TERM_CHECK_SECS) if rivals else half
        #: How long a look waits for the master's status: looked at early, a silent leader
        #: with no successor is still given the whole stall limit (twice ``half``).
        self.wait = 2 * half - self.every
        #: Since when the call has waited without its master showing a sign of life.
        self.since = time.monotonic()
        #: Set when the watch found the master silent and ended the call (its channel closed).
        self.fired = False


class CallWatch(_Watcher):
    """Watches blocking calls, which cost nothing extra while they end in time.

    A call made with a future gets its answer through the channel's own thread, which then wakes
    the caller: one more thread wake-up per call, which made a small create cost the client
    much more CPU than a blocking call (the caller waits in gRPC's core itself). A blocking
    call has no handle to cancel, though. So calls are only noted
    (:meth:`begin`, :meth:`end`): one thread looks at them every quarter of the shortest half
    limit while any are made, and sleeps otherwise. For a call that has waited half its limit it
    runs ``check(address, half, rivals)`` on a thread of its own (a status call; True if the
    master answered). A master that answers is waited for another half; one that does not has
    every call to it marked as fired and then ended by ``cut(address)``, which closes its
    channel.

    A call to the leader names its ``rivals``, the other masters: it is looked at after
    :data:`TERM_CHECK_SECS` already, and the check may also ask the rivals whether one of them
    leads now, which ends the calls to a silent leader as soon as its successor is elected
    instead of after the stall limit. A leader that answers in time costs nothing extra.
    """

    _THREAD_NAME = "blobha-call-watch"

    def __init__(self, check: Callable[[str, float, tuple[str, ...]], bool],
                 cut: Callable[[str], None]) -> None:
        super().__init__()
        self._check = check
        self._cut = cut
        self._calls: set[Pending] = set()
        #: Addresses being checked now (one check each at a time).
        self._checking: set[str] = set()
        self._tick = float("inf")
        #: A call began since the thread last looked: it looks again a tick later.
        self._began = False
        #: The thread sleeps until woken (no call was made for a whole tick).
        self._idle = False

    def begin(self, address: str, half: float, rivals: tuple[str, ...] = ()) -> Pending:
        """Note a call to ``address`` about to be made; :meth:`end` it when it returns.
        ``rivals``: for a call to the leader, the other masters (see the class)."""
        p = Pending(address, half, rivals)
        with self._cond:
            self._calls.add(p)
            self._began = True
            # Only the first call after a quiet tick (or with a shorter limit) wakes the
            # thread: a stream of calls must not cost it a turn each.
            wake = self._idle or p.every / 4 < self._tick
            self._tick = min(self._tick, p.every / 4)
            self._start()
            if wake:
                self._cond.notify()
        return p

    def end(self, p: Pending) -> None:
        with self._cond:
            self._calls.discard(p)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due: dict[str, tuple[float, tuple[str, ...]]] = {}
                for p in self._calls:
                    if (not p.fired and p.since + p.every <= now
                            and p.address not in self._checking):
                        wait, rivals = due.get(p.address, (0.0, ()))
                        due[p.address] = (max(wait, p.wait),
                                          rivals + tuple(r for r in p.rivals if r not in rivals))
                self._checking.update(due)
                if not due:
                    busy = bool(self._calls) or self._began
                    self._began = False
                    self._idle = not busy
                    self._cond.wait(self._tick if busy else None)
                    self._idle = False
                    continue
            for address, (wait, rivals) in due.items():
                threading.Thread(target=self._verdict, args=(address, wait, rivals),
                                 name="blobha-call-check", daemon=True).start()

    def _verdict(self, address: str, wait: float, rivals: tuple[str, ...]) -> None:
        try:
            alive = self._check(address, wait, rivals)
        except Exception:
            # No verdict (the client is closing, say): the calls go on, and are looked at
            # again after another half.
            log.debug("checking master %s failed", address, exc_info=True)
            alive = True
        now = time.monotonic()
        with self._cond:
            self._checking.discard(address)
            mine = [p for p in self._calls if p.address == address and not p.fired]
            for p in mine:
                if alive:
                    p.since = now
                else:
                    p.fired = True
        if not alive and mine:
            try:
                self._cut(address)
            except Exception:
                log.exception("ending the calls to master %s failed", address)
