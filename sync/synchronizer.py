"""Background replica synchronisation on every master (ha-rules 6-12): the facade over its parts.

A follower starts fetching a new version within milliseconds of its commit, and every master
keeps its copies and replica nodes in line with ZooKeeper. The parts, one module each:

* :mod:`blobha.sync.feed` - the change feed: ZooKeeper's changes (the recursive watch, or the
  change journal and one-shot watches) into queued keys and holder updates;
* :mod:`blobha.sync.view` - the replica view: what this master last read of every key, the
  figures, and the in-flight state, changed only by the view's methods named for their events;
* :mod:`blobha.sync.decide` - the pure decision per key: fetch, register, drop, prune, or the
  leader's duty;
* :mod:`blobha.sync.apply` - the executor: a batch's reads, decisions and their plans, with
  :mod:`blobha.sync.reads`, :mod:`blobha.sync.fetcher` and :mod:`blobha.sync.registry` (this
  master's replica nodes);
* :mod:`blobha.sync.loop` - the workers, the periodic reconcile and the retries.

The master and the synchroniser talk through :mod:`blobha.sync.protocols`: the leader's duties
and the cluster guard one way, :class:`~blobha.sync.protocols.ReplicaSync` (what the master's
parts use of this class) the other.
"""

from __future__ import annotations

from kazoo.client import KazooClient

from blobha.core.blobstate import BlobState
from blobha.store.local import LocalStore
from blobha.sync.apply import Executor
from blobha.sync.feed import ChangeFeed, Wake
from blobha.sync.fetcher import Fetcher
from blobha.sync.loop import SyncLoop
from blobha.sync.membership import Membership
from blobha.sync.protocols import ClusterGuard, LeaderDuties
from blobha.sync.reads import KeyReader
from blobha.sync.registry import ReplicaRegistry, SyncDeferred
from blobha.sync.settings import SyncSettings
from blobha.sync.view import KeyView, ReplicaView, Usage
from blobha.sync.workqueue import WorkQueue
from blobha.wire.peers import Peers


class Synchronizer:
    """Wires the parts, and keeps the methods the master calls."""

    def __init__(self, zk: KazooClient, store: LocalStore, identity: str, peers: Peers,
                 membership: Membership, settings: SyncSettings, duties: LeaderDuties,
                 guard: ClusterGuard) -> None:
        self.zk = zk
        self.store = store
        self.identity = identity
        self.peers = peers
        self.membership = membership
        self.settings = settings
        self.queue = WorkQueue(linger=settings.linger_secs)
        self.replicas = ReplicaView(identity, membership)
        self.wake = Wake()
        self.feed = ChangeFeed(zk, store, identity, membership, settings, self.replicas,
                               self.queue, guard, self.wake)
        self.registry = ReplicaRegistry(zk, identity, self.replicas, self.feed, self.queue,
                                        settings)
        self.fetcher = Fetcher(store, peers, identity, self.replicas, guard, settings,
                               membership.holding)
        self.executor = Executor(zk, store, identity, membership, settings, self.replicas,
                                 self.queue, self.feed, KeyReader(zk, self.feed, settings),
                                 self.registry, self.fetcher, duties, guard)
        self.loop = SyncLoop(zk, membership, settings, self.queue, self.replicas, self.feed,
                             self.executor, self.wake)
        zk.add_listener(self.feed.on_state)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.fetcher.shutdown()

    def reconcile_all(self) -> None:
        """Queue every key known to ZooKeeper or held locally (and re-arm the journal watch)."""
        self.loop.reconcile_all()

    def request_leader_pass(self) -> None:
        """This master took office: look at once at the keys that may call for a leader's
        duty, and at every other key in a paced pass (see Wake.ask_leader_pass). Without the
        recursive watch, a full reconcile as before (its reads re-arm the one-shot watches)."""
        if self.feed.recursive:
            self.wake.ask_leader_pass()
        else:
            self.wake.ask_full()

    def schedule(self, key: str) -> None:
        self.queue.put(key)

    def stepped_down(self) -> None:
        """This master stopped leading (see ChangeFeed.stepped_down)."""
        self.feed.stepped_down()

    def membership_changed(self) -> None:
        self.wake.kick()

    def session_id(self) -> int:
        """The current ZooKeeper session's id (0 when there is none)."""
        return self.registry.session_id()

    # ---- the replica view, for the cluster summary and the status page ----------------------

    def view(self, key: str) -> KeyView | None:
        return self.replicas.view(key)

    def views(self) -> dict[str, KeyView]:
        return self.replicas.views()

    def seen(self, key: str) -> tuple[float, int] | None:
        """(the creation time, the version) of ``key`` in this master's view (quotas)."""
        return self.replicas.seen(key)

    def usage(self, user: str) -> Usage:
        """What the keys ``user`` created hold, as this master's view has it (quotas)."""
        return self.replicas.usage(user)

    def key_count(self) -> int:
        """The keys this master's view holds (a moment behind ZooKeeper)."""
        return self.replicas.key_count()

    def keys_behind(self) -> tuple[int, int]:
        """Keys whose view awaits a read of an announced change (see ReplicaView.unread),
        and of those, the keys not read since the latest reconnect."""
        return self.replicas.behind()

    def figures(self) -> tuple[int, int, int]:
        """(keys, keys with fewer holders than their replication factor, keys this master
        should hold but lacks); see ReplicaView.figures."""
        return self.replicas.figures()

    # ---- this master's replica nodes and commits (see ReplicaRegistry) ----------------------

    def register_replica(self, key: str, seq: int) -> None:
        self.registry.register_replica(key, seq)

    def creating(self, keys: list[str]) -> None:
        self.registry.creating(keys)

    def created(self, keys: list[str]) -> None:
        self.registry.created(keys)

    def follow(self, key: str, seq: int) -> None:
        self.registry.follow(key, seq)

    def registered(self, key: str, seq: int, session: int, replication_factor: int,
                   state: BlobState | None = None, record: bytes = b"") -> None:
        self.registry.registered(key, seq, session, replication_factor, state, record)

    def corrupted(self, key: str, seq: int) -> None:
        self.registry.corrupted(key, seq)


__all__ = ["KeyView", "SyncDeferred", "SyncSettings", "Synchronizer"]
