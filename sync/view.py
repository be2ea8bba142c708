"""The replica view: what this master last read of every key, its holders, and the figures."""

from __future__ import annotations

import sys
import threading
import zlib
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blobha.core.acl import format_acl
from blobha.core.blobstate import BlobState
from blobha.sync.decide import counted
from blobha.sync.tally import Tally
from blobha.zk import layout

if TYPE_CHECKING:
    from blobha.sync.membership import Membership


@dataclass(frozen=True)
class KeyView:
    state: BlobState
    #: Addresses of the masters holding ``state.seq``, sorted.
    holders: tuple[str, ...]
    #: Whether ZooKeeper announced a change of the key that this view does not hold yet (or
    #: the connection it was read over has dropped since, and it was not read again).
    behind: bool = False


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


def pack(data: bytes) -> bytes:
    """A metadata record packed for keeping in memory (a 260-byte record takes about 85)."""
    c = zlib.compressobj(6, zlib.DEFLATED, _PACK_WBITS, 1, zlib.Z_DEFAULT_STRATEGY, _META_DICT)
    return c.compress(data) + c.flush()


def unpack(packed: bytes) -> bytes:
    d = zlib.decompressobj(_PACK_WBITS, _META_DICT)
    return d.decompress(packed) + d.flush()


class Entry:
    """What this master last read of one key, kept compact: a cluster holds 100,000s of keys
    and every master keeps one entry per key. The metadata stays as the znode's bytes, packed
    (unpacked and decoded only when a caller wants the full state: the status page, a read
    during a ZooKeeper outage); the fields the figures need on every status call are kept
    decoded."""

    __slots__ = ("acked", "acl_bytes", "created_at", "data", "holders", "meta_version", "owner",
                 "registered", "rf", "seq", "size")

    def __init__(self, data: bytes, meta_version: int, seq: int, rf: int, acked: bool,
                 holders: tuple[str, ...], registered: int, owner: str = "", size: int = 0,
                 acl_bytes: int = 0, created_at: float = 0.0) -> None:
        #: The metadata znode's bytes, packed (pack).
        self.data = data
        self.meta_version = meta_version
        self.seq = seq
        self.rf = rf
        self.acked = acked
        #: Addresses (interned: a handful of distinct strings) holding ``seq``, sorted.
        self.holders = holders
        #: The ZooKeeper session in which our replica node of ``seq`` was verified (0: not).
        self.registered = registered
        #: What the key costs its creator's quotas (:class:`Usage`): the creator (interned: a
        #: handful of distinct names), the current version's size and the ACL's stored bytes;
        #: and when this incarnation of the key was created (a key deleted and created again
        #: starts its versions anew).
        self.owner = owner
        self.size = size
        self.acl_bytes = acl_bytes
        self.created_at = created_at

    @classmethod
    def of(cls, data: bytes, meta_version: int, state: BlobState, holders: tuple[str, ...],
           registered: int) -> Entry:
        """The entry of ``state``, whose record ``data`` is packed already (pack)."""
        return cls(data, meta_version, state.seq, state.replication_factor, state.acked,
                   holders, registered, sys.intern(state.creator), state.size,
                   acl_bytes(state), state.created_at)

    def view(self, behind: bool = False, holding: AbstractSet[str] | None = None) -> KeyView:
        """The key as read; with ``holding``, only the holders whose replica nodes count."""
        state = BlobState.decode(unpack(self.data), self.meta_version)
        holders = self.holders if holding is None else counted(self.holders, holding)
        return KeyView(state, holders, behind)


def acl_bytes(state: BlobState) -> int:
    """The bytes ``state``'s ACL takes in its record, as quotas count them."""
    return len(format_acl(state.acl).encode())


@dataclass
class Usage:
    """What one user's keys hold in ZooKeeper and on the masters, as this master's view has
    it: the keys the user created, the sizes of their current versions, and their ACLs'
    bytes (the part of a record its writer sizes)."""

    keys: int = 0
    bytes: int = 0
    acl_bytes: int = 0


# Canonical holder tuples: nearly every key has the same few holder sets (with three masters,
# all three), so entries share one tuple instead of 100,000s of equal ones.
_holder_sets: dict[tuple[str, ...], tuple[str, ...]] = {}


def canonical(holders: tuple[str, ...]) -> tuple[str, ...]:
    if len(_holder_sets) > 4096:
        _holder_sets.clear()  # bounded: membership churn over years cannot grow it forever
    return _holder_sets.setdefault(holders, holders)


def holders_of(names: list[str], seq: int) -> tuple[str, ...]:
    """The holders of ``seq`` among replica node ``names``, sorted and shared (canonical)."""
    return canonical(tuple(sys.intern(a) for a in layout.holders(names, seq)))


#: One replica-node event: (holder, version, present).
Change = tuple[str, int, bool]


@dataclass
class InFlight:
    """What is under way per key between the change feed, the batches and the leader's commits.
    Every field is guarded by the view's lock, and changed only by the view's transitions (see
    ReplicaView, "the in-flight state's transitions"), each named for its event."""

    #: Keys whose next reconcile arms the watch on their replica list with its first read (see
    #: Synchronizer.registered), with the time of their commit.
    arm_on_read: dict[str, float] = field(default_factory=dict)
    #: Keys whose batch read armed that watch, until their reconcile has stored what it read:
    #: whether the list changed meanwhile (then the stored holders may be older than what the
    #: event's read found, and the list is read once more).
    arming: dict[str, bool] = field(default_factory=dict)
    #: With the recursive watch, the keys being read by a batch, each with the replica-node
    #: events that arrived since its read was sent: replayed onto what the read found once it
    #: is stored (see Executor).
    reading: dict[str, list[Change]] = field(default_factory=dict)
    #: With it, the keys whose creation this master saw (a follower) or is committing (the
    #: leader, see creating()), each with the replica-node events since (the creating
    #: transaction's own node among them): their replica list is exactly those, so a
    #: follower's reconcile reads the key's node and not its list, and the leader makes the
    #: entry from its commit without a read. Emptied on every change of the connection (events
    #: may be missed then); at most SyncSettings.born_max keys from events.
    born: dict[str, list[Change]] = field(default_factory=dict)
    #: With it, the keys of the batches under way, each with whether replica-node events
    #: changed its holders meanwhile (acted on when its batch ends).
    batch_moved: dict[str, bool] = field(default_factory=dict)
    #: With it, the keys of the batches under way whose node was deleted meanwhile: what the
    #: batch read may be of that earlier incarnation, and a copy of it must not be registered
    #: under the next one's version number.
    deleted_in_batch: set[str] = field(default_factory=set)


class ReplicaView:
    """Every key's :class:`Entry`, under one lock, with the bookkeeping of this master's own
    commits (which guards reads older than them) and the figures the status page shows."""

    def __init__(self, identity: str, membership: Membership) -> None:
        self.identity = identity
        self.membership = membership
        #: Guards the entries, the commit bookkeeping below and ``flight``.
        self.lock = threading.Lock()
        self.entries: dict[str, Entry] = {}
        #: Per creator, what the entries cost (kept with them: see put and forget).
        self._usage: dict[str, Usage] = {}
        self.flight = InFlight()
        #: Bumped on every change of the entries, so figures() recomputes only when something
        #: moved.
        self.generation = 0
        #: Replica nodes the leader's commit transactions created, for keys whose entry was not
        #: at that version yet: the next reconcile takes them as registered instead of asking
        #: ZooKeeper again. Emptied as those reconciles run (or the keys go).
        self.committed_here: dict[str, tuple[int, int]] = {}
        #: Commits this master made as leader, counted; and per key, the count at its last
        #: commit not yet followed by a read (see read_is_current).
        self.commits = 0
        self.commit_marks: dict[str, int] = {}
        #: The keys this master's commit created and registered() made an entry for (from the
        #: events held in ``flight.born`` since creating()), with its version: the commit
        #: path's follow() then queues no reconcile.
        self.made_here: dict[str, int] = {}
        #: Changes ZooKeeper announced (a key's node created, changed or deleted) not yet
        #: followed by a read of the key: per key, the count of announcements at the last one
        #: (see heard, unread). While ZooKeeper is out of reach, a view with one is never served
        #: as the latest: a newer version may have been committed and acknowledged.
        self.announced = 0
        self.unread: dict[str, int] = {}
        #: The session in which this master checked its own replica nodes against its store
        #: (blobha.sync.verify): a node of ours read in it is registered in it.
        self.checked_session = 0
        #: The count of announcements at the latest reconnect (see reconnected).
        self._reconnect_mark = -1
        #: The figures of the view (a pass over every key at a time).
        self.tally = Tally(self)

    # ---- reading it ----------------------------------------------------------------------

    def holding(self) -> frozenset[str]:
        """The masters whose replica nodes count (Membership.holding)."""
        return self.membership.holding()

    def view(self, key: str) -> KeyView | None:
        """``key`` as last read, its holders those whose replica nodes count."""
        with self.lock:
            entry = self.entries.get(key)
            behind = key in self.unread
        return entry.view(behind, self.holding()) if entry is not None else None

    def views(self) -> dict[str, KeyView]:
        with self.lock:
            entries = list(self.entries.items())
        holding = self.holding()
        return {key: e.view(holding=holding) for key, e in entries}

    def key_count(self) -> int:
        with self.lock:
            return len(self.entries)

    def keys(self) -> set[str]:
        with self.lock:
            return set(self.entries)

    def seen(self, key: str) -> tuple[float, int] | None:
        """(the creation time, the version) of what this view has of ``key``; None: nothing."""
        with self.lock:
            entry = self.entries.get(key)
            return (entry.created_at, entry.seq) if entry is not None else None

    def usage(self, user: str) -> Usage:
        """What ``user``'s keys cost, as of now (a copy)."""
        with self.lock:
            u = self._usage.get(user)
            return Usage(u.keys, u.bytes, u.acl_bytes) if u is not None else Usage()

    def _count(self, entry: Entry, sign: int) -> None:
        u = self._usage.get(entry.owner)
        if u is None:
            u = self._usage[entry.owner] = Usage()
        u.keys += sign
        u.bytes += sign * entry.size
        u.acl_bytes += sign * entry.acl_bytes
        if u.keys <= 0:
            del self._usage[entry.owner]

    def behind(self) -> tuple[int, int]:
        """How many keys' entries miss an announced change (see unread), and how many of
        those were not read since the latest reconnect (0 once its full reconcile read
        them: the rest is the lag of changes as they come)."""
        with self.lock:
            mark = self._reconnect_mark
            return len(self.unread), sum(1 for v in self.unread.values() if v <= mark)

    def figures(self) -> tuple[int, int, int]:
        """(keys, keys with fewer holders than their replication factor, keys this master
        should hold but lacks): see :class:`blobha.sync.tally.Tally`."""
        return self.tally.figures()

    # ---- changing it ---------------------------------------------------------------------

    def put(self, key: str, entry: Entry, moved: bool = True) -> Entry:
        """Store ``entry`` for ``key`` (lock held); ``moved``: as the view's news. The only
        way an entry is stored, so that the usage counts follow every change."""
        old = self.entries.get(key)
        if old is not None:
            self._count(old, -1)
        self.entries[key] = entry
        self._count(entry, 1)
        if moved:
            self.generation += 1
        return entry

    def apply_replica(self, entry: Entry, holder: str, seq: int, present: bool) -> bool:
        """Apply one replica-node event to ``entry`` (lock held); whether its holders changed.
        Events of other versions do not count (a newer version's own event queues its key)."""
        return seq == entry.seq and self.set_holder(entry, holder, present)

    def set_holder(self, entry: Entry, holder: str, present: bool) -> bool:
        """Add or remove ``holder`` in ``entry``'s holders (lock held); whether they changed."""
        if (holder in entry.holders) == present:
            return False
        if present:
            holders = (*entry.holders, sys.intern(holder))
        else:
            holders = tuple(h for h in entry.holders if h != holder)
        entry.holders = canonical(tuple(sorted(holders)))
        self.generation += 1
        return True

    def set_holders(self, entry: Entry, holders: tuple[str, ...]) -> bool:
        """Replace ``entry``'s holders with a list just read (lock held); whether they moved."""
        if holders == entry.holders:
            return False
        entry.holders = holders
        self.generation += 1
        return True

    def registered(self, key: str, seq: int, session: int) -> None:
        """Our replica node of ``seq`` exists, owned by ``session``."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and entry.seq == seq:
                entry.registered = session
                self.set_holder(entry, self.identity, True)

    def unregistered(self, key: str) -> None:
        """Our replica node of ``key`` is gone (removed here, or found gone)."""
        with self.lock:
            self.committed_here.pop(key, None)
            entry = self.entries.get(key)
            if entry is not None:
                entry.registered = 0
                self.set_holder(entry, self.identity, False)

    def heard(self, key: str) -> None:
        """ZooKeeper announced a change of ``key``'s node: its entry is behind until a read
        sent after now is stored (:meth:`caught_up`)."""
        with self.lock:
            self.announced += 1
            self.unread[key] = self.announced

    def reconnected(self) -> None:
        """A new connection to ZooKeeper: changes made while there was none were announced to
        nobody, so every entry is behind until read again (the reconnect's full reconcile)."""
        with self.lock:
            self.announced += 1
            self._reconnect_mark = self.announced
            self.unread.update(dict.fromkeys(self.entries, self.announced))

    def marks(self) -> tuple[int, int]:
        """(the commit count, the count of announcements), taken together before a batch sends
        its reads (see read_mark, heard_mark)."""
        with self.lock:
            return self.commits, self.announced

    def heard_mark(self) -> int:
        """The count of announcements, taken before a batch sends its reads."""
        with self.lock:
            return self.announced

    def caught_up(self, key: str, mark: int) -> None:
        """A read of ``key`` sent at ``mark`` (:meth:`heard_mark`) is stored (lock held): the
        changes announced before it are in the entry; one announced since still waits."""
        at = self.unread.get(key)
        if at is not None and at <= mark:
            del self.unread[key]

    def forget(self, key: str) -> None:
        """``key`` is gone from ZooKeeper: its entry and what waited for its next reconcile."""
        with self.lock:
            self.unread.pop(key, None)
            self.committed_here.pop(key, None)
            self.flight.arm_on_read.pop(key, None)
            old = self.entries.pop(key, None)
            if old is not None:
                self._count(old, -1)
                self.generation += 1

    # ---- the in-flight state's transitions, one per event ----------------------------------
    #
    # Every change of ``flight``, of the commit bookkeeping (committed_here, commit_marks,
    # made_here) and of the entries that the feed, the executor and the registry make goes
    # through one of these, named for the event that causes it. Each takes the lock itself;
    # none does I/O or reads a clock (times are passed in), so they are tested on their own
    # (tests/unit/sync/test_sync_state.py).

    def connection_changed(self) -> None:
        """The connection to ZooKeeper changed state (suspended, lost, connected): events may
        have been missed, so no creation's events are held any more (InFlight.born)."""
        with self.lock:
            self.flight.born.clear()

    def key_created(self, key: str, born_max: int) -> None:
        """The recursive watch announced ``key``'s creation (by another master): its replica
        events are held from now (InFlight.born), up to ``born_max`` keys."""
        with self.lock:
            if len(self.flight.born) < born_max:
                self.flight.born[key] = []

    def key_deleted(self, key: str) -> None:
        """The recursive watch announced ``key``'s deletion: the events held since its creation
        are of no use, and a batch under way on it must not register what it read
        (InFlight.deleted_in_batch)."""
        with self.lock:
            self.flight.born.pop(key, None)
            if key in self.flight.batch_moved:
                self.flight.deleted_in_batch.add(key)

    def replica_event(self, key: str, change: Change) -> Entry | None:
        """The recursive watch announced a replica node of ``key`` created or deleted: held for
        the key's creation and for the batch reading it, and applied to its entry. The entry
        when that moved its holders and no batch has the key (the caller decides whether that
        leaves this master work); None otherwise (the batch's end looks at what moved)."""
        flight = self.flight
        with self.lock:
            born = flight.born.get(key)
            if born is not None:
                born.append(change)
            pending = flight.reading.get(key)
            if pending is not None:
                pending.append(change)
            entry = self.entries.get(key)
            moved = entry is not None and self.apply_replica(entry, *change)
            if key in flight.batch_moved:
                flight.batch_moved[key] = flight.batch_moved[key] or moved
                return None
        return entry if moved else None

    def replicas_announced(self, key: str) -> bool:
        """The one-shot watch on ``key``'s replica list fired: a batch arming that watch learns
        that the list changed (InFlight.arming). Whether the list's read should arm the watch
        again (one more copy still leaves the key short of its factor)."""
        with self.lock:
            entry = self.entries.get(key)
            arm = entry is not None and len(entry.holders) + 1 < entry.rf
            if key in self.flight.arming:
                self.flight.arming[key] = True
        return arm

    def replicas_listed(self, key: str, names: list[str]) -> Entry | None:
        """``key``'s replica list was read (replica node ``names``): its entry's holders are
        those now. The entry (None: none)."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.set_holders(entry, holders_of(names, entry.seq))
        return entry

    def holders_read(self, entry: Entry, names: list[str]) -> bool:
        """A read of the replica list of ``entry``'s key found ``names``: its holders are
        those now; whether they moved."""
        with self.lock:
            return self.set_holders(entry, holders_of(names, entry.seq))

    def list_differs(self, key: str, names: list[str]) -> bool:
        """Whether replica node ``names`` differ from ``key``'s holders (or it has no entry)."""
        with self.lock:
            entry = self.entries.get(key)
            return entry is None or holders_of(names, entry.seq) != entry.holders

    def entries_where(self, keys: Iterable[str], test: Callable[[str, Entry], bool]
                      ) -> list[tuple[str, Entry]]:
        """Of ``keys``, those with an entry that passes ``test``, with it. ``test`` runs with
        the lock held: no blocking in it."""
        with self.lock:
            return [(key, entry) for key in keys
                    if (entry := self.entries.get(key)) is not None and test(key, entry)]

    def batch_taken(self, keys: list[str], now: float, arm_within: float) -> set[str]:
        """A worker took ``keys`` for a batch at ``now``: those committed here less than
        ``arm_within`` seconds before (InFlight.arm_on_read) have the batch's read arm their
        replica list's watch. Those keys, arming from now (InFlight.arming) until
        :meth:`arming_ended`."""
        flight = self.flight
        armed: set[str] = set()
        with self.lock:
            for key in keys:
                committed_at = flight.arm_on_read.pop(key, None)
                if committed_at is not None and now - committed_at < arm_within:
                    armed.add(key)
                    flight.arming[key] = False
        return armed

    def armed_unmoved(self, armed: set[str]) -> set[str]:
        """Of the keys whose batch read armed their replica list's watch, those whose list did
        not change since (what the batch stored of it is current)."""
        with self.lock:
            return {key for key in armed if not self.flight.arming.get(key, True)}

    def arming_ended(self, armed: Iterable[str]) -> None:
        """The batch that armed these keys' watches (:meth:`batch_taken`) is over."""
        with self.lock:
            for key in armed:
                self.flight.arming.pop(key, None)

    def batch_started(self, keys: list[str]) -> set[str]:
        """(The recursive watch.) A batch is about to read ``keys``: the replica events of each
        are held for it from now (InFlight.reading, InFlight.batch_moved). The keys whose
        creation's events were held (InFlight.born): their replica list is those events, and
        only their nodes are read."""
        flight = self.flight
        listless: set[str] = set()
        with self.lock:
            for key in keys:
                born = flight.born.pop(key, None)
                if born is not None and key not in flight.reading:
                    # Every event since the key's creation: they are its replica list.
                    flight.reading[key] = born
                    listless.add(key)
                else:
                    flight.reading.setdefault(key, [])
                flight.batch_moved[key] = False
        return listless

    def batch_ended(self, keys: list[str]) -> list[str]:
        """(The recursive watch.) The batch of :meth:`batch_started` is over: the keys whose
        holders replica events changed meanwhile, in order."""
        flight = self.flight
        with self.lock:
            moved = [key for key in keys if flight.batch_moved.pop(key, False)]
            flight.deleted_in_batch.difference_update(keys)
            for key in keys:
                flight.reading.pop(key, None)
        return moved

    def read_stored(self, key: str, state: BlobState, data: bytes, meta_version: int,
                    holders: tuple[str, ...], session: int, from_events: bool,
                    heard: int = -1) -> tuple[tuple[str, ...], int, bool]:
        """A batch's read of ``key`` found ``state`` (its record ``data``, as read) with
        ``holders``, in ``session``, sent when ``heard`` changes were announced: it becomes the
        key's entry, with the replica events that came meanwhile replayed onto it. (The holders
        to decide by, the session our node is known registered in, whether the record is as
        the entry had it.) ``from_events``: the holders are the events held since the key's
        creation (:meth:`batch_started`)."""
        packed = pack(data)
        flight = self.flight
        with self.lock:
            old = self.entries.get(key)
            unchanged = (old is not None and old.seq == state.seq and old.data == packed
                         and old.meta_version == meta_version)
            if self.identity in holders and session and session == self.checked_session:
                # Our node is persistent and was checked in this session: it stands as
                # registered in it, with no write (the decision drops it if the copy is gone).
                registered = session
            else:
                registered = (old.registered if old is not None and old.seq == state.seq
                              and self.identity in holders else 0)
            committed = self.committed_here.get(key)
            if committed is not None and committed[0] <= state.seq:
                del self.committed_here[key]
                if committed == (state.seq, session) and self.identity in holders:
                    registered = session  # the commit's own transaction registered it
            stored = self.put(key, Entry.of(packed, meta_version, state, holders, registered),
                              moved=not (unchanged and old is not None and old.holders == holders))
            self.caught_up(key, heard)
            # Events that came while the key was read, replayed in order onto what the read
            # found: each sets one node present or absent, so those the read already saw
            # change nothing, and the result is the list as of the last event. Applied to the
            # old entry alone, they were lost when this read's older list replaced it.
            changed = False
            for change in flight.reading.pop(key, ()):
                changed |= self.apply_replica(stored, *change)
            if from_events:
                # The list the events make is what ZooKeeper holds (as a read would): it is
                # what this decision goes by, not a change that came meanwhile.
                holders, changed = stored.holders, False
            if changed and key in flight.batch_moved:
                flight.batch_moved[key] = True
        return holders, registered, unchanged

    def is_registered(self, key: str, seq: int, session: int) -> bool:
        """Whether our replica node of ``key`` at ``seq`` is known to exist in ``session``."""
        with self.lock:
            entry = self.entries.get(key)
            return bool(entry is not None and entry.seq == seq and entry.registered == session
                        and session)

    def deleted_meanwhile(self, keys: Iterable[str]) -> set[str]:
        """Of ``keys``, those deleted while their batch had them (InFlight.deleted_in_batch)."""
        with self.lock:
            return {key for key in keys if key in self.flight.deleted_in_batch}

    def commit_creating(self, keys: list[str]) -> None:
        """This master's commit is about to create ``keys``: their replica events are held
        from now (InFlight.born) for :meth:`commit_registered`, until :meth:`commit_ended`."""
        with self.lock:
            for key in keys:
                self.flight.born[key] = []

    def commit_ended(self, keys: list[str]) -> None:
        """The commit announced by :meth:`commit_creating` is over, whatever its outcome."""
        with self.lock:
            for key in keys:
                self.flight.born.pop(key, None)

    def commit_registered(self, key: str, seq: int, session: int,
                          state: BlobState | None = None, record: bytes = b"",
                          arm_at: float | None = None) -> None:
        """This master's commit of ``seq`` created our replica node of it in ``session``, in
        the same transaction as the version. ``state`` and ``record`` (its encoding, as
        written): the version, for a key whose creation :meth:`commit_creating` announced,
        whose entry is then made from them (InFlight.born, made_here). Otherwise the next
        reconcile takes the node as registered (committed_here); ``arm_at``: the commit's time,
        where that reconcile's read is to arm the replica list's watch (InFlight.arm_on_read).
        The commit is counted either way (commit_marks, see read_is_current)."""
        with self.lock:
            self.commits += 1
            self.commit_marks[key] = self.commits
            entry = self.entries.get(key)
            held = self.flight.born.pop(key, None)
            if state is not None and record and held is not None and entry is None and session:
                # The commit made the key: its entry is what the commit wrote (a new znode's
                # version is 0), held here alone, replayed with what registered since.
                entry = self.put(key, Entry.of(pack(record), 0, state,
                                               (sys.intern(self.identity),), session))
                for change in held:
                    self.apply_replica(entry, *change)
                self.made_here[key] = seq
                return
            if entry is None or entry.seq != seq:
                self.committed_here[key] = (seq, session)
            if arm_at is not None:
                self.flight.arm_on_read[key] = arm_at
        self.registered(key, seq, session)

    def commit_followed(self, key: str, seq: int) -> bool:
        """After this master's commit of ``seq`` of ``key``: whether the commit itself made the
        key's entry (:meth:`commit_registered`), so that no reconcile needs to read it back."""
        with self.lock:
            if self.made_here.pop(key, None) == seq:
                entry = self.entries.get(key)
                if entry is not None and entry.seq == seq:
                    if key not in self.flight.batch_moved:
                        # No batch is reading the key, so none sent its read before the
                        # commit (see read_is_current): the commit's mark has nothing left to
                        # guard.
                        self.commit_marks.pop(key, None)
                    return True
        return False

    def read_is_current(self, key: str, read_mark: int, spend: bool = False) -> bool:
        """Whether a read of ``key`` sent at ``read_mark`` (the commit count then; -1, unknown:
        any commit not yet read counts) came after this master's last commit to it. A key
        deleted and created again reuses its version numbers, so an older read of the same
        version number finds "our" copy wrong. ``spend``: then that commit's mark is done
        with. Callers that act on the answer hold the key's lock, which commits hold."""
        with self.lock:
            mark = self.commit_marks.get(key)
            current = mark is None or (read_mark >= 0 and mark <= read_mark)
            if spend and mark is not None and current:
                del self.commit_marks[key]
        return current

    def read_mark(self) -> int:
        """The commit count, taken before a batch sends its reads."""
        with self.lock:
            return self.commits


__all__ = ["Change", "Entry", "InFlight", "KeyView", "ReplicaView", "Usage", "acl_bytes",
           "canonical", "holders_of", "pack", "unpack"]
