"""A master's state as its edge reads it (metrics, the status page): plain figures, read when
asked, so the edge never reaches into ZooKeeper, the synchroniser or the store itself."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kazoo.client import KazooClient, KazooState

from blobha.leader import LeaderElection, LeaderHistory
from blobha.leader.history import Term
from blobha.master.channel import Channel
from blobha.master.forward import Forwarder
from blobha.master.groupcommit import GroupCommitter
from blobha.master.scrub import Scrubber
from blobha.master.summary import StatusSummary
from blobha.master.uploads import UploadManager
from blobha.master.waits import ReplicationWaits
from blobha.store.local import LocalStore
from blobha.sync import KeyView, Membership, ReplicaSync
from blobha.wire.status import ClusterSummary, MasterSummary
from blobha.zk.layout import MASTERS

#: What the background scrubber has done, by the names the edge exports.
SCRUB_FIGURES = ("files_verified", "bytes_verified", "corrupt_found", "passes")
#: What the data channel has done, likewise.
CHANNEL_FIGURES = ("transfers", "bytes_sent", "uploads", "bytes_received", "refused", "links")


@dataclass(frozen=True)
class StoreFigures:
    blobs: int
    stored_bytes: int
    segment_files: int
    segment_bytes: int
    segment_live_bytes: int
    disk_free: int
    uploads_in_progress: int


@dataclass(frozen=True)
class SyncFigures:
    keys: int
    under_replicated: int
    lag: int
    queue_depth: int
    batches: int
    batched_keys: int
    #: Keys whose view misses an announced change (see Synchronizer.keys_behind).
    keys_behind: int = 0


@dataclass(frozen=True)
class GroupCommitFigures:
    batches: int
    writes: int
    largest: int
    #: Versions forwarded to other holders (each once per holder), and the forwards' calls
    #: over stage links and over gRPC (blobha.master.forward).
    forwarded: int = 0
    over_links: int = 0
    over_grpc: int = 0


class StatusSource(Protocol):
    """What the edge may read of a master."""

    identity: str
    started: float
    zk_servers: str

    def is_leader(self) -> bool: ...
    def leader_address(self) -> str: ...
    def epoch(self) -> int: ...
    def seen_epoch(self) -> int: ...
    def leader_changes(self) -> int: ...
    def terms(self) -> list[Term]: ...
    def zk_state(self) -> str: ...
    def watch_callbacks(self) -> int: ...
    def replication_waits(self) -> int: ...
    def store(self) -> StoreFigures: ...
    def sync(self) -> SyncFigures: ...
    def group_commit(self) -> GroupCommitFigures: ...
    def scrub(self) -> dict[str, int] | None: ...
    def data_channel(self) -> dict[str, int] | None: ...
    def node_status(self) -> MasterSummary: ...
    def cluster_summary(self) -> ClusterSummary: ...
    def views(self) -> dict[str, KeyView]: ...
    def known_masters(self) -> int: ...
    def status_urls(self, addresses: list[str]) -> dict[str, str]: ...


class MasterStatus:
    """The :class:`StatusSource` of one master, over its collaborators."""

    def __init__(self, identity: str, zk_servers: str, session_timeout: float, zk: KazooClient,
                 election: LeaderElection, history: LeaderHistory, store: LocalStore,
                 uploads: UploadManager, sync: ReplicaSync, puts: GroupCommitter[Any, Any],
                 scrubber: Scrubber | None, membership: Membership, channel: Channel,
                 summary: StatusSummary, waits: ReplicationWaits,
                 forwarder: Forwarder | None = None) -> None:
        self.identity = identity
        self.zk_servers = zk_servers
        self.started = summary.started
        self._session_timeout = session_timeout
        self._zk = zk
        self._election = election
        self._history = history
        self._store = store
        self._uploads = uploads
        self._sync = sync
        self._puts = puts
        self._scrubber = scrubber
        self._membership = membership
        self._channel = channel
        self._summary = summary
        self._forwarder = forwarder
        self._waits = waits

    def is_leader(self) -> bool:
        return self._election.is_leader

    def leader_address(self) -> str:
        return self._election.leader_address

    def epoch(self) -> int:
        return self._election.epoch

    def seen_epoch(self) -> int:
        """The term this master last saw: its own while it leads."""
        if self._election.is_leader:
            return self._election.epoch
        current = self._history.current
        return current.epoch if current else 0

    def leader_changes(self) -> int:
        return self._history.changes

    def terms(self) -> list[Term]:
        return list(self._history.terms())

    def zk_state(self) -> str:
        return str(self._zk.state)

    def watch_callbacks(self) -> int:
        zk = self._zk
        # kazoo's own tables (no public count), which its connection thread changes: copied
        # in one step each, a count taken mid-change is retried by the next scrape at worst.
        held = sum(len(s) for s in list(zk._data_watchers.values()))
        return held + sum(len(s) for s in list(zk._child_watchers.values()))

    def replication_waits(self) -> int:
        return self._waits.replication_waits()

    def store(self) -> StoreFigures:
        count, stored = self._store.counted_usage()
        files, size, live = self._store.segments.stats()
        return StoreFigures(count, stored, files, size, live, self._store.disk_free(),
                            self._uploads.count())

    def sync(self) -> SyncFigures:
        keys, under, lag = self._sync.figures()
        queue = self._sync.queue
        behind, _ = self._sync.keys_behind()
        return SyncFigures(keys, under, lag, queue.depth(), queue.batches, queue.batched_keys,
                           behind)

    def group_commit(self) -> GroupCommitFigures:
        f = self._forwarder
        if f is None:
            return GroupCommitFigures(self._puts.batches, self._puts.writes, self._puts.largest)
        return GroupCommitFigures(self._puts.batches, self._puts.writes, self._puts.largest,
                                  f.forwarded, f.peers.links.over_links,
                                  f.peers.links.over_grpc)

    def scrub(self) -> dict[str, int] | None:
        if self._scrubber is None:
            return None
        return {name: int(getattr(self._scrubber, name)) for name in SCRUB_FIGURES}

    def data_channel(self) -> dict[str, int] | None:
        plane = self._channel.offers
        if plane is None:
            return None
        return {name: int(getattr(plane, name)) for name in CHANNEL_FIGURES}

    def node_status(self) -> MasterSummary:
        return self._summary.node_status()

    def cluster_summary(self) -> ClusterSummary:
        return self._summary.cluster_summary()

    def views(self) -> dict[str, KeyView]:
        return self._sync.views()

    def known_masters(self) -> int:
        return len(self._membership.known())

    def status_urls(self, addresses: list[str]) -> dict[str, str]:
        """Each master's status page, as registered in its membership node."""
        urls: dict[str, str] = {}
        if self._zk.state != KazooState.CONNECTED:
            return urls  # kazoo would queue the reads until it reconnects
        # Pipelined, and waited for at most the session timeout in all: a read made just as
        # the connection dropped is held by kazoo until ZooKeeper is back, and the page with
        # it.
        reads = [(address, self._zk.get_async(f"{MASTERS}/{address}")) for address in addresses]
        deadline = time.monotonic() + self._session_timeout
        for address, read in reads:
            try:
                data, _ = read.get(timeout=max(deadline - time.monotonic(), 0.0))
                url = json.loads(data).get("status_url", "")
            except Exception:
                continue  # gone, or ZooKeeper unreachable: no link, the row still shows
            if isinstance(url, str) and url.startswith("http://"):
                urls[address] = url
        return urls
