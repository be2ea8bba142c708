"""The loop: worker threads over the queue, the periodic reconcile, retries with backoff.

A periodic full reconcile (Storm's only mechanism, here a safety net, paced) catches anything
missed, and runs at once after every new ZooKeeper session, re-registering this master's replica
nodes (ha-rule 6). When masters come and go, only what moves is looked at: the departed master's
replica nodes (gone with its session: events, or a read of each list it was on without the
recursive watch), and the keys whose placement changes. One failing key is logged and retried
with backoff; the loop itself never stops.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from typing import TYPE_CHECKING, Protocol

from kazoo.client import KazooState
from kazoo.exceptions import KazooException

from blobha.core.errors import BlobError
from blobha.sync.feed import Wake, describe
from blobha.sync.membership import IdentityInUse
from blobha.sync.registry import SyncDeferred
from blobha.sync.verify import CheckInterrupted
from blobha.sync.view import ReplicaView
from blobha.sync.workqueue import WorkQueue
from blobha.zk.connection import UNREACHABLE

if TYPE_CHECKING:
    from blobha.sync.membership import Membership
    from blobha.sync.settings import SyncSettings

log = logging.getLogger("blobha.sync.synchronizer")


class Intake(Protocol):
    """What the loop asks of the change feed (blobha.sync.feed.ChangeFeed)."""

    @property
    def recursive(self) -> bool: ...
    def watch_tree(self) -> None: ...
    def all_keys(self) -> list[str]: ...
    def recheck_replicas(self, keys: list[str]) -> None: ...
    def check_own_nodes(self, stopping: threading.Event) -> tuple[int, int]: ...


#: How long after taking office a leader starts its paced pass over every key.
LEADER_PASS_DELAY = 5.0


class BatchHandler(Protocol):
    """What the loop asks of the executor (blobha.sync.apply.Executor)."""

    def handle(self, keys: list[str]) -> dict[str, Exception]: ...


class Connection(Protocol):
    """What the loop asks of the ZooKeeper client: its state and session."""

    @property
    def state(self) -> str: ...
    @property
    def client_id(self) -> tuple[int, bytes] | None: ...


class SyncLoop:
    """The threads: ``threads`` workers taking batches from the queue, and one periodic thread
    (new sessions, membership changes, the paced safety-net pass)."""

    def __init__(self, zk: Connection, membership: Membership, settings: SyncSettings,
                 queue: WorkQueue, view: ReplicaView, feed: Intake, executor: BatchHandler,
                 wake: Wake, session: int | None = None) -> None:
        self.zk = zk
        self.membership = membership
        self.settings = settings
        self.queue = queue
        self.view = view
        self.feed = feed
        self.executor = executor
        self.wake = wake
        #: The ZooKeeper session this master registered in (None: not yet).
        self.session = session
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failures: dict[str, int] = {}
        # Keys whose sync failed on an unreachable ZooKeeper since the last report of it, and
        # when that report was (see _report_unreachable).
        self._unreachable = 0
        self.unreachable_reported = -math.inf
        self._unreachable_lock = threading.Lock()

    def start(self) -> None:
        for i in range(self.settings.threads):
            t = threading.Thread(target=self.work, name=f"sync-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self.periodic, name="sync-periodic", daemon=True)
        t.start()
        self._threads.append(t)
        self.wake.kick()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.kick()
        self.queue.close()
        for t in self._threads:
            t.join(timeout=5)

    def reconcile_all(self) -> None:
        """Queue every key known to ZooKeeper or held locally (and re-arm the journal watch)."""
        self.queue.put_many(self.feed.all_keys())

    def _session_id(self) -> int:
        return self.zk.client_id[0] if self.zk.client_id else 0

    # ---- the periodic thread ---------------------------------------------------------------

    def periodic(self) -> None:
        next_full = 0.0
        paced: list[str] = []  # keys of the periodic pass still to hand to the workers
        recheck: list[str] = []  # keys whose replica list to read again, after departures
        placed: frozenset[str] = frozenset()  # the masters placement last acted on (the first
        # pass is a full reconcile, which sets it)
        pace_step = self.settings.pace_step
        wake = self.wake
        while not self.stopping.is_set():
            grace = self.membership.next_grace_expiry()
            # Capped at a period: next_full is infinite while a paced pass is handed out, and
            # a failure can leave it so (Event.wait(inf) overflows and would end the thread).
            wait = max(0.0, min(next_full - time.monotonic(), self.settings.period_secs))
            if grace is not None:
                wait = min(wait, grace + 0.05)
            if paced or recheck:
                wait = min(wait, pace_step)
            wake.event.wait(timeout=wait)
            wake.event.clear()
            if self.stopping.is_set():
                return
            try:
                if self.zk.state != KazooState.CONNECTED:
                    continue
                session = self._session_id() or None
                full = wake.full_requested
                if session != self.session:
                    # ha-rule 6: a new session lost our ephemeral nodes; put them back, and
                    # check our persistent replica nodes before they count again.
                    log.info("new ZooKeeper session %s: re-registering and reconciling", session)
                    self.membership.register()
                    started = time.monotonic()
                    keys, removed = self.feed.check_own_nodes(self.stopping)
                    self.view.checked_session = session or 0
                    self.membership.hold()
                    log.info("checked this master's replica nodes of %d keys in %.1f s (%d"
                             " removed): they count again", keys,
                             time.monotonic() - started, removed)
                    # Every entry's `registered` names the old session, so each replica node
                    # is verified (and re-created if need be) again.
                    self.session = session
                    full = True
                else:
                    self.membership.refresh()
                known = frozenset(self.membership.known())
                departed = self.membership.take_departed()
                if full:
                    # All at once: after a new session or a reconnect, or for a new leader,
                    # every key matters now.
                    # Cleared first: a reconnect from here on (even while the watch is being
                    # added, on a connection that then drops) asks for another full pass, which
                    # adds the watch on the new connection.
                    wake.full_requested = False
                    wake.leader_pass_requested = False  # the full pass covers it
                    if self.feed.recursive:
                        try:
                            self.feed.watch_tree()
                        except Exception:
                            wake.full_requested = True  # tried again after the pause below
                            raise
                    paced, recheck = [], []
                    placed = known
                    try:
                        self.reconcile_all()
                    except Exception:
                        # Still owed (a new session's replica nodes are re-created by it):
                        # tried again after the pause below, not a whole period later.
                        wake.full_requested = True
                        raise
                    finally:
                        next_full = time.monotonic() + self.settings.period_secs
                else:
                    recheck = self.follow_membership(placed, known, departed) + recheck
                    placed = known
                    if wake.leader_pass_requested:
                        wake.leader_pass_requested = False
                        # From the view alone: a listing of every key (ZooKeeper's and the
                        # disk's, 300,000 names) took a new leader's CPU and connection for a
                        # second, while its first writes waited. The paced pass over every key
                        # starts a moment later instead.
                        self.queue.put_many(self.view.tally.unsettled())
                        paced = []
                        next_full = time.monotonic() + LEADER_PASS_DELAY
                    if not paced and time.monotonic() >= next_full:
                        # The safety net only: fed at a bounded rate, so at 100,000s of keys it
                        # neither takes a core nor queues every key ahead of the changes events
                        # bring (a new version would otherwise wait behind the whole pass).
                        paced = self.feed.all_keys()
                        paced.reverse()  # handed out from the end: in key order
                        next_full = math.inf  # until the pass is handed out, below
                if paced:
                    step = max(1, int(self.settings.periodic_keys_per_sec * pace_step))
                    self.queue.put_many(paced[:-step - 1:-1])
                    del paced[-step:]
                if not paced and next_full == math.inf:
                    # The pass is handed out, or found no key at all: the next one is a period
                    # away (left at infinity, the wait above would overflow and end the thread).
                    next_full = time.monotonic() + self.settings.period_secs
                if recheck:
                    step = int(self.settings.recheck_keys_per_sec * pace_step)
                    self.feed.recheck_replicas(recheck[-step:])
                    del recheck[-step:]
            except CheckInterrupted:
                return  # stopping
            except IdentityInUse as e:
                # Our session was lost and another master took our name meanwhile: nothing
                # here is registered until it goes.
                log.error("cannot register again: %s", e)
                self.stopping.wait(5.0)
                wake.kick()
            except Exception:
                log.exception("periodic reconcile failed; retrying shortly")
                self.stopping.wait(1.0)
                wake.kick()

    def follow_membership(self, placed: frozenset[str], known: frozenset[str],
                          departed: set[str]) -> list[str]:
        """Act on masters coming and going; the keys whose replica lists to read again."""
        if known != placed:
            # A master joined, or one gone for longer than the grace: reconcile at once only
            # the keys this master is now to hold or to give up.
            moved = self.view.tally.placement_moved(placed, known)
            log.info("masters now %s (were %s): %d keys move here or away", sorted(known),
                     sorted(placed), len(moved))
            self.queue.put_many(moved)
        # Departed masters' replica nodes stay (persistent) and stop counting with their
        # /holders nodes, with nothing to read. A returning master checks its nodes before
        # they count again, and removes the ones it lacks: the recursive watch brings each
        # removal, and without it the lists of the keys it held are read again (paced).
        return self.view.tally.held_by(departed) if departed and not self.feed.recursive else []

    # ---- the workers -----------------------------------------------------------------------

    def work(self) -> None:
        while True:
            keys = self.queue.get_batch(self.settings.batch)
            if not keys:
                return
            try:
                failures = self.executor.handle(keys)
            except Exception as e:  # a bug in the batch logic must not kill the loop
                log.exception("sync batch failed")
                failures = dict.fromkeys(keys, e)
            self.after_batch(keys, failures)
            self.queue.done_many(keys)

    def after_batch(self, keys: list[str], failures: dict[str, Exception]) -> None:
        """Retry the keys that failed, with backoff; warn of each failure, except those of an
        unreachable ZooKeeper, which are counted into one warning now and then."""
        unreachable: list[Exception] = []
        for key in keys:
            error = failures.get(key)
            if error is None:
                self.failures.pop(key, None)
            elif isinstance(error, SyncDeferred):
                log.debug("sync of %r deferred: %s", key, error)
                self._retry_later(key, quiet=True)
            elif isinstance(error, UNREACHABLE):  # no fault of the key's
                unreachable.append(error)
                self._retry_later(key, quiet=True)
            else:
                self._retry_later(key, error=error)
        if unreachable:
            self._report_unreachable(len(unreachable), unreachable[-1])

    def _report_unreachable(self, count: int, error: Exception) -> None:
        now = time.monotonic()
        with self._unreachable_lock:
            self._unreachable += count
            if now - self.unreachable_reported < self.settings.unreachable_report_secs:
                return
            count, self._unreachable, self.unreachable_reported = self._unreachable, 0, now
        log.warning("sync of %d key(s) could not reach ZooKeeper (%s); each is retried with"
                    " backoff, and the reconnect reconciles every key", count,
                    describe(error))

    def _retry_later(self, key: str, error: Exception | None = None, quiet: bool = False) -> None:
        n = self.failures[key] = self.failures.get(key, 0) + 1
        delay = min(30.0, 0.2 * 2 ** min(n, 8)) * random.uniform(0.5, 1.0)
        if error is not None and not quiet:
            if isinstance(error, BlobError | KazooException):
                log.warning("sync of %r failed (%s); retry %d in %.1fs", key, describe(error),
                            n, delay)
            else:
                log.exception("sync of %r failed; retry %d in %.1fs", key, n, delay,
                              exc_info=error)
        if not self.stopping.is_set():
            self.queue.put(key, delay=delay)


__all__ = ["BatchHandler", "Connection", "Intake", "SyncLoop"]
