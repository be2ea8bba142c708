"""Background replica synchronisation on every master (ha-rules 6-12).

Watch-driven: every key's metadata znode and replica list carry a watch whose only job is to
queue the key; worker threads then *re-read and reconcile* it, so a follower starts fetching a
new version within milliseconds of its commit. A periodic full reconcile (Storm's only mechanism,
here a safety net) re-arms every watch and catches anything missed, and runs at once after every
new ZooKeeper session, re-registering this master's replica nodes.

Reconciling a key means:

* key gone from ZooKeeper: after the delete grace, drop the local copy; never re-create or
  re-register it (deletes flow one way);
* this master is one of the key's holders (:mod:`blobha.placement`) and lacks the committed
  version: fetch it from a live replica at that version, verify, install, then register;
* it holds the committed version: make sure its ephemeral replica node exists in this session;
* it holds a copy it is no longer meant to hold: drop it only once every chosen holder has it;
* prune versions older than the retained window.

One failing key is logged and retried with backoff; the loop itself never stops.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass

from blobha.sync.membership import Membership
from blobha.sync.workqueue import WorkQueue
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.protocol.states import WatchedEvent

from blobha import placement, zkstate
from blobha.errors import BlobError
from blobha.peers import Peers
from blobha.store import LocalStore
from blobha.zkstate import BLOBSTORE, BlobState, key_path, parse_replica, replica_path

log = logging.getLogger(__name__)

# Queue entry meaning "re-read the list of keys"; never a valid key (keys are non-empty).
_KEY_LIST = ""


class SyncDeferred(Exception):
    """Nothing to fetch from right now; the key is retried when a replica registers."""


@dataclass(frozen=True)
class KeyView:
    state: BlobState
    replicas: tuple[str, ...]

    def holders(self) -> list[str]:
        return zkstate.holders(list(self.replicas), self.state.seq)


@dataclass(frozen=True)
class SyncSettings:
    replica_grace_secs: float
    delete_grace_secs: float
    period_secs: float
    versions_retained: int
    threads: int


class Synchronizer:
    def __init__(
        self,
        zk: KazooClient,
        store: LocalStore,
        identity: str,
        peers: Peers,
        membership: Membership,
        settings: SyncSettings,
        is_leader: Callable[[], bool],
        leader_duty: Callable[[str, KeyView], bool],
        deletions_allowed: Callable[[], bool],
        key_lock: Callable[[str], AbstractContextManager[object]],
    ) -> None:
        self.zk = zk
        self.store = store
        self.identity = identity
        self.peers = peers
        self.membership = membership
        self.settings = settings
        self._is_leader = is_leader
        self._leader_duty = leader_duty
        self._deletions_allowed = deletions_allowed
        self._key_lock = key_lock
        self.queue = WorkQueue()
        self._view: dict[str, KeyView] = {}
        self._view_lock = threading.Lock()
        self._deleted_since: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._verified: dict[str, tuple[int, int]] = {}  # key -> (seq, session) checked
        self._session: int | None = None
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._full_requested = False
        self._threads: list[threading.Thread] = []
        zk.add_listener(self._on_state)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.settings.threads):
            t = threading.Thread(target=self._worker, name=f"sync-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._periodic, name="sync-periodic", daemon=True)
        t.start()
        self._threads.append(t)
        self._kick.set()

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()
        self.queue.close()
        for t in self._threads:
            t.join(timeout=5)

    def reconcile_all(self) -> None:
        """Queue every key known to ZooKeeper or held locally (and re-arm the key-list watch)."""
        try:
            keys = set(self.zk.get_children(BLOBSTORE, watch=self._on_event))
        except NoNodeError:
            keys = set()
        self.queue.put_many(sorted(keys | set(self.store.keys())))

    def request_full_reconcile(self) -> None:
        """Ask the periodic thread for a full reconcile now, without waiting for it (it scans
        every key, which must not delay the caller, e.g. a leader taking office)."""
        self._full_requested = True
        self._kick.set()

    def schedule(self, key: str) -> None:
        self.queue.put(key)

    # ---- views for the cluster summary ---------------------------------------------------

    def view(self, key: str) -> KeyView | None:
        with self._view_lock:
            return self._view.get(key)

    def figures(self) -> tuple[int, int, int]:
        """(keys, keys with fewer holders than their replication factor, keys this master
        should hold but lacks)."""
        known = self.membership.known()
        with self._view_lock:
            views = list(self._view.items())
        under = lag = 0
        for key, v in views:
            holders = v.holders()
            # Against the factor asked for, not the capped one: a blob that wants 3 copies in a
            # cluster with a dead master is under-replicated, and operators should see it.
            if len(holders) < v.state.replication_factor:
                under += 1
            rf = min(v.state.replication_factor, max(len(known), 1))
            if self.identity in placement.choose(key, known, rf) and self.identity not in holders:
                lag += 1
        return len(views), under, lag

    # ---- events (kazoo's event thread: hand off only) -------------------------------------

    def _on_state(self, state: str) -> None:
        if state == KazooState.CONNECTED:
            self._kick.set()

    def _on_event(self, event: WatchedEvent) -> None:
        if event.path is None:
            # A session event (kazoo fires pending watches this way when a session expires):
            # every watch is gone, so look at everything again.
            self._kick.set()
            return
        if event.path == BLOBSTORE:
            self.queue.put(_KEY_LIST)
        elif event.path.startswith(BLOBSTORE + "/"):
            self.queue.put(event.path[len(BLOBSTORE) + 1:].split("/", 1)[0])

    def membership_changed(self) -> None:
        self._kick.set()

    # ---- loops --------------------------------------------------------------------------

    def _periodic(self) -> None:
        next_full = 0.0
        while not self._stop.is_set():
            grace = self.membership.next_grace_expiry()
            wait = max(0.0, next_full - time.monotonic())
            if grace is not None:
                wait = min(wait, grace + 0.05)
            self._kick.wait(timeout=wait)
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                if self.zk.state != KazooState.CONNECTED:
                    continue
                session = self.zk.client_id[0] if self.zk.client_id else None
                if session != self._session:
                    # ha-rule 6: a new session lost every ephemeral node; put them back.
                    log.info("new ZooKeeper session %s: re-registering and reconciling", session)
                    self.membership.register()
                    self._verified.clear()
                    self._session = session
                    next_full = 0.0
                else:
                    self.membership.refresh()
                if time.monotonic() >= next_full or grace is not None or self._full_requested:
                    self._full_requested = False
                    self.reconcile_all()
                    next_full = time.monotonic() + self.settings.period_secs
            except Exception:
                log.exception("periodic reconcile failed; retrying shortly")
                self._stop.wait(1.0)
                self._kick.set()

    def _worker(self) -> None:
        while True:
            key = self.queue.get()
            if key is None:
                return
            try:
                if key == _KEY_LIST:
                    self._refresh_keys()
                else:
                    self._reconcile(key)
                self._failures.pop(key, None)
            except SyncDeferred as e:
                log.debug("sync of %r deferred: %s", key, e)
                self._retry_later(key, quiet=True)
            except Exception as e:
                self._retry_later(key, error=e)
            finally:
                self.queue.done(key)

    def _retry_later(self, key: str, error: Exception | None = None, quiet: bool = False) -> None:
        n = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(30.0, 0.2 * 2 ** min(n, 8)) * random.uniform(0.5, 1.0)
        if error is not None and not quiet:
            if isinstance(error, BlobError | KazooException):
                log.warning("sync of %r failed (%s); retry %d in %.1fs", key, error, n, delay)
            else:
                log.exception("sync of %r failed; retry %d in %.1fs", key, n, delay,
                              exc_info=error)
        if not self._stop.is_set():
            self.queue.put(key, delay=delay)

    # ---- reconcile ----------------------------------------------------------------------

    def _refresh_keys(self) -> None:
        try:
            keys = set(self.zk.get_children(BLOBSTORE, watch=self._on_event))
        except NoNodeError:
            keys = set()
        with self._view_lock:
            known = set(self._view)
        self.queue.put_many(sorted(keys - known))
        self.queue.put_many(sorted(known - keys))

    def _reconcile(self, key: str) -> None:
        path = key_path(key)
        try:
            data, stat = self.zk.get(path, watch=self._on_event)
            names = self.zk.get_children(path, watch=self._on_event)
        except NoNodeError:
            self._key_gone(key)
            return
        state = BlobState.decode(data, stat.version)
        view = KeyView(state, tuple(names))
        with self._view_lock:
            self._view[key] = view
        self._deleted_since.pop(key, None)

        local = self.store.info(key, state.seq)
        if local is not None and (local.digest != state.digest or local.size != state.size):
            # A version of an earlier incarnation of the key, or of a commit that never was.
            self.store.delete_version(key, state.seq)
            local = None
        for name in names:
            parsed = parse_replica(name)
            if parsed and parsed[0] == self.identity and (local is None or parsed[1] != state.seq):
                self._delete_node(f"{path}/{name}")

        if self._is_leader() and self._leader_duty(key, view):
            return  # the leader changed the key's state; its watch brings it back here

        known = self.membership.known()
        rf = min(state.replication_factor, max(len(known), 1))
        targets = placement.choose(key, known, rf)
        holders = view.holders()
        if local is not None:
            self.register_replica(key, state.seq)
            others = [h for h in holders if h != self.identity]
            if self.identity not in targets and set(targets) <= set(holders) and len(others) >= rf:
                # Lowering R or a membership change: drop extras only once the set is complete.
                log.info("dropping %r v%d: held by all of %s", key, state.seq, targets)
                self._delete_node(replica_path(key, self.identity, state.seq))
                with self._key_lock(key):
                    self.store.delete_key(key)
                self._verified.pop(key, None)
                return
        elif self.identity in targets:
            self._fetch(key, state, holders)

        self._prune(key, state.seq)

    def _prune(self, key: str, committed: int) -> None:
        keep_below = self.settings.versions_retained - 1
        older = []
        for seq in self.store.versions(key):
            if seq > committed and not self._is_leader():
                # Debris of a commit that never happened (the leader's own in-flight commits
                # are cleaned by the commit path).
                self.store.delete_version(key, seq)
            elif seq < committed:
                older.append(seq)
        for seq in older[: max(len(older) - keep_below, 0)]:
            self.store.delete_version(key, seq)

    def _fetch(self, key: str, state: BlobState, holders: list[str]) -> None:
        copy = self.store.find_by_digest(key, state.digest, state.size)
        if copy is not None:
            self.store.install_copy(key, state.seq, copy)
        else:
            sources = [h for h in holders if h != self.identity]
            if not sources:
                raise SyncDeferred(f"no live replica holds v{state.seq} yet")
            random.shuffle(sources)
            self.store.reserve(state.size)
            temp = self.store.new_temp("sync")
            started = time.monotonic()
            try:
                timeout = 60.0 + state.size / (20 * 1024 * 1024)
                last: Exception | None = None
                for source in sources:
                    try:
                        self.peers.fetch(source, key, state.seq, state.digest, temp, timeout)
                        last = None
                        break
                    except BlobError as e:
                        # Resume from the next replica at the offset already received.
                        last = e
                        log.info("fetch of %r v%d from %s failed (%s); trying another",
                                 key, state.seq, source, e)
                if last is not None:
                    raise last
                self.store.install(key, state.seq, temp, state.size, state.digest)
            except BaseException:
                temp.discard()
                raise
            log.info("synced %r v%d (%d bytes) in %.3fs", key, state.seq, state.size,
                     time.monotonic() - started)
        self.register_replica(key, state.seq)

    def register_replica(self, key: str, seq: int) -> None:
        """Make our replica node exist, owned by the current session (ha-rules 6, 7)."""
        session = self.zk.client_id[0] if self.zk.client_id else 0
        if self._verified.get(key) == (seq, session):
            return
        path = replica_path(key, self.identity, seq)
        try:
            # No makepath: if the key was deleted meanwhile, we must not resurrect it.
            self.zk.create(path, b"", ephemeral=True)
        except NodeExistsError:
            stat = self.zk.exists(path)
            if stat is not None and stat.ephemeralOwner != session:
                self._delete_node(path)
                self.zk.create(path, b"", ephemeral=True)
        except NoNodeError:
            return
        self._verified[key] = (seq, session)

    def registered(self, key: str, seq: int, session: int) -> None:
        """The leader's commit created our replica node of ``seq`` in ``session``."""
        self._verified[key] = (seq, session)

    def corrupted(self, key: str, seq: int) -> None:
        """A stored version failed its digest and was removed: stop advertising it and fetch
        a healthy copy."""
        self._verified.pop(key, None)
        try:
            self._delete_node(replica_path(key, self.identity, seq))
        except KazooException:
            log.warning("could not unregister corrupt replica of %r now; the reconcile will", key)
        self.queue.put(key)

    def _delete_node(self, path: str) -> None:
        with suppress(NoNodeError):
            self.zk.delete(path)

    def _key_gone(self, key: str) -> None:
        with self._view_lock:
            self._view.pop(key, None)
        self._verified.pop(key, None)
        if not self.store.versions(key):
            self._deleted_since.pop(key, None)
            return
        if not self._deletions_allowed():
            log.error("ZooKeeper has no record of %r but the cluster identity check failed"
                      " (wiped or foreign ZooKeeper?): keeping the local copy", key)
            return
        now = time.monotonic()
        since = self._deleted_since.setdefault(key, now)
        remaining = self.settings.delete_grace_secs - (now - since)
        if remaining > 0:
            self.queue.put(key, delay=remaining)
            return
        with self._key_lock(key):
            # Re-check under the lock the commit path holds: a re-create may be under way.
            if self.zk.exists(key_path(key)) is None:
                self.store.delete_key(key)
                self._deleted_since.pop(key, None)
                log.info("deleted local copy of %r (deleted in ZooKeeper)", key)
            else:
                self.queue.put(key)

    # Used by the leader's roll-back to report progress on a key without a holder.
    def views(self) -> dict[str, KeyView]:
        with self._view_lock:
            return dict(self._view)


__all__ = ["KeyView", "SyncDeferred", "SyncSettings", "Synchronizer"]
