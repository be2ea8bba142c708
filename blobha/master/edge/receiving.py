"""Receiving a call's request message under a time limit of the server's own, and caps on what
one connection or host may hold at once, for the gatekeeper (:mod:`blobha.master.edge.gatekeeper`).

gRPC gives a call its pool thread when its headers arrive, and core has no time limit for the
message that should follow: a call whose message never comes, without a deadline, holds the
thread for good. The gatekeeper serves every method as one with a stream of requests, so the
handler runs at once, decides from the headers alone whether the caller may be served, and only
then reads the message, here, cancelling the call if it has not come in time.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from blobha.core.errors import DeadlineExceeded, InvalidArgument


class _Watch:
    __slots__ = ("cancel", "fired", "live")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel
        self.fired = False
        self.live = True


class CancelTimer:
    """Runs a call's cancel when its time is up: one thread for every call waiting, not a timer
    thread each (which would be what an attacker's calls cost)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Watch]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, seconds: float, cancel: Callable[[], None]) -> _Watch:
        w = _Watch(cancel)
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), w))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="receive-timer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return w

    def done(self, w: _Watch) -> bool:
        """Stop watching ``w``; True if its cancel had run (the time was up)."""
        with self._cond:
            w.live = False
            return w.fired

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and not self._heap[0][2].live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, w = self._heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                w.fired = True
            # A call that ended meanwhile has nothing to cancel.
            with contextlib.suppress(Exception):
                w.cancel()


def receive_one(requests: Iterator[Any], context: grpc.ServicerContext, timer: CancelTimer,
                seconds: float, method: str) -> Any:
    """The one request message of a call to ``method`` (served as a stream of requests), read
    within ``seconds``; raises :class:`DeadlineExceeded` when it has not come by then (the
    call is cancelled, which frees the thread waiting for it) and :class:`InvalidArgument`
    when the caller sent none."""
    w = timer.watch(seconds, context.cancel)
    try:
        return next(requests)
    except StopIteration:
        raise InvalidArgument(f"{method} takes exactly one request message; none came") from None
    except grpc.RpcError:
        if timer.done(w):
            raise DeadlineExceeded(
                f"the request message of {method} did not arrive within {seconds:g} s of its"
                " headers (master.request.receive.secs)") from None
        raise  # the caller went away: nobody to answer
    finally:
        timer.done(w)
