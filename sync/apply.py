"""The executor: reads a batch of keys, decides each (blobha.sync.decide) and carries out the plans.

Reconciling a key means:

* key gone from ZooKeeper: after the delete grace, drop the local copy; never re-create or
  re-register it (deletes flow one way);
* this master is one of the key's holders (:mod:`blobha.core.placement`) and lacks the committed
  version: fetch it from a live replica at that version, verify, install, then register;
* it holds the committed version: make sure its ephemeral replica node exists in this session;
* it holds a copy it is no longer meant to hold: drop it only once every chosen holder has it;
* prune versions older than the retained window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from blobha.core.blobstate import BlobState
from blobha.store.local import LocalStore
from blobha.sync.decide import Action, Facts, Local, Plan, counted, decide, has_work
from blobha.sync.feed import KEY_LIST, ChangeFeed, session_of
from blobha.sync.fetcher import Fetcher, Wanted
from blobha.sync.reads import KeyReader
from blobha.sync.registry import ReplicaRegistry
from blobha.sync.view import KeyView, ReplicaView, holders_of
from blobha.sync.workqueue import WorkQueue
from blobha.zk.layout import key_path, parse_replica, replica_path

if TYPE_CHECKING:
    from blobha.sync.membership import Membership
    from blobha.sync.protocols import ClusterGuard, LeaderDuties
    from blobha.sync.settings import SyncSettings

log = logging.getLogger("blobha.sync.synchronizer")

#: What reconciling one key leaves for the slow parts of its batch: (state, holders) to fetch,
#: the version whose replica node to (re-)register (our copy is installed and verified), or
#: None.
Outcome = tuple[BlobState, list[str]] | int | None


class Executor:
    """Reconciles batches of keys: the reads, the decisions, and what they call for."""

    def __init__(self, zk: KazooClient, store: LocalStore, identity: str,
                 membership: Membership, settings: SyncSettings, view: ReplicaView,
                 queue: WorkQueue, feed: ChangeFeed, reader: KeyReader,
                 registry: ReplicaRegistry, fetcher: Fetcher, duties: LeaderDuties,
                 guard: ClusterGuard) -> None:
        self.zk = zk
        self.store = store
        self.identity = identity
        self.membership = membership
        self.settings = settings
        self.view = view
        self.queue = queue
        self.feed = feed
        self.reader = reader
        self.registry = registry
        self.fetcher = fetcher
        self.duties = duties
        self.guard = guard
        # When each key still held here was first found gone from ZooKeeper (the delete grace).
        self._deleted_since: dict[str, float] = {}
        #: The clock of the delete grace (tests move it instead of waiting).
        self.clock: Callable[[], float] = time.monotonic

    # ---- a batch -------------------------------------------------------------------------

    def handle(self, keys: list[str]) -> dict[str, Exception]:
        """Reconcile a batch of keys; the failures, per key (the others succeeded)."""
        failures: dict[str, Exception] = {}
        if KEY_LIST in keys:
            try:
                self.feed.refresh_keys()
            except Exception as e:
                failures[KEY_LIST] = e
            keys = [k for k in keys if k != KEY_LIST]
        armed = self.view.batch_taken(keys, time.monotonic(), self.settings.arm_on_read_secs)
        try:
            return self.reconcile(keys, armed, failures)
        finally:
            if armed:
                self.view.arming_ended(armed)

    def reconcile(self, keys: list[str], armed: set[str], failures: dict[str, Exception]
                  ) -> dict[str, Exception]:
        """Reconcile ``keys``, those in ``armed`` with reads that arm their replica lists'
        watches; ``failures``: the batch's so far, returned with its own.

        With the recursive watch, the replica events for these keys are held until the batch
        ends (see ChangeFeed.on_tree): a follower fetching a key had work on it when the other
        holders registered, and each of their events sent the key round again, to find its
        work done (two more reads per follower per create). The keys whose creation's events
        were held have their replica lists in them (see InFlight.born), and only their nodes
        are read."""
        recursive = self.feed.recursive
        listless = self.view.batch_started(keys) if recursive else set()
        try:
            to_fetch: list[Wanted] = []
            to_register: list[tuple[str, int]] = []
            read_mark, heard = self.view.marks()  # before the reads are sent
            reads = self.reader.read_many(keys, armed, listless)
            seen: list[str] = []
            for key, read in reads.items():
                try:
                    if isinstance(read, Exception):
                        raise read
                    if read is None:
                        # A commit after this read re-created the key: its mark stays, for the
                        # read that commit's reconcile makes (key_gone re-checks anyway).
                        self.view.read_is_current(key, read_mark, spend=True)
                        self.key_gone(key)
                        continue
                    seen.append(key)
                    outcome = self.settle(key, *read, read_mark=read_mark,
                                          from_events=key in listless, heard=heard)
                    if isinstance(outcome, tuple):
                        to_fetch.append((key, outcome[0], outcome[1]))
                    elif outcome is not None:
                        to_register.append((key, outcome))
                except Exception as e:
                    failures[key] = e
            if any(not state.acked and state.write_quorum > 1 for _, state, _ in to_fetch):
                # A writer waits for these copies: held for the linger, each of its next writes
                # would wait for it too.
                self.queue.hurry(self.settings.hurry_secs)
            if armed:
                # What settle stored for these keys is what the batch read found; where the
                # list changed since, an event's newer read may have been overwritten: read it
                # again.
                armed = self.view.armed_unmoved(armed)
            fetched, done, fresh = self.fetcher.fetch_all(to_fetch, failures, read_mark)
            to_register += done
            installed = self.fetcher.install_fetched(fetched, read_mark)
            failures.update(installed)
            to_register += [(key, state.seq) for key, state, _ in fetched
                            if key not in installed]
            to_register = self.registry.drop_deleted(to_register, failures)
            # Only now, with every byte durable and verified, do the replica nodes appear
            # (ha-rule 7).
            failures.update(self.registry.register_many(to_register))
            self.registry.undo_deleted(to_register, failures)
            for key, state, _ in to_fetch:
                # A key that had no version here has nothing to prune (a listing saved per
                # key).
                if key not in failures and key not in fresh:
                    try:
                        self.prune(key, state.seq)
                    except Exception as e:
                        failures[key] = e
            if not self.feed.recursive:
                self.feed.watch_replicas([key for key in seen if key not in armed], failures)
            return failures
        finally:
            if recursive:
                self.act_on_moved(self.view.batch_ended(keys))

    def act_on_moved(self, keys: list[str]) -> None:
        """Keys whose holders replica-node events changed during their batch: back to a worker
        where that leaves this master something to do, now that the batch has done its part."""
        if not keys:
            return
        known = self.membership.known()
        leader = self.guard.is_leader()
        session = session_of(self.zk)
        work = self.view.entries_where(
            keys, lambda key, entry: has_work(self.identity, key, entry, known, leader, session))
        self.queue.put_many([key for key, _ in work])

    # ---- one key -------------------------------------------------------------------------

    def settle(self, key: str, data: bytes, stat: Any, names: list[str], read_mark: int = -1,
               from_events: bool = False, heard: int = -1) -> Outcome:
        """Reconcile ``key`` under its lock, from a read sent when this master's commit count
        was ``read_mark`` (-1: unknown). A commit this master made to the key since may be
        missing from the read, and acting on it could delete the new version: a key deleted
        and created again reuses its version numbers, so an old read of the same version
        number finds "our" copy wrong, removes it, and its replica node with it. Such a key is
        looked at again, with a read sent after that commit. ``heard``: the count of changes
        announced when the read was sent (ReplicaView.marks; -1: unknown). ``from_events``:
        ``names`` is empty, and the replica list is the events held since the key's creation.

        All but the slow parts, which it returns (see Outcome): the decision
        (blobha.sync.decide), and what it calls for here and now."""
        with self.guard.key_lock(key):
            if not self.view.read_is_current(key, read_mark, spend=True):
                self.queue.put(key)  # runs once this batch lets go of the key
                return None
            state = BlobState.decode(data, stat.version)
            session = session_of(self.zk)
            holders, registered, unchanged = self.view.read_stored(
                key, state, data, stat.version, holders_of(names, state.seq), session, from_events,
                heard)
            self._deleted_since.pop(key, None)
            trusted = bool(unchanged and registered == session and session)
            own = tuple((name, parsed[1]) for name in names
                        if (parsed := parse_replica(name)) and parsed[0] == self.identity)
            # Only nodes that count: a dead master's stay in ZooKeeper (ha-rule 9).
            holders = counted(holders, self.view.holding())
            plan = decide(Facts(
                key=key, seq=state.seq, rf=state.replication_factor, holders=holders,
                own_nodes=own, local=self._local(key, state, trusted), registered=registered,
                session=session, identity=self.identity,
                known=frozenset(self.membership.known()), leader=self.guard.is_leader()))
            return self._carry_out(key, state, holders, plan)

    def _local(self, key: str, state: BlobState, trusted: bool) -> Local:
        if trusted:
            # Nothing moved since we verified our copy in this session: skip re-reading its
            # record (100,000s of keys every period), only check it is still on disk.
            return Local.TRUSTED if self.store.has_version(key, state.seq) else Local.ABSENT
        local = self.store.info(key, state.seq)
        if local is None:
            return Local.ABSENT
        if local.digest != state.digest or local.size != state.size:
            return Local.DIFFERS
        return Local.PRESENT

    def _carry_out(self, key: str, state: BlobState, holders: tuple[str, ...], plan: Plan
                   ) -> Outcome:
        if plan.discard_local:
            # A version of an earlier incarnation of the key, or of a commit that never was.
            # Unless ZooKeeper is not this store's cluster (wiped, or another cluster's):
            # then its record says nothing about our copy, which must stay (ha-rules 10).
            if not self.guard.deletions_allowed():
                log.warning("%r v%d here differs from ZooKeeper's record, which does not"
                            " hold this store's cluster (wiped or foreign?): keeping the"
                            " local copy and leaving the key alone", key, state.seq)
                return None
            self.store.delete_version(key, state.seq)
        path = key_path(key)
        for name, seq in plan.drop_nodes:
            self.registry.delete_node(f"{path}/{name}")
            if seq == state.seq:
                self.view.unregistered(key)  # so a later install registers it afresh
        if plan.leader_duty and self.duties.leader_duty(key, KeyView(state, holders)):
            return None  # the leader changed the key's state; its watch brings it back here
        if plan.action is Action.DROP:
            log.info("dropping %r v%d: held by all of %s", key, state.seq, list(plan.targets))
            self.registry.delete_node(replica_path(key, self.identity, state.seq))
            # Only what this decision was about: the leader may have committed a newer
            # version here while this read was in flight (its write path holds the key's
            # lock from install to commit); deleting the whole key lost that write.
            self.store.delete_through(key, state.seq)
            self.view.unregistered(key)
            return None
        if plan.prune:
            self.prune(key, state.seq)
        if plan.action is Action.REGISTER:
            return state.seq
        if plan.action is Action.FETCH:
            return state, list(holders)
        return None

    def prune(self, key: str, committed: int) -> None:
        keep_below = self.settings.versions_retained - 1
        older = []
        for seq in self.store.versions(key):
            if seq > committed and not self.guard.is_leader():
                # Debris of a commit that never happened (the leader's own in-flight commits
                # are cleaned by the commit path).
                self._drop_debris(key, seq)
            elif seq < committed:
                older.append(seq)
        for seq in older[: max(len(older) - keep_below, 0)]:
            self.store.delete_version(key, seq)

    def _drop_debris(self, key: str, seq: int) -> None:
        """Delete ``seq`` of ``key``, found above the committed version, if it still is once
        the key's lock is held. The leader's commit path holds that lock from install to
        commit: decided outside it, a blip of the leader's connection (it reads as not leading
        for a moment) could delete a version that the still-leading master committed just
        then."""
        with self.guard.key_lock(key):
            if self.guard.is_leader():
                return
            try:
                data, _ = self.zk.get(key_path(key))
            except NoNodeError:
                return  # deleted: key_gone removes the whole key, after its grace
            if seq > BlobState.decode(data).seq:
                self.store.delete_version(key, seq)

    def key_gone(self, key: str) -> None:
        """``key`` is gone from ZooKeeper: after the delete grace, drop the local copy; never
        re-create or re-register it (deletes flow one way)."""
        self.view.forget(key)
        if not self.store.versions(key):
            self._deleted_since.pop(key, None)
            return
        now = self.clock()
        since = self._deleted_since.setdefault(key, now)
        remaining = self.settings.delete_grace_secs - (now - since)
        if remaining > 0:
            self.queue.put(key, delay=remaining)
            return
        with self.guard.key_lock(key):
            # Re-check under the lock the commit path holds: a re-create may be under way.
            if self.zk.exists(key_path(key)) is not None:
                self.queue.put(key)
                return
            # Asked here, just before the delete, not once at start: ZooKeeper wiped or
            # swapped while this master runs must not read as "every key was deleted".
            if not self.guard.deletions_allowed():
                # The grace starts again once ZooKeeper holds this cluster: restored in stages,
                # a key not back yet must not go at once on a grace counted from the wipe.
                self._deleted_since.pop(key, None)
                log.debug("ZooKeeper has no record of %r, but it does not hold this store's"
                          " cluster (wiped or foreign?): keeping the local copy", key)
                return
            self.store.delete_key(key)
            self._deleted_since.pop(key, None)
            log.info("deleted local copy of %r (deleted in ZooKeeper)", key)


__all__ = ["Executor", "Outcome"]
