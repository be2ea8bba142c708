"""Background replica synchronisation on every master (ha-rules 6-12).

Watch-driven: one persistent recursive watch on ``/blobstore`` (ZooKeeper 3.6 and later, see
:func:`blobha.zk.connection.add_recursive_watch`) brings every change below it. A key's node
created, changed or deleted queues the key; a replica node created or deleted changes the key's
holders in memory, with no read, and queues the key only where this master has work on it. Worker
threads *re-read and reconcile* queued keys, so a follower starts fetching a new version within
milliseconds of its commit. The watch lasts for one connection: after each reconnect it is added
again, and everything is reconciled.

Without it (``blobstore.sync.recursive.watch`` off, or a server that refuses it), the change
journal (``/journal``, written by every leader transaction that creates a key), every key's
metadata znode and the replica lists of keys in motion carry one-shot watches whose only job is
to queue keys or update holders. New keys then come from the journal: no master lists
``/blobstore`` (linear in the number of keys) after each create; a master that missed journal
entries (they are kept for the last 128 creates) lists it once.

A periodic full reconcile (Storm's only mechanism, here a safety net, paced) catches anything
missed, and runs at once after every new ZooKeeper session, re-registering this master's replica
nodes. When masters come and go, only what moves is looked at: the departed master's replica
nodes (gone with its session: events, or a read of each list it was on without the recursive
watch), and the keys whose placement changes.

Reconciling a key means:

* key gone from ZooKeeper: after the delete grace, drop the local copy; never re-create or
  re-register it (deletes flow one way);
* this master is one of the key's holders (:mod:`blobha.core.placement`) and lacks the committed
  version: fetch it from a live replica at that version, verify, install, then register;
* it holds the committed version: make sure its ephemeral replica node exists in this session;
* it holds a copy it is no longer meant to hold: drop it only once every chosen holder has it;
* prune versions older than the retained window.

One failing key is logged and retried with backoff; the loop itself never stops.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, suppress
from dataclasses import dataclass
from typing import Any

from blobha.sync.membership import IdentityInUse, Membership
from blobha.sync.peers import Peers
from blobha.sync.workqueue import WorkQueue
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    KazooException,
    NodeExistsError,
    NoNodeError,
    UnimplementedError,
    ZookeeperError,
)
from kazoo.protocol.states import EventType, WatchedEvent

from blobha.core import placement
from blobha.core.errors import BlobError
from blobha.store.local import BlobBuffer, LocalStore, TempBlob
from blobha.zk import layout as zkstate
from blobha.zk.connection import UNREACHABLE, ReadResult, add_recursive_watch, read_many_async
from blobha.zk.layout import (
    BLOBSTORE,
    JOURNAL,
    BlobState,
    JournalRecord,
    key_path,
    parse_replica,
    replica_path,
)

log = logging.getLogger(__name__)

# Queue entry meaning "re-read the list of keys" (after a gap in the change journal); never a
# valid key (keys are non-empty).
_KEY_LIST = ""
#: A listing follows the last no sooner than this many times its duration after it: listings
#: then take at most 1/(1+KEY_LIST_PACING) of the time.
KEY_LIST_PACING = 4.0

#: Keys a worker takes at once: their ZooKeeper reads are pipelined (one round trip for the
#: batch instead of two per key) and their replica nodes registered in a few transactions.
BATCH = 200
#: Reads per multiRead request: records are a few hundred bytes (1 MB at most), so an answer
#: stays small while the per-request costs are shared.
MULTI_READS = 50
#: Replica nodes created per ZooKeeper transaction (a multi-op is one request, well under
#: jute.maxbuffer at this size).
REGISTER_BATCH = 100
#: Creates of one replica node before giving up until the next pass (each failed one found
#: another session's node in the way).
REGISTER_ATTEMPTS = 3
#: Blobs up to this size are fetched into memory and installed a batch at a time (two
#: file-system syncs per batch); bigger ones stream to a temp file and install one by one.
SMALL_BLOB = 64 * 1024
#: Versions asked for in one FetchVersions call (a master serves up to 1,000).
FETCH_BATCH = 200
_PACE_STEP = 0.25
# Replica lists each master re-reads per second after masters leave (one read per key):
# 100,000 keys in under a minute, at a fraction of the periodic pass's cost per key.
_RECHECK_KEYS_PER_SEC = 2000
#: Bound on waiting for one pipelined ZooKeeper answer; a dead connection fails sooner.
_READ_TIMEOUT = 60.0
#: How long the queue holds no batch beyond a short hold after one showed a writer waiting for
#: this master's copy (see WorkQueue.hurry): long enough to span such a writer's gaps.
_HURRY_SECS = 2.0
#: At most this many keys' creations are followed from their events (_born); past it, keys
#: are read with their lists as before.
_BORN_MAX = 10_000
#: While ZooKeeper is out of reach, the keys whose sync failed for it are reported in one
#: warning per this many seconds, not one per key and retry (a master syncing 100,000 keys
#: wrote 580,000 such lines in one minute-long outage).
UNREACHABLE_REPORT_SECS = 10.0
#: A reconcile this soon after the leader's commit arms the replica list's watch with its
#: first read (see Synchronizer.registered): the other holders are most likely still fetching
#: then, so the list is due to move. One that comes later (a backlog) reads it plainly, so
#: that no watch is left on a key whose copies were all in place already.
ARM_ON_READ_SECS = 0.25


class SyncDeferred(Exception):
    """Nothing to fetch from right now; the key is retried when a replica registers."""


@dataclass(frozen=True)
class KeyView:
    state: BlobState
    #: Addresses of the masters holding ``state.seq``, sorted.
    holders: tuple[str, ...]


#: A typical metadata record, as preset dictionary for packing records in memory: the field
#: names and usual values then cost a few bits each.
_META_DICT = (
    b'{"seq":1,"size":0,"digest":"","acl":"u:alice:rwa,o::r","replication_factor":3,'
    b'"creator":"","created_at":1700000000.000000,"updated_at":1700000000.000000,"epoch":1,'
    b'"acked":true,"write_quorum":1,"history":[{"seq":1,"size":0,"digest":"","write_tag":""}],'
    b'"write_tag":""}'
)
# Raw deflate with a 2 KiB window and little state: packing a record takes microseconds.
_PACK_WBITS = -11


def _pack(data: bytes) -> bytes:
    """A metadata record packed for keeping in memory (a 260-byte record takes about 85)."""
    c = zlib.compressobj(6, zlib.DEFLATED, _PACK_WBITS, 1, zlib.Z_DEFAULT_STRATEGY, _META_DICT)
    return c.compress(data) + c.flush()


def _unpack(packed: bytes) -> bytes:
    d = zlib.decompressobj(_PACK_WBITS, _META_DICT)
    return d.decompress(packed) + d.flush()


class _Entry:
    """What this master last read of one key, kept compact: a cluster holds 100,000s of keys
    and every master keeps one entry per key. The metadata stays as the znode's bytes, packed
    (unpacked and decoded only when a caller wants the full state: the status page, a read
    during a ZooKeeper outage); the fields the figures need on every status call are kept
    decoded."""

    __slots__ = ("acked", "data", "holders", "meta_version", "registered", "rf", "seq")

    def __init__(self, data: bytes, meta_version: int, seq: int, rf: int, acked: bool,
                 holders: tuple[str, ...], registered: int) -> None:
        #: The metadata znode's bytes, packed (_pack).
        self.data = data
        self.meta_version = meta_version
        self.seq = seq
        self.rf = rf
        self.acked = acked
        #: Addresses (interned: a handful of distinct strings) holding ``seq``, sorted.
        self.holders = holders
        #: The ZooKeeper session in which our replica node of ``seq`` was verified (0: not).
        self.registered = registered

    def view(self) -> KeyView:
        state = BlobState.decode(_unpack(self.data), self.meta_version)
        return KeyView(state, self.holders)


# Canonical holder tuples: nearly every key has the same few holder sets (with three masters,
# all three), so entries share one tuple instead of 100,000s of equal ones.
_holder_sets: dict[tuple[str, ...], tuple[str, ...]] = {}


def _canonical(holders: tuple[str, ...]) -> tuple[str, ...]:
    if len(_holder_sets) > 4096:
        _holder_sets.clear()  # bounded: membership churn over years cannot grow it forever
    return _holder_sets.setdefault(holders, holders)


def _holders(names: list[str], seq: int) -> tuple[str, ...]:
    return _canonical(tuple(sys.intern(a) for a in zkstate.holders(names, seq)))


def _describe(error: Exception) -> str:
    """An error for a log line: kazoo's connection errors have no message of their own."""
    return str(error) or type(error).__name__


def _chosen(me: str, key: str, rf: int, known: set[str] | frozenset[str]) -> bool:
    """Whether ``me`` is among the holders the placement chooses for ``key`` with replication
    factor ``rf`` (capped at the masters known)."""
    rf = min(rf, max(len(known), 1))
    # With rf >= the masters known, every one of them is chosen: skip the hashing.
    return me in known if rf >= len(known) else me in placement.choose(key, known, rf)


@dataclass(frozen=True)
class SyncSettings:
    replica_grace_secs: float
    delete_grace_secs: float
    period_secs: float
    versions_retained: int
    threads: int
    #: Pace of the periodic safety-net pass. At 2,000 keys a second per master the passes
    #: made two to seven times the ZooKeeper traffic of the creates themselves at 20,000 keys
    #: and halved the create rate; watches, not this pass, keep replicas current.
    periodic_keys_per_sec: float
    #: Follow ``/blobstore`` with one persistent recursive watch (ZooKeeper 3.6 and later)
    #: instead of the change journal and a one-shot watch per key (the masters set it from
    #: ``blobstore.sync.recursive.watch``, on by default).
    recursive_watch: bool = True
    #: How long a key may wait for others to join its batch while another batch is being
    #: handled or a stream of writes goes on (see blobha.sync.workqueue;
    #: ``blobstore.sync.linger.secs``).
    linger_secs: float = 0.0


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
        self.queue = WorkQueue(linger=settings.linger_secs)
        self._view: dict[str, _Entry] = {}
        self._view_lock = threading.Lock()
        # Replica nodes the leader's commit transactions created, for keys whose view entry
        # was not at that version yet: the next reconcile takes them as registered instead of
        # asking ZooKeeper again. Emptied as those reconciles run (or the keys go).
        self._committed_here: dict[str, tuple[int, int]] = {}
        #: Commits this master made as leader, counted; and per key, the count at its last
        #: commit not yet followed by a read (see _decide).
        self._commits = 0
        self._commit_marks: dict[str, int] = {}
        # The keys this master's commit created and registered() made an entry for (from the
        # events held in _born since creating()), with its version: the commit path's follow()
        # then queues no reconcile. Guarded by _view_lock.
        self._made_here: dict[str, int] = {}
        self._key_list_next = 0.0  # monotonic time before which the key list is not re-read
        # The last change-journal record acted on: its last entry (None: not read yet) and the
        # zxid that wrote it (answers can arrive out of order; older ones are ignored).
        self._journal_seen: int | None = None
        self._journal_zxid = -1
        self._journal_lock = threading.Lock()
        # The journal's watch fired while this master led and was left unarmed (stepped_down
        # arms it again when this master steps down). Guarded by _journal_lock.
        self._journal_unwatched = False
        # Keys whose next reconcile arms the watch on their replica list with its first read
        # (see registered), with the time of their commit. Guarded by _view_lock.
        self._arm_on_read: dict[str, float] = {}
        # Keys whose batch read armed that watch, until their reconcile has stored what it
        # read: whether the list changed meanwhile (then the stored holders may be older than
        # what the event's read found, and the list is read once more). Guarded by _view_lock.
        self._arming: dict[str, bool] = {}
        # Whether /blobstore is followed with one persistent recursive watch (_on_tree); it
        # falls back to the one-shot watches if ZooKeeper refuses it.
        self._recursive = settings.recursive_watch
        #: Whether reads of many keys go in multiRead requests (with the recursive watch).
        self._multi_read = True
        # With it, the keys being read by a batch, each with the replica-node events (holder,
        # version, present) that arrived since its read was sent: replayed onto what the read
        # found once it is stored (see _decide). Guarded by _view_lock.
        self._reading: dict[str, list[tuple[str, int, bool]]] = {}
        # With it, the keys whose creation this master saw (a follower) or is committing (the
        # leader, see creating()), each with the replica-node events since (the creating
        # transaction's own node among them): their replica list is exactly those, so a
        # follower's reconcile reads the key's node and not its list, and the leader makes the
        # entry from its commit without a read. Emptied on every change of the connection
        # (events may be missed then); at most _BORN_MAX keys from events. Guarded by
        # _view_lock.
        self._born: dict[str, list[tuple[str, int, bool]]] = {}
        # With it, the keys of the batches under way, each with whether replica-node events
        # changed its holders meanwhile (acted on when its batch ends). Guarded by _view_lock.
        self._batch_moved: dict[str, bool] = {}
        # With it, the keys of the batches under way whose node was deleted meanwhile: what the
        # batch read may be of that earlier incarnation, and a copy of it must not be registered
        # under the next one's version number. Guarded by _view_lock.
        self._deleted_in_batch: set[str] = set()
        # Bumped on every change of _view, so figures() recomputes only when something moved.
        self._generation = 0
        # The last figures: (generation, masters known), when the view behind them was read
        # (monotonic clock), and the figures. Guarded by _figures_lock.
        self._figures: tuple[tuple[int, frozenset[str]], float, tuple[int, int, int]] | None = (
            None)
        self._figures_lock = threading.Lock()
        # For the keys this master lacks, whether the placement chooses it, with the factor it
        # was decided for; valid for the masters in _placed_for. The hashing was most of a
        # pass's cost (0.2 s at 100,000 keys on five masters), and a pass runs at every status
        # check under writes; now only a new key, or a new membership, costs a hash. Guarded
        # by _figures_lock.
        self._placed: dict[str, tuple[int, bool]] = {}
        self._placed_for: frozenset[str] = frozenset()
        self._deleted_since: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        # Keys whose sync failed on an unreachable ZooKeeper since the last report of it, and
        # when that report was (see _report_unreachable).
        self._unreachable = 0
        self._unreachable_reported = -math.inf
        self._unreachable_lock = threading.Lock()
        self._session: int | None = None
        # Downloads of one batch run in parallel: a small blob's fetch is a few round trips
        # and fsyncs, not CPU, so one at a time would leave the machine idle.
        self._fetchers = ThreadPoolExecutor(max_workers=settings.threads,
                                            thread_name_prefix="sync-fetch")
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._full_requested = False
        self._threads: list[threading.Thread] = []
        # One bound method for every key's watch: kazoo keeps the watcher it is given in a set
        # per path, and `self._on_event` makes a new object on each access (64 bytes per key
        # held for as long as the watch is armed, on every master).
        self._watcher = self._on_event
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
        self._fetchers.shutdown(wait=False, cancel_futures=True)

    def reconcile_all(self) -> None:
        """Queue every key known to ZooKeeper or held locally (and re-arm the journal watch)."""
        self.queue.put_many(self._all_keys())

    def _all_keys(self) -> list[str]:
        if not self._recursive:
            # The journal first, re-arming its watch: a key created after this read shows up
            # in the journal's next change, one created before it in the listing below. (The
            # recursive watch, armed before any listing, brings new keys itself.)
            with self._journal_lock:
                self._journal_unwatched = False
            try:
                data, stat = self.zk.get(JOURNAL, watch=self._on_journal)
                self._take_journal(JournalRecord.decode(data), stat.mzxid, listing_follows=True)
            except NoNodeError:
                self.zk.exists(JOURNAL, watch=self._on_journal)
        try:
            keys = set(self.zk.get_children(BLOBSTORE))
        except NoNodeError:
            keys = set()
        with self._view_lock:
            # Also the keys known only from earlier reads: one deleted while no watch could
            # tell (a reconnect's gap) and not held here would keep its entry otherwise.
            viewed = set(self._view)
        return sorted(keys | viewed | set(self.store.keys()))

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
            entry = self._view.get(key)
        return entry.view() if entry is not None else None

    def figures(self) -> tuple[int, int, int]:
        """(keys, keys with fewer holders than their replication factor, keys this master
        should hold but lacks), as of a moment during the call.

        A pass over every key (with the placement hash of each key this master lacks: a second
        and more at 100,000 keys on five masters) whenever the view has moved, which under
        writes is at every call. So one pass runs at a time, and callers that waited for it
        take its answer when it began after they asked: concurrent status checks cost one
        pass, not one each."""
        asked = time.monotonic()
        with self._figures_lock:
            return self._figures_since(asked)

    def _figures_since(self, asked: float) -> tuple[int, int, int]:
        known = frozenset(self.membership.known())
        last = self._figures
        with self._view_lock:
            stamp = (self._generation, known)
            if last is not None and (last[0] == stamp or last[1] > asked):
                return last[2]
            taken = time.monotonic()
            entries = list(self._view.items())
        result = (len(entries), *self._count(entries, known))
        self._figures = (stamp, taken, result)
        return result

    def _count(self, entries: list[tuple[str, _Entry]], known: frozenset[str]
               ) -> tuple[int, int]:
        """One pass of :meth:`figures` (its lock held): the under-replicated keys, and the
        keys this master should hold but lacks."""
        me = self.identity
        under = lag = 0
        before = self._placed if self._placed_for == known else {}
        placed: dict[str, tuple[int, bool]] = {}  # only keys still lacking: none left behind
        for key, e in entries:
            # Against the factor asked for, not the capped one: a blob that wants 3 copies in a
            # cluster with a dead master is under-replicated, and operators should see it.
            if len(e.holders) < e.rf:
                under += 1
            if me not in e.holders:
                decided = before.get(key)
                if decided is None or decided[0] != e.rf:
                    decided = (e.rf, _chosen(me, key, e.rf, known))
                placed[key] = decided
                lag += decided[1]
        self._placed, self._placed_for = placed, known
        return under, lag

    # ---- events (kazoo's event thread: hand off only) -------------------------------------

    def _on_state(self, state: str) -> None:
        with self._view_lock:
            self._born.clear()
        if state == KazooState.CONNECTED:
            # kazoo does not re-send watches after a reconnect, even within one session: look
            # at everything again, which re-arms them.
            self._full_requested = True
            self._kick.set()

    def _watch_tree(self) -> None:
        """Arm the persistent recursive watch on /blobstore for this connection (called before
        each full reconcile, whose reads then cover whatever changed while it was not armed)."""
        try:
            # Inline: _on_tree takes a lock and queues, nothing more; on kazoo's callback
            # thread each of the several events per write cost a hand-over between threads.
            add_recursive_watch(self.zk, BLOBSTORE, self._on_tree, timeout=_READ_TIMEOUT,
                                inline=True)
        except UnimplementedError as e:
            # What a server before 3.6 answers an operation it does not know. Anything else
            # (a lost connection, a server error) is retried by the caller.
            log.warning("ZooKeeper refused a persistent recursive watch on %s (%s); it needs"
                        " ZooKeeper 3.6 or later. Following changes with the change journal"
                        " and one-shot watches instead", BLOBSTORE, _describe(e))
            self._recursive = False

    def _on_tree(self, event: WatchedEvent) -> None:
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
        if not sep:
            if event.type == EventType.DELETED:
                with self._view_lock:
                    self._born.pop(key, None)
                    if key in self._batch_moved:
                        self._deleted_in_batch.add(key)
            if event.type == EventType.CREATED and self._is_leader():
                # The leader's own commit, which queues the key itself: a second reconcile
                # would cost two more reads per create. A create by an earlier leader is in the
                # listing of the full reconcile a new leader runs, and one by the next leader,
                # before this master saw it step down, in the listing stepped_down asks for.
                return
            if event.type == EventType.CREATED:
                with self._view_lock:
                    if len(self._born) < _BORN_MAX:
                        self._born[key] = []
            self.queue.put(key)
            return
        if "/" in name or event.type not in (EventType.CREATED, EventType.DELETED):
            return
        parsed = parse_replica(name)
        if parsed is None:
            return
        change = (parsed[0], parsed[1], event.type == EventType.CREATED)
        with self._view_lock:
            born = self._born.get(key)
            if born is not None:
                born.append(change)
            pending = self._reading.get(key)
            if pending is not None:
                pending.append(change)
            entry = self._view.get(key)
            moved = entry is not None and self._apply_replica(entry, *change)
            if key in self._batch_moved:
                # A worker has the key: the end of its batch looks at what moved (see
                # _reconcile).
                self._batch_moved[key] = self._batch_moved[key] or moved
                return
        if moved and entry is not None and self._has_work(
                key, entry, self.membership.known(), self._is_leader()):
            self.queue.put(key)

    def _list_keys_soon(self) -> None:
        """Queue a listing of every key, no sooner than the pacing of listings allows."""
        self.queue.put(_KEY_LIST, delay=max(self._key_list_next - time.monotonic(), 0.0))

    def _apply_replica(self, entry: _Entry, holder: str, seq: int, present: bool) -> bool:
        """Apply one replica-node event to ``entry`` (lock held); whether its holders changed.
        Events of other versions do not count (a newer version's own event queues its key)."""
        return seq == entry.seq and self._set_holder(entry, holder, present)

    def _set_holder(self, entry: _Entry, holder: str, present: bool) -> bool:
        """Add or remove ``holder`` in ``entry``'s holders (lock held); whether they changed."""
        if (holder in entry.holders) == present:
            return False
        if present:
            holders = (*entry.holders, sys.intern(holder))
        else:
            holders = tuple(h for h in entry.holders if h != holder)
        entry.holders = _canonical(tuple(sorted(holders)))
        self._generation += 1
        return True

    def _on_event(self, event: WatchedEvent) -> None:
        if event.path is None:
            # A session event (kazoo fires pending watches this way when a session expires):
            # every watch is gone, so look at everything again.
            self._kick.set()
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
                with self._view_lock:
                    entry = self._view.get(key)
                    arm = entry is not None and len(entry.holders) + 1 < entry.rf
                    if key in self._arming:
                        self._arming[key] = True
                self.zk.get_children_async(
                    event.path, watch=self._watcher if arm else None).rawlink(
                    functools.partial(self._replicas_read, key, event.path, armed=arm))
                return
            self.queue.put(key)

    def _replicas_read(self, key: str, path: str, result: Any, armed: bool = False) -> None:
        # kazoo's callback thread: no blocking calls here. ``armed``: this read set the watch.
        try:
            names = result.get_nowait()
        except Exception:
            self.queue.put(key)  # deleted (its data watch fires too) or the connection failed
            return
        known = self.membership.known()
        leader = self._is_leader()
        with self._view_lock:
            entry = self._view.get(key)
            if entry is not None:
                holders = _holders(names, entry.seq)
                if holders != entry.holders:
                    entry.holders = holders
                    self._generation += 1
        if entry is None or self._has_work(key, entry, known, leader):
            self.queue.put(key)
        elif not armed and self._in_motion(key, entry, known, leader):
            # Still under-replicated, and nothing for this master to do but follow it (its
            # figures): re-arm the watch with one more read, instead of a worker's reconcile of
            # the key (three reads) on every master for every copy registered elsewhere.
            self.zk.get_children_async(path, watch=self._watcher).rawlink(
                functools.partial(self._replicas_rearmed, key))

    def _replicas_rearmed(self, key: str, result: Any) -> None:
        # kazoo's callback thread. The watch is armed; a change between the two reads fires
        # no event, so it is compared here.
        try:
            names = result.get_nowait()
        except Exception:
            self.queue.put(key)
            return
        with self._view_lock:
            entry = self._view.get(key)
            moved = entry is None or _holders(names, entry.seq) != entry.holders
        if moved:
            self.queue.put(key)

    def _has_work(self, key: str, entry: _Entry, known: set[str], leader: bool) -> bool:
        """Whether a change of ``key``'s replica list may leave this master something to do
        beyond following it: acknowledge or roll back (the leader, for an unacknowledged
        version), fetch, register, drop a copy held beyond the placement, or find out why its
        registered copy left the list."""
        if leader and not entry.acked:
            return True
        target = _chosen(self.identity, key, entry.rf, known)
        if self.identity in entry.holders:
            session = self.session_id()
            return not target or entry.registered != session or not session
        return target or entry.registered != 0

    def _on_journal(self, event: WatchedEvent) -> None:
        if event.path is None:
            self._kick.set()
            return
        with self._journal_lock:
            if self._is_leader():
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
        self.zk.get_async(JOURNAL, watch=self._on_journal).rawlink(self._journal_read)

    def stepped_down(self) -> None:
        """This master stopped leading: watch the change journal again if its watch fired
        while it led (a new ZooKeeper session's full reconcile arms it anyway). With the
        recursive watch, list the keys once instead: events for new keys were passed over
        while this master led (see _on_tree), and the next leader may have created keys
        before this master saw that it no longer led. The listing is sent after this master
        stopped leading, so it holds every key created before; the events of keys created
        after it are no longer passed over."""
        if self._recursive:
            log.info("no longer leading: listing the keys once, for any the next leader"
                     " created before this master saw it step down")
            self._list_keys_soon()
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
            self.zk.exists_async(JOURNAL, watch=self._on_journal)
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
            seen, self._journal_seen, self._journal_zxid = self._journal_seen, record.last, zxid
        changed = None if seen is None else record.since(seen)
        if changed:
            self.queue.put_many(list(dict.fromkeys(changed)))
        elif changed is None and not listing_follows:
            log.info("change journal moved from entry %s to %d-%d: listing every key", seen,
                     record.first, record.last)
            self._list_keys_soon()

    def membership_changed(self) -> None:
        self._kick.set()

    # ---- loops --------------------------------------------------------------------------

    def _periodic(self) -> None:
        next_full = 0.0
        paced: list[str] = []  # keys of the periodic pass still to hand to the workers
        recheck: list[str] = []  # keys whose replica list to read again, after departures
        placed: frozenset[str] = frozenset()  # the masters placement last acted on (the first
        # pass is a full reconcile, which sets it)
        while not self._stop.is_set():
            grace = self.membership.next_grace_expiry()
            # Capped at a period: next_full is infinite while a paced pass is handed out, and
            # a failure can leave it so (Event.wait(inf) overflows and would end the thread).
            wait = max(0.0, min(next_full - time.monotonic(), self.settings.period_secs))
            if grace is not None:
                wait = min(wait, grace + 0.05)
            if paced or recheck:
                wait = min(wait, _PACE_STEP)
            self._kick.wait(timeout=wait)
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                if self.zk.state != KazooState.CONNECTED:
                    continue
                session = self.session_id() or None
                full = self._full_requested
                if session != self._session:
                    # ha-rule 6: a new session lost every ephemeral node; put them back.
                    log.info("new ZooKeeper session %s: re-registering and reconciling", session)
                    self.membership.register()
                    # Every entry's `registered` names the old session, so each replica node
                    # is verified (and re-created if need be) again.
                    self._session = session
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
                    self._full_requested = False
                    if self._recursive:
                        try:
                            self._watch_tree()
                        except Exception:
                            self._full_requested = True  # tried again after the pause below
                            raise
                    paced, recheck = [], []
                    placed = known
                    try:
                        self.reconcile_all()
                    except Exception:
                        # Still owed (a new session's replica nodes are re-created by it):
                        # tried again after the pause below, not a whole period later.
                        self._full_requested = True
                        raise
                    finally:
                        next_full = time.monotonic() + self.settings.period_secs
                else:
                    recheck = self._follow_membership(placed, known, departed) + recheck
                    placed = known
                    if not paced and time.monotonic() >= next_full:
                        # The safety net only: fed at a bounded rate, so at 100,000s of keys it
                        # neither takes a core nor queues every key ahead of the changes events
                        # bring (a new version would otherwise wait behind the whole pass).
                        paced = self._all_keys()
                        paced.reverse()  # handed out from the end: in key order
                        next_full = math.inf  # until the pass is handed out, below
                if paced:
                    step = max(1, int(self.settings.periodic_keys_per_sec * _PACE_STEP))
                    self.queue.put_many(paced[:-step - 1:-1])
                    del paced[-step:]
                if not paced and next_full == math.inf:
                    # The pass is handed out, or found no key at all: the next one is a period
                    # away (left at infinity, the wait above would overflow and end the thread).
                    next_full = time.monotonic() + self.settings.period_secs
                if recheck:
                    step = int(_RECHECK_KEYS_PER_SEC * _PACE_STEP)
                    self._recheck_replicas(recheck[-step:])
                    del recheck[-step:]
            except IdentityInUse as e:
                # Our session was lost and another master took our name meanwhile: nothing
                # here is registered until it goes.
                log.error("cannot register again: %s", e)
                self._stop.wait(5.0)
                self._kick.set()
            except Exception:
                log.exception("periodic reconcile failed; retrying shortly")
                self._stop.wait(1.0)
                self._kick.set()

    def _follow_membership(self, placed: frozenset[str], known: frozenset[str],
                           departed: set[str]) -> list[str]:
        """Act on masters coming and going; the keys whose replica lists to read again."""
        if known != placed:
            # A master joined, or one gone for longer than the grace: reconcile at once only
            # the keys this master is now to hold or to give up.
            moved = self._placement_moved(placed, known)
            log.info("masters now %s (were %s): %d keys move here or away", sorted(known),
                     sorted(placed), len(moved))
            self.queue.put_many(moved)
        # Departed masters' replica nodes went with their sessions, and a fully replicated
        # key's list carries no watch: read the lists again (paced), so the figures show the
        # keys under-replicated and the copies a returning master registers are followed.
        # Placement keeps departed masters for the grace period, so nothing is fetched or
        # dropped because of this. (The recursive watch brings each of those nodes' deletion
        # as an event: nothing to read.)
        return self._held_by(departed) if departed and not self._recursive else []

    def _placement_moved(self, before: frozenset[str], after: frozenset[str]) -> list[str]:
        """The keys for which placement chooses this master under one set of masters and not
        under the other (a key held by all of them either way, the common case when the
        replication factor is at least the number of masters, is not among them)."""
        me = self.identity
        with self._view_lock:
            entries = [(key, e.rf) for key, e in self._view.items()]
        return [key for key, rf in entries
                if _chosen(me, key, rf, before) != _chosen(me, key, rf, after)]

    def _held_by(self, masters: set[str]) -> list[str]:
        with self._view_lock:
            return [key for key, e in self._view.items() if not masters.isdisjoint(e.holders)]

    def _recheck_replicas(self, keys: list[str]) -> None:
        """Read the replica lists of ``keys`` again, pipelined, each read arming the list's
        watch; a key with work for this master goes to a worker (see _replicas_read)."""
        last = None
        for key in keys:
            path = key_path(key)
            last = self.zk.get_children_async(path, watch=self._watcher)
            last.rawlink(functools.partial(self._replicas_read, key, path, armed=True))
        if last is not None:
            # Answers come in order: once the last is in, ZooKeeper has answered the step, so
            # a slow server slows the pace instead of queueing reads without bound.
            last.wait(_READ_TIMEOUT)

    def _worker(self) -> None:
        while True:
            keys = self.queue.get_batch(BATCH)
            if not keys:
                return
            try:
                failures = self._handle(keys)
            except Exception as e:  # a bug in the batch logic must not kill the loop
                log.exception("sync batch failed")
                failures = dict.fromkeys(keys, e)
            self._after_batch(keys, failures)
            self.queue.done_many(keys)

    def _after_batch(self, keys: list[str], failures: dict[str, Exception]) -> None:
        """Retry the keys that failed, with backoff; warn of each failure, except those of an
        unreachable ZooKeeper, which are counted into one warning now and then."""
        unreachable: list[Exception] = []
        for key in keys:
            error = failures.get(key)
            if error is None:
                self._failures.pop(key, None)
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
            if now - self._unreachable_reported < UNREACHABLE_REPORT_SECS:
                return
            count, self._unreachable, self._unreachable_reported = self._unreachable, 0, now
        log.warning("sync of %d key(s) could not reach ZooKeeper (%s); each is retried with"
                    " backoff, and the reconnect reconciles every key", count,
                    _describe(error))

    def _retry_later(self, key: str, error: Exception | None = None, quiet: bool = False) -> None:
        n = self._failures[key] = self._failures.get(key, 0) + 1
        delay = min(30.0, 0.2 * 2 ** min(n, 8)) * random.uniform(0.5, 1.0)
        if error is not None and not quiet:
            if isinstance(error, BlobError | KazooException):
                log.warning("sync of %r failed (%s); retry %d in %.1fs", key, _describe(error),
                            n, delay)
            else:
                log.exception("sync of %r failed; retry %d in %.1fs", key, n, delay,
                              exc_info=error)
        if not self._stop.is_set():
            self.queue.put(key, delay=delay)

    # ---- reconcile ----------------------------------------------------------------------

    def _refresh_keys(self) -> None:
        started = time.monotonic()
        try:
            keys = set(self.zk.get_children(BLOBSTORE))
        except NoNodeError:
            keys = set()
        finally:
            ended = time.monotonic()
            self._key_list_next = ended + KEY_LIST_PACING * (ended - started)
        with self._view_lock:
            known = set(self._view)
        self.queue.put_many(sorted(keys - known))
        self.queue.put_many(sorted(known - keys))

    def _handle(self, keys: list[str]) -> dict[str, Exception]:
        """Reconcile a batch of keys; the failures, per key (the others succeeded)."""
        failures: dict[str, Exception] = {}
        if _KEY_LIST in keys:
            try:
                self._refresh_keys()
            except Exception as e:
                failures[_KEY_LIST] = e
            keys = [k for k in keys if k != _KEY_LIST]
        now = time.monotonic()
        with self._view_lock:
            armed: set[str] = set()
            for key in keys:
                committed_at = self._arm_on_read.pop(key, None)
                if committed_at is not None and now - committed_at < ARM_ON_READ_SECS:
                    armed.add(key)
                    self._arming[key] = False
        try:
            return self._reconcile(keys, armed, failures)
        finally:
            if armed:
                with self._view_lock:
                    for key in armed:
                        self._arming.pop(key, None)

    def _reconcile(self, keys: list[str], armed: set[str], failures: dict[str, Exception]
                   ) -> dict[str, Exception]:
        if not self._recursive:
            return self._reconcile_batch(keys, armed, failures)
        # The recursive watch's replica events for these keys are held until the batch ends
        # (see _on_tree): a follower fetching a key had work on it when the other holders
        # registered, and each of their events sent the key round again, to find its work done
        # (two more reads per follower per create).
        listless: set[str] = set()
        with self._view_lock:
            for key in keys:
                born = self._born.pop(key, None)
                if born is not None and key not in self._reading:
                    # Every event since the key's creation: they are its replica list.
                    self._reading[key] = born
                    listless.add(key)
                else:
                    self._reading.setdefault(key, [])
                self._batch_moved[key] = False
        try:
            return self._reconcile_batch(keys, armed, failures, listless)
        finally:
            with self._view_lock:
                moved = [key for key in keys if self._batch_moved.pop(key, False)]
                self._deleted_in_batch.difference_update(keys)
                for key in keys:
                    self._reading.pop(key, None)
            self._act_on_moved(moved)

    def _reconcile_batch(self, keys: list[str], armed: set[str],
                         failures: dict[str, Exception],
                         listless: frozenset[str] | set[str] = frozenset()
                         ) -> dict[str, Exception]:
        """Reconcile ``keys``; those in ``listless`` have their replica lists in the events
        held for them (see _born), and only their nodes are read."""
        to_fetch: list[tuple[str, BlobState, list[str]]] = []
        to_register: list[tuple[str, int]] = []
        with self._view_lock:
            read_mark = self._commits  # before the reads are sent
        reads = self._read_many(keys, armed, listless)
        seen: list[str] = []
        for key, read in reads.items():
            try:
                if isinstance(read, Exception):
                    raise read
                if read is None:
                    # A commit after this read re-created the key: its mark stays, for the
                    # read that commit's reconcile makes (_key_gone re-checks anyway).
                    self._read_is_current(key, read_mark, spend=True)
                    self._key_gone(key)
                    continue
                seen.append(key)
                action = self._decide(key, *read, read_mark=read_mark,
                                      from_events=key in listless)
                if isinstance(action, tuple):
                    to_fetch.append((key, action[0], action[1]))
                elif action is not None:
                    to_register.append((key, action))
            except Exception as e:
                failures[key] = e
        if any(not state.acked and state.write_quorum > 1 for _, state, _ in to_fetch):
            # A writer waits for these copies: held for the linger, each of its next writes
            # would wait for it too.
            self.queue.hurry(_HURRY_SECS)
        if armed:
            # What _decide stored for these keys is what the batch read found; where the list
            # changed since, an event's newer read may have been overwritten: read it again.
            with self._view_lock:
                armed = {key for key in armed if not self._arming.get(key, True)}
        fetched, done, fresh = self._fetch_all(to_fetch, failures, read_mark)
        to_register += done
        installed = self._install_fetched(fetched, read_mark)
        failures.update(installed)
        to_register += [(key, state.seq) for key, state, _ in fetched if key not in installed]
        to_register = self._drop_deleted(to_register, failures)
        # Only now, with every byte durable and verified, do the replica nodes appear (ha-rule 7).
        failures.update(self._register_many(to_register))
        self._undo_deleted(to_register, failures)
        for key, state, _ in to_fetch:
            # A key that had no version here has nothing to prune (a listing saved per key).
            if key not in failures and key not in fresh:
                try:
                    self._prune(key, state.seq)
                except Exception as e:
                    failures[key] = e
        if not self._recursive:
            self._watch_replicas([key for key in seen if key not in armed], failures)
        return failures

    def _act_on_moved(self, keys: list[str]) -> None:
        """Keys whose holders replica-node events changed during their batch: back to a worker
        where that leaves this master something to do, now that the batch has done its part."""
        if not keys:
            return
        known = self.membership.known()
        leader = self._is_leader()
        with self._view_lock:
            work = [key for key in keys if (entry := self._view.get(key)) is not None
                    and self._has_work(key, entry, known, leader)]
        self.queue.put_many(work)

    def _watch_replicas(self, keys: list[str], failures: dict[str, Exception]) -> None:
        """Arm a watch on the replica list of the keys still in motion, with a fresh read.

        Every key keeps a watch on its metadata (a new version, a delete, a meta change must
        reach every master within milliseconds); the change journal names only new keys. The
        replica list
        is watched only where its changes drive something: a key under-replicated (a copy
        appearing is progress to act on and to report), unacknowledged (the leader marks it
        acknowledged or rolls it back), or held here beyond its placement (dropped once the
        chosen set is complete). A fully replicated, acknowledged key - the steady state of
        nearly every key - carries no such watch: that saves a watch and its bookkeeping per
        key and per master, and a registration does not make every other master re-read the
        key. What such a key's list can still lose (a master's session ending) changes
        membership, after which the lists that master was on are read again, and the periodic
        reconcile covers the rest (a replica removed as corrupt elsewhere: the
        under-replicated figure lags by up to one pass)."""
        known = self.membership.known()
        leader = self._is_leader()
        arm: list[tuple[str, _Entry]] = []
        with self._view_lock:
            for key in keys:
                entry = self._view.get(key)
                if entry is not None and self._in_motion(key, entry, known, leader):
                    arm.append((key, entry))
        pending = [(key, entry, self.zk.get_children_async(key_path(key), watch=self._watcher))
                   for key, entry in arm]
        for key, entry, result in pending:
            try:
                names = result.get(timeout=_READ_TIMEOUT)
            except NoNodeError:
                self.queue.put(key)  # deleted meanwhile: its data watch fired as well
                continue
            except Exception as e:
                failures.setdefault(key, e)
                continue
            holders = _holders(names, entry.seq)
            if holders != entry.holders:
                # Changed since this batch read it, and no event will tell: act on the change
                # as on an event's (the read armed the watch already). A full reconcile of
                # the key here, as before, cost every follower about two more reads per create
                # (the other follower's copy registering while this one fetched).
                with self._view_lock:
                    entry.holders = holders
                    self._generation += 1
                if self._has_work(key, entry, known, leader):
                    self.queue.put(key)

    def _in_motion(self, key: str, entry: _Entry, known: set[str], leader: bool) -> bool:
        if len(entry.holders) < entry.rf or (leader and not entry.acked):
            return True
        if self.identity in entry.holders:
            return not _chosen(self.identity, key, entry.rf, known)
        return False

    def _read_many(self, keys: list[str], armed: set[str],
                   listless: frozenset[str] | set[str] = frozenset()
                   ) -> dict[str, tuple[bytes, Any, list[str]] | Exception | None]:
        """Each key's (metadata bytes, stat, replica names), None if the key is gone, or the
        error; pipelined, each arming the watch on the key's metadata, and the keys in
        ``armed`` the one on their replica list too. The keys in ``listless``: their node
        alone, with no names."""
        if self._recursive and self._multi_read and not armed:
            try:
                return self._read_together(keys, listless)
            except UnimplementedError as e:
                # Not before ZooKeeper 3.6, which the recursive watch needs too: only a
                # server replaced by an older one since this master armed its watch.
                log.warning("ZooKeeper refused a multiRead (%s); reading keys one by one",
                            _describe(e))
                self._multi_read = False
        pending = []
        # The recursive watch needs no watch set by reads (and arming none saves ZooKeeper a
        # watch per key).
        data_watch = None if self._recursive else self._watcher
        for key in keys:
            path = key_path(key)
            # Elsewhere the replica list without a watch: _watch_replicas arms one where it
            # matters.
            pending.append((key, self.zk.get_async(path, watch=data_watch),
                            None if key in listless else self.zk.get_children_async(
                                path, watch=self._watcher if key in armed else None)))
        out: dict[str, tuple[bytes, Any, list[str]] | Exception | None] = {}
        for key, data_result, children_result in pending:
            try:
                data, stat = data_result.get(timeout=_READ_TIMEOUT)
                names = ([] if children_result is None
                         else children_result.get(timeout=_READ_TIMEOUT))
                out[key] = (data, stat, names)
            except NoNodeError:
                out[key] = None
            except Exception as e:
                out[key] = e
        return out

    def _read_together(self, keys: list[str], listless: frozenset[str] | set[str]
                       ) -> dict[str, tuple[bytes, Any, list[str]] | Exception | None]:
        """:meth:`_read_many` (no watches) in ``multiRead`` requests of ``MULTI_READS`` reads
        each, sent all at once: a follower reads every new key, and with a request per read
        ZooKeeper spent about 40 % more CPU per create (scratch counts under eight writers:
        0.37-0.39 ms against 0.24-0.29), and each follower about a fifth more."""
        reads: list[tuple[str, bool]] = []
        for key in keys:
            reads.append((key_path(key), False))
            if key not in listless:
                reads.append((key_path(key), True))
        pending = [read_many_async(self.zk, reads[i:i + MULTI_READS])
                   for i in range(0, len(reads), MULTI_READS)]
        results: list[ReadResult] = []
        for i, request in enumerate(pending):
            asked = len(reads[i * MULTI_READS:(i + 1) * MULTI_READS])
            try:
                answers = request.get(timeout=_READ_TIMEOUT)
                if len(answers) != asked:
                    raise ZookeeperError(f"a multiRead of {asked} reads came back with"
                                         f" {len(answers)} answers")
                results.extend(answers)
            except UnimplementedError:
                raise
            except Exception as e:
                results.extend([e] * asked)
        out: dict[str, tuple[bytes, Any, list[str]] | Exception | None] = {}
        at = 0
        for key in keys:
            node = results[at]
            names: ReadResult = [] if key in listless else results[at + 1]
            at += 1 if key in listless else 2
            if isinstance(node, NoNodeError):
                out[key] = None
            elif isinstance(node, Exception):
                out[key] = node
            elif isinstance(names, NoNodeError):
                out[key] = None  # deleted between the two reads
            elif isinstance(names, Exception):
                out[key] = names
            elif isinstance(node, tuple) and isinstance(names, list):
                out[key] = (node[0], node[1], names)
            else:
                out[key] = ZookeeperError(f"unexpected multiRead answer for {key!r}")
        return out

    def _decide(self, key: str, data: bytes, stat: Any, names: list[str], read_mark: int = -1,
                from_events: bool = False) -> tuple[BlobState, list[str]] | int | None:
        """:meth:`_decide_read`, under the key's lock, for a read sent when this master's
        commit count was ``read_mark`` (-1: unknown). A commit this master made to the key
        since may be missing from the read, and acting on it could delete the new version: a
        key deleted and created again reuses its version numbers, so an old read of the same
        version number finds "our" copy wrong, removes it, and its replica node with it. Such a
        key is looked at again, with a read sent after that commit."""
        with self._key_lock(key):
            if not self._read_is_current(key, read_mark, spend=True):
                self.queue.put(key)  # runs once this batch lets go of the key
                return None
            return self._decide_read(key, data, stat, names, from_events)

    def _decide_read(self, key: str, data: bytes, stat: Any, names: list[str],
                     from_events: bool = False) -> tuple[BlobState, list[str]] | int | None:
        """Bring ``key`` in line with what ZooKeeper says, except for the slow parts, which it
        returns: (state, holders) to fetch, or the version whose replica node to (re-)register
        (our copy is installed and verified), or None. ``from_events``: ``names`` is empty,
        and the replica list is the events held since the key's creation."""
        state = BlobState.decode(data, stat.version)
        holders = _holders(names, state.seq)
        session = self.session_id()
        packed = _pack(data)
        with self._view_lock:
            old = self._view.get(key)
            unchanged = (old is not None and old.seq == state.seq and old.data == packed
                         and old.meta_version == stat.version)
            registered = (old.registered if old is not None and old.seq == state.seq
                          and self.identity in holders else 0)
            committed = self._committed_here.get(key)
            if committed is not None and committed[0] <= state.seq:
                del self._committed_here[key]
                if committed == (state.seq, session) and self.identity in holders:
                    registered = session  # the commit's own transaction registered it
            if not (unchanged and old is not None and old.holders == holders):
                self._generation += 1
            stored = self._view[key] = _Entry(packed, stat.version, state.seq,
                                              state.replication_factor, state.acked, holders,
                                              registered)
            # Events that came while the key was read, replayed in order onto what the read
            # found: each sets one node present or absent, so those the read already saw
            # change nothing, and the result is the list as of the last event. Applied to the
            # old entry alone, they were lost when this read's older list replaced it.
            changed = False
            for change in self._reading.pop(key, ()):
                changed |= self._apply_replica(stored, *change)
            if from_events:
                # The list the events make is what ZooKeeper holds (as a read would): it is
                # what this decision goes by, not a change that came meanwhile.
                holders, changed = stored.holders, False
            if changed and key in self._batch_moved:
                self._batch_moved[key] = True
        self._deleted_since.pop(key, None)

        path = key_path(key)
        if unchanged and registered == session and session:
            # Nothing moved since we verified our copy in this session: skip re-reading its
            # record (100,000s of keys every period), only check it is still on disk.
            has_local = self.store.has_version(key, state.seq)
            trusted = has_local
        else:
            trusted = False
            local = self.store.info(key, state.seq)
            if local is not None and (local.digest != state.digest or local.size != state.size):
                # A version of an earlier incarnation of the key, or of a commit that never was.
                # Unless ZooKeeper is not this store's cluster (wiped, or another cluster's):
                # then its record says nothing about our copy, which must stay (ha-rules 10).
                if not self._deletions_allowed():
                    log.warning("%r v%d here differs from ZooKeeper's record, which does not"
                                " hold this store's cluster (wiped or foreign?): keeping the"
                                " local copy and leaving the key alone", key, state.seq)
                    return None
                self.store.delete_version(key, state.seq)
                local = None
            has_local = local is not None
        for name in names:
            parsed = parse_replica(name)
            if parsed and parsed[0] == self.identity and (not has_local or parsed[1] != state.seq):
                self._delete_node(f"{path}/{name}")
                if parsed[1] == state.seq:
                    self._unregistered(key)  # so a later install registers it afresh
                    registered = 0

        if self._is_leader() and self._leader_duty(key, KeyView(state, holders)):
            return None  # the leader changed the key's state; its watch brings it back here

        known = self.membership.known()
        rf = min(state.replication_factor, max(len(known), 1))
        targets = placement.choose(key, known, rf)
        if has_local:
            others = [h for h in holders if h != self.identity]
            if self.identity not in targets and set(targets) <= set(holders) and len(others) >= rf:
                # Lowering R or a membership change: drop extras only once the set is complete.
                log.info("dropping %r v%d: held by all of %s", key, state.seq, targets)
                self._delete_node(replica_path(key, self.identity, state.seq))
                # Only what this decision was about: the leader may have committed a newer
                # version here while this read was in flight (its write path holds the key's
                # lock from install to commit); deleting the whole key lost that write.
                self.store.delete_through(key, state.seq)
                self._unregistered(key)
                return None
            if not trusted:
                self._prune(key, state.seq)
            return None if registered == session and session else state.seq
        if self.identity in targets:
            return state, list(holders)
        self._prune(key, state.seq)
        return None

    def session_id(self) -> int:
        """The current ZooKeeper session's id (0 when there is none)."""
        return self.zk.client_id[0] if self.zk.client_id else 0

    def _prune(self, key: str, committed: int) -> None:
        keep_below = self.settings.versions_retained - 1
        older = []
        for seq in self.store.versions(key):
            if seq > committed and not self._is_leader():
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
        with self._key_lock(key):
            if self._is_leader():
                return
            try:
                data, _ = self.zk.get(key_path(key))
            except NoNodeError:
                return  # deleted: _key_gone removes the whole key, after its grace
            if seq > BlobState.decode(data).seq:
                self.store.delete_version(key, seq)

    def _fetch_all(self, to_fetch: list[tuple[str, BlobState, list[str]]],
                   failures: dict[str, Exception], read_mark: int = -1
                   ) -> tuple[list[tuple[str, BlobState, bytes]], list[tuple[str, int]], set[str]]:
        """Fetch a batch's versions: (small blobs fetched, for the caller to install together;
        versions installed here already, to register; the keys that had no version here).
        Failures go into ``failures``.

        Small blobs of keys with nothing local come in one FetchVersions call per source (a
        catching-up master has 100,000s of them; a call each would cost more than the bytes);
        the rest, and whatever a batch call did not bring, one Download each, in parallel."""
        groups: dict[str, list[tuple[str, BlobState, list[str]]]] = {}
        singles: list[tuple[str, BlobState, list[str]]] = []
        fresh: set[str] = set()
        for item in to_fetch:
            key, state, holders = item
            sources = [h for h in holders if h != self.identity]
            # A key with a local version goes alone: _fetch may find the bytes locally.
            if state.size <= SMALL_BLOB and sources and not self.store.versions(key):
                fresh.add(key)
                groups.setdefault(self.peers.rank(sources)[0], []).append(item)
            else:
                singles.append(item)
        batches = [
            (source, part, self._fetchers.submit(self._fetch_batch, source, part))
            for source, items in groups.items()
            for part in (items[i:i + FETCH_BATCH] for i in range(0, len(items), FETCH_BATCH))
        ]
        futures: list[tuple[str, BlobState, Future[bytes | None]]] = [
            (key, state, self._fetchers.submit(self._fetch, key, state, holders, read_mark))
            for key, state, holders in singles
        ]
        fetched: list[tuple[str, BlobState, bytes]] = []
        for source, items, batch in batches:
            try:
                got = batch.result()
            except Exception as e:
                log.info("fetching %d small blobs from %s in one call failed (%s); fetching"
                         " them one by one", len(items), source, e)
                got = {}
            for key, state, holders in items:
                data = got.get(key)
                if data is not None:
                    fetched.append((key, state, data))
                else:
                    futures.append((key, state, self._fetchers.submit(
                        self._fetch, key, state, holders, read_mark)))
        done: list[tuple[str, int]] = []
        for key, state, future in futures:
            try:
                result = future.result()
            except Exception as e:
                failures[key] = e
                continue
            if result is None:
                done.append((key, state.seq))
            else:
                fetched.append((key, state, result))
        return fetched, done, fresh

    def _fetch_batch(self, source: str, items: list[tuple[str, BlobState, list[str]]]
                     ) -> dict[str, bytes]:
        """The bytes of the small versions ``source`` sent whose digest it gives as ZooKeeper
        does (install_many verifies the bytes themselves)."""
        wanted = {key: state for key, state, _ in items}
        total = sum(state.size for state in wanted.values())
        self.store.reserve(total)
        timeout = 60.0 + total / (20 * 1024 * 1024)
        got: dict[str, bytes] = {}
        refs = [(key, state.seq) for key, state in wanted.items()]
        for key, seq, digest, data in self.peers.fetch_many(source, refs, timeout):
            state = wanted.get(key)
            if state is None or state.seq != seq:
                continue
            if digest != state.digest:
                log.warning("%s offers %r v%d with digest %s, ZooKeeper says %s; fetching it"
                            " elsewhere", source, key, seq, digest, state.digest)
                continue
            got[key] = data
        return got

    def _read_is_current(self, key: str, read_mark: int, spend: bool = False) -> bool:
        """Whether a read of ``key`` sent at ``read_mark`` (see _decide; -1, unknown: any
        commit not yet read counts) came after this master's last commit to it; ``spend``:
        then that commit's mark is done with. Callers that act on the answer hold the key's
        lock, which commits hold."""
        with self._view_lock:
            mark = self._commit_marks.get(key)
            current = mark is None or (read_mark >= 0 and mark <= read_mark)
            if spend and mark is not None and current:
                del self._commit_marks[key]
        return current

    def _drop_deleted(self, to_register: list[tuple[str, int]], failures: dict[str, Exception]
                      ) -> list[tuple[str, int]]:
        """``to_register`` without the keys deleted since the batch read them (recursive watch):
        the copy may be of the deleted key, and the node, created after a re-create, would count
        it as a holder of the new version. The deletion's event queued the key again."""
        with self._view_lock:
            gone = {key for key, _ in to_register if key in self._deleted_in_batch}
        for key in gone:
            failures[key] = SyncDeferred(f"{key!r} was deleted while it was fetched; looking"
                                         " again")
        return [item for item in to_register if item[0] not in gone]

    def _undo_deleted(self, registered: list[tuple[str, int]], failures: dict[str, Exception]
                      ) -> None:
        """Remove the replica nodes just created for keys deleted meanwhile. ZooKeeper sends a
        session its events before the answers to its later requests, and _on_tree runs on the
        connection thread: a deletion that came before the registrations is known by now, even
        one whose event was still on the way when _drop_deleted looked."""
        with self._view_lock:
            late = [(key, seq) for key, seq in registered
                    if key not in failures and key in self._deleted_in_batch]
        for key, seq in late:
            try:
                self._delete_node(replica_path(key, self.identity, seq))
            except Exception as e:
                failures[key] = e  # retried; the next reconcile judges the copy again
                continue
            self._unregistered(key)
            failures[key] = SyncDeferred(f"{key!r} was deleted while it was registered; looking"
                                         " again")

    def _stale_fetch(self, key: str) -> SyncDeferred:
        # What was fetched may be of the key's earlier incarnation (deleted and created again
        # here since the read), under the new one's version number: installing it would
        # replace the new, acknowledged version. The key is looked at again.
        return SyncDeferred(f"{key!r} was committed here while it was fetched; looking again")

    def _fetch(self, key: str, state: BlobState, holders: list[str], read_mark: int = -1
               ) -> bytes | None:
        """Obtain the committed version of ``key``: a small blob's bytes, for the caller to
        install with the rest of its batch, or None once a big one (or a local copy) is
        installed here."""
        copy = self.store.find_by_digest(key, state.digest, state.size)
        if copy is not None:
            with self._key_lock(key):
                if not self._read_is_current(key, read_mark):
                    raise self._stale_fetch(key)
                self.store.install_copy(key, state.seq, copy)
            return None
        sources = self.peers.rank(h for h in holders if h != self.identity)
        if not sources:
            raise SyncDeferred(f"no live replica holds v{state.seq} yet")
        self.store.reserve(state.size)
        small = state.size <= SMALL_BLOB
        dest: TempBlob | BlobBuffer = BlobBuffer() if small else self.store.new_temp("sync")
        started = time.monotonic()
        try:
            timeout = 60.0 + state.size / (20 * 1024 * 1024)
            last: Exception | None = None
            for source in sources:
                try:
                    self.peers.fetch(source, key, state.seq, state.digest, dest, timeout)
                    last = None
                    break
                except BlobError as e:
                    # Resume from the next replica at the offset already received.
                    last = e
                    log.info("fetch of %r v%d from %s failed (%s); trying another",
                             key, state.seq, source, e)
            if last is not None:
                raise last
            if isinstance(dest, BlobBuffer):
                return dest.value()
            with self._key_lock(key):
                if not self._read_is_current(key, read_mark):
                    raise self._stale_fetch(key)
                self.store.install(key, state.seq, dest, state.size, state.digest)
        except BaseException:
            if isinstance(dest, TempBlob):
                dest.discard()
            raise
        log.info("synced %r v%d (%d bytes) in %.3fs", key, state.seq, state.size,
                 time.monotonic() - started)
        return None

    def _install_fetched(self, fetched: list[tuple[str, BlobState, bytes]], read_mark: int = -1
                         ) -> dict[str, Exception]:
        """Install the small blobs a batch fetched, together (see LocalStore.install_many),
        except those of keys this master committed to since the batch read them."""
        if not fetched:
            return {}
        failures: dict[str, Exception] = {}
        with ExitStack() as locks:
            # In key order, as the group commit takes them: no two take each other's.
            for key in sorted({key for key, _, _ in fetched}):
                locks.enter_context(self._key_lock(key))
            stale = {key for key, _, _ in fetched if not self._read_is_current(key, read_mark)}
            for key in stale:
                failures[key] = self._stale_fetch(key)
            fetched = [item for item in fetched if item[0] not in stale]
            try:
                outcomes = self.store.install_many(
                    [(key, state.seq, data, state.size, state.digest)
                     for key, state, data in fetched])
            except Exception as e:
                return {**failures, **{key: e for key, _, _ in fetched}}
        synced = 0
        for (key, _, _), outcome in zip(fetched, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failures[key] = outcome
            else:
                synced += 1
        log.info("synced %d small blobs", synced)
        return failures

    def register_replica(self, key: str, seq: int) -> None:
        """Make our replica node exist, owned by the current session (ha-rules 6, 7)."""
        session = self.session_id()
        with self._view_lock:
            entry = self._view.get(key)
            if entry is not None and entry.seq == seq and entry.registered == session and session:
                return
        path = replica_path(key, self.identity, seq)
        for _ in range(REGISTER_ATTEMPTS):
            try:
                # No makepath: if the key was deleted meanwhile, we must not resurrect it.
                self.zk.create(path, b"", ephemeral=True)
                break
            except NodeExistsError:
                stat = self.zk.exists(path)
                if stat is not None and stat.ephemeralOwner == session:
                    break
                # An earlier session's node: removed here, or gone by itself (that session
                # expiring) between the create and the look. Either way, none is ours yet.
                if stat is not None:
                    self._delete_node(path)
            except NoNodeError:
                return
        else:
            raise NodeExistsError(f"{path} kept belonging to another session; retried later")
        self._registered(key, seq, session)

    def _register_many(self, items: list[tuple[str, int]]) -> dict[str, Exception]:
        """Register many replica nodes, ``REGISTER_BATCH`` per ZooKeeper transaction; the
        failures per key. Callers pass only versions installed and verified (ha-rule 7)."""
        failures: dict[str, Exception] = {}
        session = self.session_id()
        for start in range(0, len(items), REGISTER_BATCH):
            chunk = items[start:start + REGISTER_BATCH]
            ok = False
            if len(chunk) > 1:
                txn = self.zk.transaction()
                for key, seq in chunk:
                    # No makepath here either: a deleted key fails the create.
                    txn.create(replica_path(key, self.identity, seq), b"", ephemeral=True)
                try:
                    results = txn.commit()
                    # commit() does not raise when an op fails: every element must be checked.
                    ok = all(not isinstance(r, BaseException) for r in results)
                except KazooException:
                    ok = False  # outcome unknown: the one-by-one path below re-reads
            if ok:
                for key, seq in chunk:
                    self._registered(key, seq, session)
                continue
            # A multi-op is all or nothing: one node left over from an earlier session, or one
            # key deleted meanwhile, fails it all. Those cases take the careful path per key.
            for key, seq in chunk:
                try:
                    self.register_replica(key, seq)
                except Exception as e:
                    failures[key] = e
        return failures

    def _registered(self, key: str, seq: int, session: int) -> None:
        with self._view_lock:
            entry = self._view.get(key)
            if entry is not None and entry.seq == seq:
                entry.registered = session
                self._set_holder(entry, self.identity, True)

    def _unregistered(self, key: str) -> None:
        with self._view_lock:
            self._committed_here.pop(key, None)
            entry = self._view.get(key)
            if entry is not None:
                entry.registered = 0
                self._set_holder(entry, self.identity, False)

    def creating(self, keys: list[str]) -> None:
        """``keys`` are about to be created by this master's commit, each acknowledged in it
        and with no other version here: from now their replica-node events are held for
        :meth:`registered`, which makes their entries. Call :meth:`created` once the commit
        is over, whatever its outcome."""
        if not self._recursive:
            return  # the one-shot watches are armed by the reconcile this would save
        with self._view_lock:
            for key in keys:
                self._born[key] = []

    def created(self, keys: list[str]) -> None:
        """The commit announced by :meth:`creating` is over."""
        with self._view_lock:
            for key in keys:
                self._born.pop(key, None)

    def follow(self, key: str, seq: int) -> None:
        """After this master's commit of ``seq``: reconcile ``key``, unless the commit itself
        gave it its entry (a create acknowledged in its commit, :meth:`creating`). Only the
        follower's work is left then, and nothing to read back: the version and our replica
        node are what the commit wrote, and the other holders come as events."""
        with self._view_lock:
            if self._made_here.pop(key, None) == seq:
                entry = self._view.get(key)
                if entry is not None and entry.seq == seq:
                    if key not in self._batch_moved:
                        # No batch is reading the key, so none sent its read before the
                        # commit (see _decide): the commit's mark has nothing left to guard.
                        self._commit_marks.pop(key, None)
                    return
        self.queue.put(key)

    def registered(self, key: str, seq: int, session: int, replication_factor: int,
                   state: BlobState | None = None, record: bytes = b"") -> None:
        """The leader's commit created our replica node of ``seq`` in ``session`` (in the same
        transaction as the version itself). ``state`` and ``record`` (its encoding, as
        written): the version, for a key created by that commit and announced by
        :meth:`creating`."""
        with self._view_lock:
            self._commits += 1
            self._commit_marks[key] = self._commits
            entry = self._view.get(key)
            held = self._born.pop(key, None)
            if state is not None and record and held is not None and entry is None and session:
                # The commit made the key: its entry is what the commit wrote (a new znode's
                # version is 0), held here alone, replayed with what registered since.
                entry = self._view[key] = _Entry(
                    _pack(record), 0, seq, state.replication_factor, state.acked,
                    (sys.intern(self.identity),), session)
                self._generation += 1
                for change in held:
                    self._apply_replica(entry, *change)
                self._made_here[key] = seq
                return
            if entry is None or entry.seq != seq:
                self._committed_here[key] = (seq, session)
            if replication_factor > 1 and not self._recursive:
                # The new version's replica list is about to move (the other holders fetch
                # it), and this master's own node is in it already: the reconcile that follows
                # the commit arms the list's watch with its first read, instead of a second.
                self._arm_on_read[key] = time.monotonic()
        self._registered(key, seq, session)

    def corrupted(self, key: str, seq: int) -> None:
        """A stored version failed its digest and was removed: stop advertising it and fetch
        a healthy copy."""
        self._unregistered(key)
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
            self._committed_here.pop(key, None)
            self._arm_on_read.pop(key, None)
            if self._view.pop(key, None) is not None:
                self._generation += 1
        if not self.store.versions(key):
            self._deleted_since.pop(key, None)
            return
        now = time.monotonic()
        since = self._deleted_since.setdefault(key, now)
        remaining = self.settings.delete_grace_secs - (now - since)
        if remaining > 0:
            self.queue.put(key, delay=remaining)
            return
        with self._key_lock(key):
            # Re-check under the lock the commit path holds: a re-create may be under way.
            if self.zk.exists(key_path(key)) is not None:
                self.queue.put(key)
                return
            # Asked here, just before the delete, not once at start: ZooKeeper wiped or
            # swapped while this master runs must not read as "every key was deleted".
            if not self._deletions_allowed():
                # The grace starts again once ZooKeeper holds this cluster: restored in stages,
                # a key not back yet must not go at once on a grace counted from the wipe.
                self._deleted_since.pop(key, None)
                log.debug("ZooKeeper has no record of %r, but it does not hold this store's"
                          " cluster (wiped or foreign?): keeping the local copy", key)
                return
            self.store.delete_key(key)
            self._deleted_since.pop(key, None)
            log.info("deleted local copy of %r (deleted in ZooKeeper)", key)

    # For the status page.
    def views(self) -> dict[str, KeyView]:
        with self._view_lock:
            entries = list(self._view.items())
        return {key: e.view() for key, e in entries}


__all__ = ["KeyView", "SyncDeferred", "SyncSettings", "Synchronizer"]
