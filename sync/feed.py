"""The change feed: changes below /blobstore, turned into queued keys and holder updates.

Watch-driven: one persistent recursive watch on ``/blobstore`` (ZooKeeper 3.6 and later, see
:func:`blobha.zk.connection.add_recursive_watch`) brings every change below it. A key's node
created, changed or deleted queues the key; a replica node created or deleted changes the key's
holders in the replica view, with no read, and queues the key only where this master has work
on it. The watch lasts for one connection: after each reconnect it is added again, and
everything is reconciled.

Without it (``blobstore.sync.recursive.watch`` off, or a server that refuses it), the change
journal (``/journal``, written by every leader transaction that creates a key), every key's
metadata znode and the replica lists of keys in motion carry one-shot watches whose only job is
to queue keys or update holders. New keys then come from the journal: no master lists
``/blobstore`` (linear in the number of keys) after each create; a master that missed journal
entries (they are kept for the last 128 creates) lists it once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoNodeError, UnimplementedError
from kazoo.protocol.states import EventType, WatchedEvent

from blobha.store.local import LocalStore
from blobha.sync.decide import has_work, in_motion
from blobha.sync.settings import SyncSettings
from blobha.sync.verify import check_own_nodes
from blobha.sync.view import Entry, ReplicaView
from blobha.sync.workqueue import WorkQueue
from blobha.zk.connection import add_recursive_watch
from blobha.zk.layout import BLOBSTORE, JOURNAL, JournalRecord, key_path, parse_replica

if TYPE_CHECKING:
    from blobha.sync.membership import Membership
    from blobha.sync.protocols import ClusterGuard

# The synchroniser's logger, whatever module logs: operators route it by this name.
log = logging.getLogger("blobha.sync.synchronizer")

#: Queue entry meaning "re-read the list of keys" (after a gap in the change journal); never a
#: valid key (keys are non-empty).
KEY_LIST = ""


def describe(error: Exception) -> str:
    """An error for a log line: kazoo's connection errors have no message of their own."""
    return str(error) or type(error).__name__


def session_of(zk: KazooClient) -> int:
    """The current ZooKeeper session's id (0 when there is none)."""
    return zk.client_id[0] if zk.client_id else 0


class Wake:
    """How the feed (and the master) wake the periodic thread, and ask it for a full pass."""

    def __init__(self) -> None:
        self.event = threading.Event()
        #: A full reconcile is owed (a reconnect, a new leader, a failed full pass).
        self.full_requested = False
        #: This master took office (see ask_leader_pass).
        self.leader_pass_requested = False

    def kick(self) -> None:
        self.event.set()

    def ask_full(self) -> None:
        self.full_requested = True
        self.event.set()

    def ask_leader_pass(self) -> None:
        """A new leader's pass: at once, the keys of its view whose state may call for a
        leader's duty (unacknowledged, or announced and not read); every key in a paced pass
        that starts a moment later. Queuing every key at once kept a new leader's only CPU and
        its ZooKeeper connection busy with 100,000s of reads while its first writes waited."""
        self.leader_pass_requested = True
        self.event.set()


class ChangeFeed:
    """The ZooKeeper intake: the recursive watch (or the journal and one-shot watches), the
    listings of every key, and the reads of replica lists that keep the view's holders
    current."""

    def __init__(self, zk: KazooClient, store: LocalStore, identity: str,
                 membership: Membership, settings: SyncSettings, view: ReplicaView,
                 queue: WorkQueue, guard: ClusterGuard, wake: Wake) -> None:
        self.zk = zk
        self.store = store
        self.identity = identity
        self.membership = membership
        self.settings = settings
        self.view = view
        self.queue = queue
        self.guard = guard
        self.wake = wake
        #: Whether /blobstore is followed with one persistent recursive watch (on_tree); it
        #: falls back to the one-shot watches if ZooKeeper refuses it.
        self.recursive = settings.recursive_watch
        self._key_list_next = 0.0  # monotonic time before which the key list is not re-read
        # The last change-journal record acted on: its last entry (None: not read yet) and the
        # zxid that wrote it (answers can arrive out of order; older ones are ignored).
        self.journal_seen: int | None = None
        self._journal_zxid = -1
        self._journal_lock = threading.Lock()
        # The journal's watch fired while this master led and was left unarmed (stepped_down
        # arms it again when this master steps down). Guarded by _journal_lock.
        self._journal_unwatched = False
        #: One bound method for every key's watch: kazoo keeps the watcher it is given in a set
        #: per path, and `self.on_event` makes a new object on each access (64 bytes per key
        #: held for as long as the watch is armed, on every master).
        self.watcher = self.on_event
        # Connections made, and the one the recursive watch was last armed on (see watch_tree).
        self._connects = 0
        self._armed_for = 0

    def _has_work(self, key: str, entry: Entry, known: set[str], leader: bool) -> bool:
        return has_work(self.identity, key, entry, known, leader, session_of(self.zk))

    # ---- the connection and the recursive watch (kazoo's event thread: hand off only) ------

    def on_state(self, state: str) -> None:
        self.view.connection_changed()
        if state == KazooState.CONNECTED:
            self._connects += 1
            self.view.reconnected()
            # kazoo does not re-send watches after a reconnect, even within one session: look
            # at everything again, which re-arms them.
            self.wake.ask_full()

    def watch_tree(self) -> None:
        """Arm the persistent recursive watch on /blobstore for this connection (called before
        each full reconcile, whose reads then cover whatever changed while it was not armed)."""
        connection = self._connects
        try:
            # Inline: on_tree takes a lock and queues, nothing more; on kazoo's callback
            # thread each of the several events per write cost a hand-over between threads.
            add_recursive_watch(self.zk, BLOBSTORE, self.on_tree,
                                timeout=self.settings.read_timeout, inline=True)
            if connection != self._armed_for:
                # Changes between the reconnect and now were announced to nobody: a read sent
                # before the watch does not bring an entry up to date, one sent after does.
                self._armed_for = connection
                self.view.reconnected()
        except UnimplementedError as e:
            # What a server before 3.6 answers an operation it does not know. Anything else
            # (a lost connection, a server error) is retried by the caller.
            log.warning("ZooKeeper refused a persistent recursive watch on %s (%s); it needs"
                        " ZooKeeper 3.6 or later. Following changes with the change journal"
                        " and one-shot watches instead", BLOBSTORE, describe(e))
            self.recursive = False

    def on_tree(self, event: WatchedEvent) -> None:
        """The recursive watch's events (kazoo's connection thread, in ZooKeeper's order: no
        blocking calls here).

        A key's own node queues it, as its one-shot watch did: created (what the change
        journal told), changed, deleted. A replica node's event changes the key's holders
        directly, without a read (the one-shot watch only said that the list changed, and every
        master read it again per registration); the key goes to a worker only where this
        master has work on it."""
        path = event.path
        if not path.startswith(BLOBSTORE + "/"):
            return
        key, sep, name = path[len(BLOBSTORE) + 1:].partition("/")
        view = self.view
        if not sep:
            if event.type != EventType.CREATED or not self.guard.is_leader():
                view.heard(key)
            if event.type == EventType.DELETED:
                view.key_deleted(key)
            if event.type == EventType.CREATED and self.guard.is_leader():
                # The leader's own commit, which queues the key itself: a second reconcile
                # would cost two more reads per create. A create by an earlier leader is in the
                # listing of the full reconcile a new leader runs, and one by the next leader,
                # before this master saw it step down, in the listing stepped_down asks for.
                return
            if event.type == EventType.CREATED:
                view.key_created(key, self.settings.born_max)
            self.queue.put(key)
            return
        if "/" in name or event.type not in (EventType.CREATED, EventType.DELETED):
            return
        parsed = parse_replica(name)
        if parsed is None:
            return
        # Where a worker has the key, the end of its batch looks at what moved (see
        # Executor.reconcile): no entry back then.
        entry = view.replica_event(key, (parsed[0], parsed[1], event.type == EventType.CREATED))
        if entry is not None and self._has_work(
                key, entry, self.membership.known(), self.guard.is_leader()):
            self.queue.put(key)

    def check_own_nodes(self, stopping: threading.Event) -> tuple[int, int]:
        """Remove this master's replica nodes of versions its store lacks, before they count
        (see blobha.sync.verify): (keys looked at, nodes removed)."""
        return check_own_nodes(self.zk, self.identity, self.store.has_version,
                               self.settings.read_timeout, stopping)

    # ---- one-shot watches ------------------------------------------------------------------

    def on_event(self, event: WatchedEvent) -> None:
        if event.path is None:
            # A session event (kazoo fires pending watches this way when a session expires):
            # every watch is gone, so look at everything again.
            self.wake.kick()
            return
        if event.path.startswith(BLOBSTORE + "/"):
            key = event.path[len(BLOBSTORE) + 1:].split("/", 1)[0]
            if event.type == EventType.CHILD:
                # Only the replica list moved (another master registered a copy, most often):
                # one read of the list instead of a full reconcile of the key (three reads and
                # a worker's turn on every master, per registration). The key goes to a worker
                # only where this master has work on it; otherwise, while it is still in
                # motion, the watch is re-armed. The read arms it itself where one more copy
                # still leaves the key short of its factor (it stays in motion): one read
                # instead of two.
                arm = self.view.replicas_announced(key)
                self.zk.get_children_async(
                    event.path, watch=self.watcher if arm else None).rawlink(
                    functools.partial(self.replicas_read, key, event.path, armed=arm))
                return
            self.view.heard(key)
            self.queue.put(key)

    def replicas_read(self, key: str, path: str, result: Any, armed: bool = False) -> None:
        """A replica list read after its watch fired (kazoo's callback thread: no blocking
        calls here). ``armed``: this read set the watch."""
        try:
            names = result.get_nowait()
        except Exception:
            self.queue.put(key)  # deleted (its data watch fires too) or the connection failed
            return
        known = self.membership.known()
        leader = self.guard.is_leader()
        entry = self.view.replicas_listed(key, names)
        if entry is None or self._has_work(key, entry, known, leader):
            self.queue.put(key)
        elif not armed and in_motion(self.identity, key, entry, known, leader,
                                     self.view.holding()):
            # Still under-replicated, and nothing for this master to do but follow it (its
            # figures): re-arm the watch with one more read, instead of a worker's reconcile of
            # the key (three reads) on every master for every copy registered elsewhere.
            self.zk.get_children_async(path, watch=self.watcher).rawlink(
                functools.partial(self._replicas_rearmed, key))

    def _replicas_rearmed(self, key: str, result: Any) -> None:
        # kazoo's callback thread. The watch is armed; a change between the two reads fires
        # no event, so it is compared here.
        try:
            names = result.get_nowait()
        except Exception:
            self.queue.put(key)
            return
        if self.view.list_differs(key, names):
            self.queue.put(key)

    def watch_replicas(self, keys: list[str], failures: dict[str, Exception]) -> None:
        """Arm a watch on the replica list of the keys still in motion, with a fresh read.

        Every key keeps a watch on its metadata (a new version, a delete, a meta change must
        reach every master within milliseconds); the change journal names only new keys. The
        replica list is watched only where its changes drive something: a key under-replicated
        (a copy appearing is progress to act on and to report), unacknowledged (the leader
        marks it acknowledged or rolls it back), or held here beyond its placement (dropped
        once the chosen set is complete). A fully replicated, acknowledged key - the steady
        state of nearly every key - carries no such watch: that saves a watch and its
        bookkeeping per key and per master, and a registration does not make every other
        master re-read the key. What such a key's list can still lose (a master's session
        ending) changes membership, after which the lists that master was on are read again,
        and the periodic reconcile covers the rest (a replica removed as corrupt elsewhere:
        the under-replicated figure lags by up to one pass)."""
        known = self.membership.known()
        leader = self.guard.is_leader()
        holding = self.view.holding()
        arm = self.view.entries_where(
            keys, lambda key, entry: in_motion(self.identity, key, entry, known, leader,
                                               holding))
        pending = [(key, entry, self.zk.get_children_async(key_path(key), watch=self.watcher))
                   for key, entry in arm]
        for key, entry, result in pending:
            try:
                names = result.get(timeout=self.settings.read_timeout)
            except NoNodeError:
                self.queue.put(key)  # deleted meanwhile: its data watch fired as well
                continue
            except Exception as e:
                failures.setdefault(key, e)
                continue
            # Changed since this batch read it, and no event will tell: act on the change as
            # on an event's (the read armed the watch already). A full reconcile of the key
            # here, as before, cost every follower about two more reads per create (the other
            # follower's copy registering while this one fetched).
            if self.view.holders_read(entry, names) and self._has_work(key, entry, known, leader):
                self.queue.put(key)

    def recheck_replicas(self, keys: list[str]) -> None:
        """Read the replica lists of ``keys`` again, pipelined, each read arming the list's
        watch; a key with work for this master goes to a worker (see replicas_read)."""
        last = None
        for key in keys:
            path = key_path(key)
            last = self.zk.get_children_async(path, watch=self.watcher)
            last.rawlink(functools.partial(self.replicas_read, key, path, armed=True))
        if last is not None:
            # Answers come in order: once the last is in, ZooKeeper has answered the step, so
            # a slow server slows the pace instead of queueing reads without bound.
            last.wait(self.settings.read_timeout)

    # ---- the change journal ----------------------------------------------------------------

    def on_journal(self, event: WatchedEvent) -> None:
        if event.path is None:
            self.wake.kick()
            return
        with self._journal_lock:
            if self.guard.is_leader():
                # The journal names the leader's own creates, each queued here by its commit:
                # while leading, its watch stays unarmed (re-arming it was one ZooKeeper request
                # per create). stepped_down arms it again once this master steps down; that
                # first record then shows a gap: one listing. Checked under the lock that
                # stepped_down takes, after the election clears its flag, so a step-down
                # racing this event still finds the mark.
                self._journal_unwatched = True
                return
        self._read_journal()

    def _read_journal(self) -> None:
        # Read the new record at once, from here, rather than through the work queue: workers
        # busy with a batch of fetches would let it run past the entries it keeps.
        self.zk.get_async(JOURNAL, watch=self.on_journal).rawlink(self._journal_read)

    def stepped_down(self) -> None:
        """This master stopped leading: watch the change journal again if its watch fired
        while it led (a new ZooKeeper session's full reconcile arms it anyway). With the
        recursive watch, list the keys once instead: events for new keys were passed over
        while this master led (see on_tree), and the next leader may have created keys
        before this master saw that it no longer led. The listing is sent after this master
        stopped leading, so it holds every key created before; the events of keys created
        after it are no longer passed over."""
        if self.recursive:
            log.info("no longer leading: listing the keys once, for any the next leader"
                     " created before this master saw it step down")
            self.list_keys_soon()
            return
        with self._journal_lock:
            if not self._journal_unwatched:
                return
            self._journal_unwatched = False
        self._read_journal()

    def _journal_read(self, result: Any) -> None:
        # kazoo's callback thread: parse and queue only.
        try:
            data, stat = result.get_nowait()
        except NoNodeError:
            self.zk.exists_async(JOURNAL, watch=self.on_journal)
            return
        except Exception:
            # The connection failed: the reconnect's full reconcile reads the journal again.
            return
        self._take_journal(JournalRecord.decode(data), stat.mzxid)

    def _take_journal(self, record: JournalRecord, zxid: int,
                      listing_follows: bool = False) -> None:
        """Queue the keys the journal says were created since the last record taken; list
        every key instead if some of those entries are gone from it."""
        with self._journal_lock:
            if zxid <= self._journal_zxid:
                return  # an older record answered late
            seen, self.journal_seen, self._journal_zxid = self.journal_seen, record.last, zxid
        changed = None if seen is None else record.since(seen)
        if changed:
            self.queue.put_many(list(dict.fromkeys(changed)))
        elif changed is None and not listing_follows:
            log.info("change journal moved from entry %s to %d-%d: listing every key", seen,
                     record.first, record.last)
            self.list_keys_soon()

    # ---- listings --------------------------------------------------------------------------

    def all_keys(self) -> list[str]:
        """Every key known to ZooKeeper or held locally (re-arming the journal's watch)."""
        if not self.recursive:
            # The journal first, re-arming its watch: a key created after this read shows up
            # in the journal's next change, one created before it in the listing below. (The
            # recursive watch, armed before any listing, brings new keys itself.)
            with self._journal_lock:
                self._journal_unwatched = False
            try:
                data, stat = self.zk.get(JOURNAL, watch=self.on_journal)
                self._take_journal(JournalRecord.decode(data), stat.mzxid, listing_follows=True)
            except NoNodeError:
                self.zk.exists(JOURNAL, watch=self.on_journal)
        try:
            keys = set(self.zk.get_children(BLOBSTORE))
        except NoNodeError:
            keys = set()
        # Also the keys known only from earlier reads: one deleted while no watch could tell
        # (a reconnect's gap) and not held here would keep its entry otherwise.
        viewed = self.view.keys()
        return sorted(keys | viewed | set(self.store.keys()))

    def list_keys_soon(self) -> None:
        """Queue a listing of every key, no sooner than the pacing of listings allows."""
        self.queue.put(KEY_LIST, delay=max(self._key_list_next - time.monotonic(), 0.0))

    def refresh_keys(self) -> None:
        """The queued listing (KEY_LIST): queue the keys new to this master and those gone."""
        started = time.monotonic()
        try:
            keys = set(self.zk.get_children(BLOBSTORE))
        except NoNodeError:
            keys = set()
        finally:
            ended = time.monotonic()
            self._key_list_next = ended + self.settings.key_list_pacing * (ended - started)
        known = self.view.keys()
        self.queue.put_many(sorted(keys - known))
        self.queue.put_many(sorted(known - keys))


__all__ = ["KEY_LIST", "ChangeFeed", "Wake", "describe", "session_of"]
