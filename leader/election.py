"""Leader election with a fencing epoch (ha-rules 1-5).

Each master holds an ephemeral-sequential candidacy under ``/election``; the lowest is leader.
On winning, the leader bumps ``/epoch`` in one transaction with ``check(own candidacy)``: the
epoch is its fencing token. Every leader write then goes through :meth:`fenced`, which prefixes
the transaction with ``check(own candidacy)`` and ``check(/epoch, my version)``; if either fails
the write is not applied and this node steps down. Believing oneself leader never authorises a
write.

All decisions happen on one election thread. kazoo's event thread only sets flags and wakes it
(ha-rule 14). A watchdog treats a SUSPENDED connection longer than 2/3 of the session timeout
as lost, because kazoo only learns of expiry once it reaches a server again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    RolledBackError,
    RuntimeInconsistency,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.interfaces import IAsyncResult
from kazoo.protocol.states import WatchedEvent

from blobha.leader.journal import ChangeJournal
from blobha.zk.layout import ELECTION, EPOCH, JOURNAL, EpochRecord

log = logging.getLogger("blobha.leader.election")

_PREFIX = "n_"
#: Seconds a resigning master waits for ZooKeeper to delete its candidacy.
RESIGN_TIMEOUT = 3.0
#: Seconds between looks at the connection's state while a call waits for ZooKeeper.
_ANSWER_SLICE = 0.05


class Deposed(Exception):
    """A fenced transaction failed its fences: this node is no longer leader."""


class LeaderElection:
    """Runs this master's candidacy. ``on_elected(epoch)`` prepares the node to lead (it runs
    on the election thread; leadership is reported only after it returns); ``on_deposed()``
    tells the node to stop leader work at once."""

    def __init__(
        self,
        zk: KazooClient,
        identity: str,
        session_timeout: float,
        on_elected: Callable[[int], None],
        on_deposed: Callable[[], None],
    ) -> None:
        self.zk = zk
        self.identity = identity
        self.session_timeout = session_timeout
        self.configured_timeout = session_timeout
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self._node: str | None = None  # full path of our candidacy
        self._session: int | None = None
        self._leading = False
        self._ready = False
        self._epoch = 0
        self._epoch_version = -1
        self._suspended_since: float | None = None
        # Set when kazoo reports the session LOST; cleared only by the election thread once it
        # has handled the new session (stepped down, joined again). A new session's CONNECTED
        # clears the suspension first, and would otherwise show the old term as leading.
        self._session_lost = False
        self._leader_address = ""
        self._thread = threading.Thread(target=self._run, name="election", daemon=True)
        self.journal = ChangeJournal(zk)
        zk.add_listener(self._on_state)

    # ---- public view ---------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True only for a ready leader whose connection is not suspended."""
        return (self._leading and self._ready and self._suspended_since is None
                and not self._session_lost)

    def session_granted(self, granted: float) -> None:
        """kazoo's connection thread, at each connection: the watchdog that steps a leader
        down when its connection stays suspended must use the timeout ZooKeeper granted,
        which its bounds may make shorter (or longer) than the one configured."""
        previous = self.session_timeout
        self.session_timeout = granted
        if abs(granted - self.configured_timeout) > 0.001 and abs(granted - previous) > 0.001:
            log.warning(
                "ZooKeeper granted a session timeout of %gs, not the %gs of"
                " zookeeper.session.timeout.ms (its minSessionTimeout and maxSessionTimeout"
                " bound it); a leader cut off from ZooKeeper now steps down %gs after kazoo"
                " reports the connection suspended",
                granted, self.configured_timeout, self.suspension_limit)

    @property
    def suspension_limit(self) -> float:
        """Two thirds of the session timeout (as ZooKeeper granted it): how long a leader's
        connection may stay suspended, and a ZooKeeper call under the election's lock go
        unanswered, before this master gives up on it."""
        return self.session_timeout * 2 / 3

    def give_up_at(self) -> float | None:
        """When (``time.monotonic()``) the watchdog gives up on a suspended connection, and
        with it every call still waiting on ZooKeeper; None while connected."""
        since = self._suspended_since
        return None if since is None else since + self.suspension_limit

    def wait_answer(self, pending: IAsyncResult, timeout: float) -> Any:
        """:func:`answer_within` this election's watchdog bound (:meth:`give_up_at`)."""
        return answer_within(pending, timeout, self.give_up_at)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def leader_address(self) -> str:
        """The current leader's advertised address as this node last saw it ('' if none)."""
        return self.identity if self.is_leader else self._leader_address

    def start(self) -> None:
        self._thread.start()
        self._wake.set()

    def stop(self, resign: bool = True) -> None:
        """Leave the election. With ``resign``, delete the candidacy so a successor takes over
        now rather than after the session timeout."""
        self._stopping.set()
        self._wake.set()
        with self._lock:
            was_leading = self._leading
            self._step_down("shutting down")
            if resign and self._node is not None:
                # Bounded: with ZooKeeper unreachable a plain delete waits for a connection
                # forever, and the master would never exit. The session's expiry removes the
                # node then, and a successor takes over as after a crash.
                try:
                    self.zk.delete_async(self._node).get(timeout=RESIGN_TIMEOUT)
                    if was_leading:
                        log.info("resigned leadership (epoch %d)", self._epoch)
                except (KazooException, KazooTimeoutError) as e:
                    log.warning("could not resign through ZooKeeper (%s); the candidacy goes"
                                " when the session expires", type(e).__name__)
            self._node = None
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def wake(self) -> None:
        self._wake.set()

    # ---- fencing -------------------------------------------------------------------------

    def fenced(self, build: Callable[[Any], None], changed: tuple[str, ...] = ()) -> list[Any]:
        """Commit a transaction guarded by this leader's fences.

        ``build(txn)`` adds the version-conditional operations. ``changed`` names the keys
        they create: the same transaction records them in the change journal.
        Returns the results of ``build``'s operations. Raises :class:`Deposed` (after stepping
        down) if a fence failed, ConnectionLoss if no answer came within the suspension limit
        (the transaction may yet apply), or kazoo's exception for the failing operation
        otherwise.
        """
        own = self.fenced_results(build, changed)
        for r in own:
            if is_failure(r):
                raise r
        return own

    def fenced_results(self, build: Callable[[Any], None], changed: Sequence[str] = ()
                       ) -> list[Any]:
        """:meth:`fenced`, but an operation of ``build``'s that fails is not raised: the result
        of each operation comes back, in order, so a caller committing several writes in one
        transaction can tell which one failed (:func:`is_failure`; the others then come back as
        rolled back). Fence failures still raise :class:`Deposed`."""
        with self._lock:
            if not self.is_leader or self._node is None:
                raise Deposed("its ZooKeeper connection is suspended"
                              if self._suspended_since is not None else "it does not lead")
            node, version, epoch = self._node, self._epoch_version, self._epoch
        txn = self.zk.transaction()
        txn.check(node, 0)
        txn.check(EPOCH, version)
        build(txn)
        if changed:
            # Appended and submitted under one lock: records reach ZooKeeper in journal order.
            with self.journal.lock:
                txn.set_data(JOURNAL, self.journal.record_for(epoch, changed,
                                                              self.suspension_limit))
                pending = txn.commit_async()
            *results, journal_result = self._commit_answer(pending)
            if is_failure(journal_result):  # then it is the operation that failed
                if isinstance(journal_result, NoNodeError):
                    self.zk.ensure_path(JOURNAL)  # removed by hand: the retry finds it again
                raise journal_result
        else:
            results = self._commit_answer(txn.commit_async())
        fence_failures = [r for r in results[:2] if is_failure(r)]
        if fence_failures:
            self.depose(f"fenced commit refused ({type(fence_failures[0]).__name__})")
            raise Deposed("a fence failed: another master leads now")
        return list(results[2:])

    def _commit_answer(self, pending: IAsyncResult) -> list[Any]:
        """The results of a fenced transaction, waited for at most the suspension limit, and
        not past the watchdog's bound once the connection is suspended (:meth:`wait_answer`).

        The leadership check above and the call are not atomic: a connection that drops
        between them leaves the transaction queued in kazoo until a connection is back: for
        ever, if ZooKeeper stays away. The writes of a whole group commit, and every write queued
        behind it, would wait as long, long after the watchdog deposed this master. A
        transaction given up may still apply later (before any later call of this session),
        which is what ConnectionLoss means to the callers: the outcome is unknown, re-read.
        """
        try:
            return list(self.wait_answer(pending, self.suspension_limit))
        except KazooTimeoutError as e:
            raise ConnectionLoss(f"{e} during a fenced transaction; it may yet apply") from None

    def depose(self, reason: str) -> None:
        with self._lock:
            if self._leading:
                self._step_down(reason)
                # Going to the back of the queue lets the real leader's fences stay valid.
                if self._node is not None:
                    # If the delete fails, the node is still there, and still ahead of the
                    # real leader's if it is lowest: the next step's join removes it.
                    with contextlib.suppress(KazooException, KazooTimeoutError):
                        self._answer(self.zk.delete_async(self._node))
                    self._node = None
        self._wake.set()

    # ---- internals ----------------------------------------------------------------------

    def _on_state(self, state: str) -> None:
        # kazoo's event thread: flags only.
        if state == KazooState.SUSPENDED:
            self._suspended_since = time.monotonic()
        elif state == KazooState.CONNECTED:
            self._suspended_since = None
        elif state == KazooState.LOST:
            self._session_lost = True
            self._leader_address = ""  # as last seen by a session that is gone
            self._suspended_since = time.monotonic() - self.session_timeout
        self._wake.set()

    def _on_watch(self, event: WatchedEvent) -> None:
        self._wake.set()

    def _answer(self, pending: IAsyncResult) -> Any:
        """The answer to a ZooKeeper call made under the election's lock (or a fenced
        transaction, :meth:`_commit_answer`), waited for at most the suspension limit (then
        KazooTimeoutError). kazoo holds a call made while it
        reconnects until the connection is back: with ZooKeeper gone, a plain call would hold
        the lock, and with it stop() and depose(), for as long. A call given up may still be
        applied later, in order with this session's other calls: the next step finds such a
        candidacy as a stray (_clear_strays), and an epoch bumped unseen only makes the next
        bump skip a number."""
        return pending.get(timeout=self.suspension_limit)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            self._wake.wait(timeout=self._next_look())
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                with self._lock:
                    if self._stopping.is_set():
                        # stop() took the lock first and resigned: joining again now would
                        # leave a candidacy (even a term) behind a master shutting down.
                        return
                    self._step()
                backoff = 0.1
            except KazooTimeoutError:
                log.warning("ZooKeeper did not answer the election within %.1f s; retrying in"
                            " %.1fs", self.suspension_limit, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                self._wake.set()
            except Exception:
                log.exception("election step failed; retrying in %.1fs", backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                self._wake.set()

    def _next_look(self) -> float:
        """Seconds until the election thread looks again unwoken: by the watchdog's bound on a
        suspension at the latest, so a cut-off leader steps down on time, not up to half a
        second after the calls waiting on it were answered."""
        give_up = self.give_up_at()
        if give_up is None:
            return 0.5
        return min(0.5, max(give_up - time.monotonic(), 0.0) + 0.01)

    def _step(self) -> None:
        if self.zk.state != KazooState.CONNECTED or self._suspended_since is not None:
            since = self._suspended_since
            too_long = since is not None and time.monotonic() - since > self.suspension_limit
            if self._leading and too_long:
                self._step_down("ZooKeeper connection suspended too long")
            return
        lost = self._session_lost  # read before the session: a later LOST stays flagged
        session = self.zk.client_id[0] if self.zk.client_id else None
        if self._node is None or session != self._session:
            if self._leading:
                self._step_down("ZooKeeper session changed")
            self._node = None
            # A candidacy of this session that nothing tracks (a create made but unanswered,
            # a resignation's delete that failed) goes first. Once lowest, this master would
            # follow it, and every other master this one: no leader until a restart.
            if session is not None:
                self._clear_strays(session)
            # Not create(makepath=True): where the parent is missing, kazoo makes it and sends
            # the create again from a callback, after any later call of ours, so a create given
            # up could land after the next step's _clear_strays had looked.
            self._answer(self.zk.ensure_path_async(ELECTION))
            self._node = self._answer(self.zk.create_async(
                f"{ELECTION}/{_PREFIX}", self.identity.encode(), ephemeral=True, sequence=True,
            ))
            self._session = session
            log.info("joined the election as %s", self._node)
        if lost:
            # Whatever term the lost session held was given up above: this session is handled.
            self._session_lost = False
        children = sorted(
            (c for c in self._answer(self.zk.get_children_async(ELECTION, watch=self._on_watch))
             if c.startswith(_PREFIX)),
            key=lambda c: c[len(_PREFIX):],
        )
        own = self._node.rsplit("/", 1)[1]
        if own not in children:
            # Our candidacy vanished (expired session, or deleted); join again.
            self._step_down("candidacy lost")
            self._node = None
            self._wake.set()
            return
        lowest = children[0]
        if lowest == own:
            self._leader_address = self.identity
            if not self._leading:
                self._become_leader()
        else:
            if self._leading:
                self._step_down("another candidacy is lower")
            try:
                data, _ = self._answer(self.zk.get_async(f"{ELECTION}/{lowest}",
                                                          watch=self._on_watch))
                self._leader_address = data.decode()
            except NoNodeError:
                self._wake.set()

    def _clear_strays(self, session: int) -> None:
        """Delete every candidacy of ``session`` (called while none is tracked). Rare: at a
        join, and then only a few small reads for the other masters' candidacies."""
        try:
            children = self._answer(self.zk.get_children_async(ELECTION))
        except NoNodeError:
            return  # no election yet: nothing of ours either
        for child in children:
            path = f"{ELECTION}/{child}"
            if not child.startswith(_PREFIX):
                continue
            stat = self._answer(self.zk.exists_async(path))
            if stat is not None and stat.ephemeralOwner == session:
                log.warning("removing %s, a candidacy of this master left by a call that got"
                            " no answer", path)
                with contextlib.suppress(NoNodeError):
                    self._answer(self.zk.delete_async(path))

    def _become_leader(self) -> None:
        assert self._node is not None
        with contextlib.suppress(NodeExistsError):
            self._answer(self.zk.create_async(EPOCH, EpochRecord(0, "").encode(),
                                              makepath=True))
        data, stat = self._answer(self.zk.get_async(EPOCH))
        record = EpochRecord.decode(data)
        new = EpochRecord(record.epoch + 1, self.identity)
        txn = self.zk.transaction()
        txn.check(self._node, 0)
        txn.set_data(EPOCH, new.encode(), version=stat.version)
        results = self._answer(txn.commit_async())
        if any(isinstance(r, Exception) for r in results):
            log.warning("epoch bump lost a race (%s); re-evaluating", results)
            self._wake.set()
            return
        self._epoch = new.epoch
        self._epoch_version = stat.version + 1
        self._leading = True
        self._ready = False
        log.info("won the election: epoch %d; preparing to lead", self._epoch)
        # ha-rule 4: catch up with ZooKeeper and reconcile before reporting leadership.
        try:
            self._answer(self.zk.sync_async("/"))
            self._on_elected(self._epoch)
        except Exception:
            # Never stay "leading but not ready": give the term up and run for a new one.
            self._step_down("preparing to lead failed")
            raise
        if self._leading:
            self._ready = True
            log.info("leading as %s (epoch %d)", self.identity, self._epoch)

    def _step_down(self, reason: str) -> None:
        if self._leading:
            log.warning("stepping down as leader (epoch %d): %s", self._epoch, reason)
            self._leading = False
            self._ready = False
            self._leader_address = ""
            try:
                self._on_deposed()
            except Exception:
                log.exception("on_deposed failed")


def answer_within(pending: IAsyncResult, timeout: float,
                  give_up_at: Callable[[], float | None] | None) -> Any:
    """The answer to a ZooKeeper call, waited for at most ``timeout`` and, once the connection
    is suspended, never past the watchdog's bound (``give_up_at()``, a ``time.monotonic()``;
    None while connected), whichever comes first; then KazooTimeoutError (the call may still
    apply later, in order with the session's other calls). kazoo answers a call in flight when
    the connection drops at once (ConnectionLoss), but holds one sent after the drop until a
    connection is back: a partitioned leader held such a write for its caller's whole timeout
    (issue 44). ``give_up_at`` None: a plain bounded wait."""
    if give_up_at is None:
        return pending.get(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        limit = deadline
        give_up = give_up_at()
        if give_up is not None:
            limit = min(limit, give_up)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            raise KazooTimeoutError(
                f"no answer from ZooKeeper within {timeout:.1f}s"
                if give_up is None or give_up > deadline else
                "no answer from ZooKeeper before the watchdog gave up on its suspended"
                " connection")
        # In slices: a suspension that starts during the wait moves its end. Only an answer
        # slower than a slice waits for more than one.
        if pending.wait(min(remaining, _ANSWER_SLICE)):
            return pending.get()


def is_failure(result: object) -> bool:
    # In a failed multi, the operations before the failing one come back as RolledBackError and
    # those after it as RuntimeInconsistency; only the failing operation carries the cause.
    return isinstance(result, Exception) and not isinstance(
        result, RolledBackError | RuntimeInconsistency
    )
