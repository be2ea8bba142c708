"""Retrying until a deadline: backoff, the restartable deadline, and what giving up says."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import NoReturn

from blobha.core.errors import (
    BlobError,
    Busy,
    DeadlineExceeded,
    NotLeader,
    Refused,
    Unavailable,
)

BACKOFF_BASE = 0.05
# Low on purpose: during a failover every retry is a cheap probe, and a long sleep would leave
# the client idle after the new leader is ready (with full jitter the mean wait is cap / 2).
BACKOFF_CAP = 0.5


def backoff_delay(
    attempt: int,
    base: float = BACKOFF_BASE,
    cap: float = BACKOFF_CAP,
    rand: Callable[[], float] = random.random,
) -> float:
    """Full-jitter exponential backoff: uniform in ``[0, min(cap, base * 2**attempt))``.

    Full jitter spreads the retries of many clients that failed together (a leader failover)
    instead of having them hit the new leader in waves.
    """
    ceiling = min(cap, base * 2.0 ** min(max(attempt, 0), 32))
    return float(rand()) * ceiling


#: The clock deadlines read; a module attribute so tests can drive time without sleeping.
_monotonic: Callable[[], float] = time.monotonic


def now() -> float:
    """The time deadlines read: :data:`_monotonic`, looked up on each call."""
    return _monotonic()


class Deadline:
    """A point in time, restartable: transfers restart it whenever they make progress."""

    def __init__(self, seconds: float, clock: Callable[[], float] | None = None) -> None:
        self.seconds = seconds
        self._clock = clock if clock is not None else _monotonic
        self._end = self._clock() + seconds
        #: Whether Client.on_retry has heard of this call's retries (once per call).
        self.noticed = False

    def remaining(self) -> float:
        return max(0.0, self._end - self._clock())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def restart(self) -> None:
        self._end = self._clock() + self.seconds


class Mismatches:
    """A run of failed TLS handshakes within one call: since when, and with which masters."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.addresses: set[str] = set()

    def clear(self) -> None:
        self.since = None
        self.addresses.clear()


def may_have_run(exc: Unavailable) -> bool:
    """Whether a call that failed with ``exc`` may have run on the master (its answer lost),
    as opposed to refused unsent (no connection) or refused unrun (the master too busy, not
    the leader yet, or without ZooKeeper)."""
    return not isinstance(exc, Busy | Refused) and not any(
        s in str(exc) for s in ("failed to connect", "Connection refused"))


def gave_up(last: BlobError, what: str, seconds: float) -> BlobError:
    message = f"could not {what} within {seconds:g} s: {last}"
    if isinstance(last, NotLeader):
        return Unavailable(message)
    return type(last)(message)


def cut_short(exc: DeadlineExceeded, last: BlobError | None, what: str, deadline: Deadline
              ) -> NoReturn:
    """Raise ``exc``, unless a retry ran into the end of the deadline: then why it was
    retrying (``last``: "ZooKeeper is unreachable") is the news, not that its last try
    was cut short."""
    if last is None or not deadline.expired():
        raise exc
    raise gave_up(last, what, deadline.seconds) from None
