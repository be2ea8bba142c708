"""Plain views of replication and master status, shared by the client and the masters, with
their one conversion to and from the wire."""

from __future__ import annotations

from dataclasses import dataclass

from blobha.v1 import blobha_pb2 as pb


@dataclass(frozen=True)
class ReplicationStatus:
    key: str
    version: int
    replication: int
    replication_factor: int
    #: host:port of every live master holding the committed version.
    holders: tuple[str, ...]


@dataclass(frozen=True)
class MasterSummary:
    address: str
    is_leader: bool
    uptime_secs: float
    version: str
    blob_count: int
    bytes_stored: int
    disk_free: int
    #: Committed versions this master should hold but does not yet.
    lag_blobs: int
    #: False when the master is registered but did not answer.
    reachable: bool
    epoch: int
    #: The master answered but has no ZooKeeper connection (reads of what it holds only).
    zookeeper_unreachable: bool = False


def replication_from_pb(r: pb.ReplicationStatus) -> ReplicationStatus:
    return ReplicationStatus(r.key, r.version, r.replication, r.replication_factor,
                             tuple(r.holders))


def replication_to_pb(r: ReplicationStatus) -> pb.ReplicationStatus:
    return pb.ReplicationStatus(key=r.key, version=r.version, replication=r.replication,
                                replication_factor=r.replication_factor, holders=r.holders)


def master_from_pb(m: pb.MasterSummary) -> MasterSummary:
    return MasterSummary(m.address, m.is_leader, m.uptime_secs, m.version, m.blob_count,
                         m.bytes_stored, m.disk_free, m.lag_blobs, m.reachable, m.epoch,
                         m.zookeeper_unreachable)


def master_to_pb(s: MasterSummary) -> pb.MasterSummary:
    return pb.MasterSummary(
        address=s.address, is_leader=s.is_leader, uptime_secs=s.uptime_secs, version=s.version,
        blob_count=s.blob_count, bytes_stored=s.bytes_stored, disk_free=s.disk_free,
        lag_blobs=s.lag_blobs, reachable=s.reachable, epoch=s.epoch,
        zookeeper_unreachable=s.zookeeper_unreachable,
    )
