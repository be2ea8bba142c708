"""The status summary: this master's own figures, and the cluster as it sees it."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    ConnectionLoss,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError

from blobha.core.errors import (
    BlobError,
)
from blobha.core.version import __version__
from blobha.leader import LeaderElection
from blobha.store.local import LocalStore
from blobha.sync import Membership, ReplicaSync
from blobha.wire.peers import Peers
from blobha.wire.status import ClusterSummary, MasterSummary
from blobha.zk.layout import BLOBSTORE, EPOCH, EpochRecord

log = logging.getLogger("blobha.master")


#: How long a cluster summary waits for its ZooKeeper reads.
SUMMARY_ZK_TIMEOUT = 2.0


class StatusSummary:
    """Answers node-status and cluster-summary calls."""

    def __init__(self, identity: str, store: LocalStore, zk: KazooClient,
                 election: LeaderElection, sync: ReplicaSync, membership: Membership,
                 peers: Peers) -> None:
        self.identity = identity
        self.store = store
        self.zk = zk
        self.election = election
        self.sync = sync
        self.membership = membership
        self.peers = peers
        self.started = time.monotonic()
        self._summary_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="summary")

    def close(self) -> None:
        self._summary_pool.shutdown(wait=False, cancel_futures=True)

    def node_status(self) -> MasterSummary:
        return self._status(self.sync.figures()[2])

    def _status(self, lag: int) -> MasterSummary:
        """This master's summary, with ``lag`` from the synchroniser's figures."""
        count, stored = self.store.counted_usage()
        behind, since_reconnect = self.sync.keys_behind()
        return MasterSummary(
            address=self.identity, is_leader=self.election.is_leader,
            uptime_secs=time.monotonic() - self.started, version=__version__, blob_count=count,
            bytes_stored=stored, disk_free=self.store.disk_free(), lag_blobs=lag,
            reachable=True, epoch=self.election.epoch,
            zookeeper_unreachable=self.zk.state != KazooState.CONNECTED,
            keys_behind=behind, keys_unread_since_reconnect=since_reconnect,
        )

    def cluster_summary(self) -> ClusterSummary:
        """The masters as this one sees them, with the leader among them.

        Without a ZooKeeper connection this still answers, from the masters it last saw:
        the command an operator runs to find out what is wrong must not be the one that hangs.
        The leader is still the one that says so (only a leader with its own live session
        does), the blob count is unknown (0), and ``zookeeper_unreachable`` says which view
        this is."""
        members = sorted(self.membership.live() | {self.identity})
        # One pass for both figures: under writes, a second call would make a second pass.
        _, under, lag = self.sync.figures()

        def ask(address: str) -> MasterSummary:
            if address == self.identity:
                return self._status(lag)
            try:
                return self.peers.status(address, timeout=1.5)
            except BlobError:
                return MasterSummary(address, False, 0.0, "", 0, 0, 0, 0, False, 0)

        # Both reads at once, and bounded: a ZooKeeper that lost its quorum may hold a request
        # until the session notices, and clients discover the leader through this call, so it
        # must answer quickly rather than leave them guessing.
        reads = ((self.zk.get_async(EPOCH), self.zk.exists_async(BLOBSTORE))
                 if self.zk.state == KazooState.CONNECTED else None)
        statuses = tuple(self._summary_pool.map(ask, members))
        leader = next((s.address for s in statuses if s.is_leader), "")
        counted = _epoch_and_count(*reads) if reads is not None else None
        if counted is not None:
            return ClusterSummary(statuses, leader, *counted, under)
        # The leader's own status carries the epoch it leads.
        epoch_led = next((s.epoch for s in statuses if s.is_leader), 0)
        return ClusterSummary(statuses, leader, epoch_led, 0, under, zookeeper_unreachable=True)


def _epoch_and_count(epoch_read: Any, count_read: Any) -> tuple[int, int] | None:
    """The cluster's epoch and key count from the summary's two reads (the key count is the
    child count of /blobstore, not 100,000s of names); None if ZooKeeper did not answer in
    time."""
    try:
        try:
            epoch = EpochRecord.decode(epoch_read.get(timeout=SUMMARY_ZK_TIMEOUT)[0]).epoch
        except NoNodeError:
            epoch = 0
        stat = count_read.get(timeout=SUMMARY_ZK_TIMEOUT)  # exists: None if absent
    except (KazooTimeoutError, ConnectionLoss, SessionExpiredError):
        return None
    return epoch, stat.numChildren if stat is not None else 0
