"""Replication waits: until keys have enough up-to-date holders, woken by ZooKeeper watches
(ha-rule 11: every wait is bounded and re-checks leadership)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import replace

from kazoo.client import KazooClient
from kazoo.exceptions import (
    NoNodeError,
)
from kazoo.protocol.states import WatchedEvent

from blobha.core import acl as acls
from blobha.core.blobstate import BlobState
from blobha.core.errors import (
    InvalidArgument,
    KeyNotFound,
    Unavailable,
)
from blobha.core.keys import validate_key
from blobha.leader import LeaderElection
from blobha.master.metadata import Metadata
from blobha.master.rules import (
    Authority,
    Superseded,
    no_such_key,
    replication_status,
)
from blobha.wire.status import ReplicationStatus
from blobha.zk import layout
from blobha.zk.layout import key_path

log = logging.getLogger("blobha.master")


#: Keys whose reads a replication wait has in flight at once (two reads per key).
_WAIT_READ_BATCH = 256
#: What a write waiting for its quorum is told when its leader stops: the version stays
#: committed, and the next leader acknowledges it (or rolls it back, and the retry writes it).
STEPPING_DOWN = ("the leader is stepping down (its master is stopping) before the write quorum;"
                 " retry with the next leader")


class ReplicationWaits:
    """The replication waits in progress on one master, all woken by one watch callback."""

    def __init__(self, zk: KazooClient, election: LeaderElection, meta: Metadata,
                 authority: Authority, stopped: threading.Event,
                 holding: Callable[[], AbstractSet[str]] | None = None) -> None:
        self.zk = zk
        #: The masters whose replica nodes count (Membership.holding); None: every node.
        self._holding = holding
        self.election = election
        self.meta = meta
        self.authority = authority
        self._stopped = stopped
        # The waits in progress, per key path, woken by one watch callback (_wake_waiters) for
        # all of them. kazoo keeps a one-shot callback until its node changes, so a callback
        # of each wait's own piled up on a key that never changes: every job launch waits on
        # the same stable keys, and each left two callbacks per key.
        self._waiters: dict[str, set[threading.Event]] = {}
        self._waiters_lock = threading.Lock()

    def wait_for_replication(self, user: str, keys: list[str], minimum: int, timeout: float,
                             abandoned: threading.Event | None = None,
                             ) -> tuple[bool, list[ReplicationStatus], float]:
        """Wait until every key has ``minimum`` up-to-date holders or ``timeout`` passes
        (negative: no limit); ``abandoned``, once set (the caller went away), ends the wait
        within a second, so that no thread is held for a caller that will never read the
        answer."""
        if not keys:
            raise InvalidArgument("name at least one key to wait for")
        if minimum < 1:
            raise InvalidArgument("the minimum replication must be at least 1")
        if math.isnan(timeout):
            raise InvalidArgument("the timeout must be a number of seconds (negative: forever)")
        for key in keys:
            validate_key(key)

        def may_read(key: str, state: BlobState | None) -> None:
            if state is None:
                raise no_such_key(key)
            self.authority.require(user, state.acl, acls.READ, key)

        started = time.monotonic()
        deadline = float("inf") if timeout < 0 else started + timeout
        reached, infos = self.wait(keys, minimum, deadline, first_read=may_read,
                                    abandoned=abandoned)
        return reached, infos, time.monotonic() - started

    def wait(
        self, keys: list[str], minimum: int, deadline: float,
        seq_of: dict[str, int] | None = None, require_leader: bool = False,
        first_read: Callable[[str, BlobState | None], None] | None = None,
        abandoned: threading.Event | None = None,
    ) -> tuple[bool, list[ReplicationStatus]]:
        """Wait on ZooKeeper watches until every key has ``minimum`` holders of its committed
        version (or of ``seq_of[key]``), or the deadline passes (ha-rule 11), or ``abandoned``
        is set. ``first_read`` sees each key's state as first read (None: no such key), before
        anything is returned, and may raise."""
        changed = threading.Event()
        paths = {key_path(key) for key in keys}
        with self._waiters_lock:
            for path in paths:
                self._waiters.setdefault(path, set()).add(changed)
        try:
            return self._wait_on(keys, minimum, deadline, changed, seq_of, require_leader,
                                 first_read, abandoned)
        finally:
            with self._waiters_lock:
                for path in paths:
                    waiting = self._waiters.get(path)
                    if waiting is not None:
                        waiting.discard(changed)
                        if not waiting:
                            del self._waiters[path]

    def _wake_waiters(self, event: WatchedEvent) -> None:
        """The one watch callback of every replication wait (kazoo's thread: no blocking)."""
        if event.path is None:
            # A session event: kazoo dropped every watch, so every wait must read again.
            self.stop_waits()
            return
        with self._waiters_lock:
            woken = list(self._waiters.get(event.path, ()))
        for changed in woken:
            changed.set()

    def stop_waits(self) -> None:
        """Wake every wait, to read again: a leader stopping (which has 2 s to answer), or a
        session event."""
        with self._waiters_lock:
            woken = [e for waiting in self._waiters.values() for e in waiting]
        for changed in woken:
            changed.set()

    def replication_waits(self) -> int:
        """Replication waits in progress (for the metrics)."""
        with self._waiters_lock:
            return len({id(e) for waiting in self._waiters.values() for e in waiting})

    def _wait_on(
        self, keys: list[str], minimum: int, deadline: float, changed: threading.Event,
        seq_of: dict[str, int] | None, require_leader: bool,
        first_read: Callable[[str, BlobState | None], None] | None,
        abandoned: threading.Event | None,
    ) -> tuple[bool, list[ReplicationStatus]]:
        # One bound method for every read: kazoo keeps a set of callbacks per path, so the
        # same callback armed by many waits, or by many passes of one, is held once.
        watch = self._wake_waiters
        answer = self.meta.answer_write if require_leader else self.meta.answer
        first = True
        while True:
            changed.clear()
            self.meta.require_zk()
            # Every key's state and replica list, both watched, one round trip per batch of
            # keys, not several per key one after the other (a job's pre-launch check names
            # many blobs). Batches bound what one call puts on the master's session.
            infos = []
            for start in range(0, len(keys), _WAIT_READ_BATCH):
                pending = [(key, self.zk.get_async(key_path(key), watch=watch),
                            self.zk.get_children_async(key_path(key), watch=watch))
                           for key in keys[start:start + _WAIT_READ_BATCH]]
                for key, state_read, names_read in pending:
                    try:
                        # Bounded: a read queued while kazoo reconnects waits for the
                        # connection otherwise; a write's within the watchdog's bound.
                        data, stat = answer(state_read)
                        state: BlobState | None = BlobState.decode(data, stat.version)
                    except NoNodeError:
                        state = None
                    if first and first_read is not None:
                        first_read(key, state)
                    if state is None:
                        raise KeyNotFound(
                            f"{key!r} was deleted while waiting for its replication")
                    if seq_of is not None and state.seq != seq_of[key]:
                        if state.seq > seq_of[key] and state.acked:
                            # No master fetches a superseded version: waiting for it is vain.
                            # (Until the newer one is acknowledged, a roll-back could still
                            # skip past both: wait for that.)
                            raise Superseded(state)
                        state = replace(state, seq=seq_of[key])
                    try:
                        names = answer(names_read)
                    except NoNodeError:
                        names = []
                    infos.append(replication_status(
                        key, state, layout.holders(names, state.seq),
                        holding=None if self._holding is None else self._holding()))
            first = False
            if all(i.replication >= minimum for i in infos):
                return True, infos
            # Before the deadline: a wait cut short by a stop or a lost leadership did not
            # time out, and "not reached" would read as a final answer (issue 44).
            if self._stopped.is_set():
                raise Unavailable(STEPPING_DOWN if require_leader else
                                  "this master is stopping; retry with another master")
            if require_leader and not self.election.is_leader:
                raise Unavailable("leadership was lost while waiting for the write quorum; retry"
                                  " with the next leader")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (abandoned is not None and abandoned.is_set()):
                return False, infos
            # Watches wake us (and stop_waits); the cap bounds how stale the leadership
            # check can be.
            changed.wait(min(remaining, 1.0))
