"""Protobuf <-> plain values: the one place that turns messages into values and back.

The values are those of blobha.wire.status and blobha.core.acl."""

from __future__ import annotations

from collections.abc import Iterable

from blobha.core.acl import AccessControl
from blobha.core.blobstate import BlobState
from blobha.core.consistency import MinVersion, View
from blobha.core.errors import InvalidArgument
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.status import (
    BlobInfo,
    BlobMeta,
    ClusterSummary,
    JobToken,
    MasterSummary,
    PeerPlan,
    ReplicationStatus,
    WaitResult,
)


def min_version_from_pb(request: pb.DownloadRequest | pb.GetMetaRequest
                        | pb.GetReplicationRequest | pb.PeerPlanRequest) -> MinVersion | None:
    """The request's minimum view of its key (None: any will do, as older clients ask)."""
    if not request.HasField("min_version"):
        return None
    m = request.min_version
    return MinVersion(m.version, m.created_at) if m.version else None


def view_from_pb(request: pb.DownloadRequest | pb.GetMetaRequest | pb.GetReplicationRequest
                 | pb.PeerPlanRequest) -> View:
    """The request's :class:`View` (SESSION when unset, as older clients ask)."""
    try:
        return View(request.view)
    except ValueError:
        raise InvalidArgument(f"unknown read view {request.view}; this master knows"
                              f" {', '.join(v.name for v in View)}") from None


def min_version_to_pb(minimum: MinVersion) -> pb.MinVersion:
    return pb.MinVersion(version=minimum.version, created_at=minimum.created_at)


def acl_from_pb(entries: Iterable[pb.AccessControl]) -> tuple[AccessControl, ...]:
    return tuple(AccessControl(e.type, e.name, e.access) for e in entries)


def acl_to_pb(acl: Iterable[AccessControl]) -> list[pb.AccessControl]:
    return [pb.AccessControl(type=e.type, name=e.name, access=e.access) for e in acl]


def state_to_pb(key: str, s: BlobState, replication: int, access: int) -> pb.BlobMeta:
    """A key's committed state as a master answers it, with its live replica count and the
    permissions the caller holds."""
    return pb.BlobMeta(
        key=key, version=s.seq, size=s.size, digest=s.digest, acl=acl_to_pb(s.acl),
        replication_factor=s.replication_factor, meta_version=s.meta_version,
        created_at=s.created_at, updated_at=s.updated_at, creator=s.creator,
        replication=replication, acknowledged=s.acked, access=access,
    )


def meta_from_pb(m: pb.BlobMeta) -> BlobMeta:
    return BlobMeta(
        key=m.key,
        version=m.version,
        size=m.size,
        digest=m.digest,
        acl=acl_from_pb(m.acl),
        replication_factor=m.replication_factor,
        meta_version=m.meta_version,
        created_at=m.created_at,
        updated_at=m.updated_at,
        creator=m.creator,
        replication=m.replication,
        acknowledged=m.acknowledged,
        access=m.access,
    )


def info_from_pb(i: pb.BlobInfo) -> BlobInfo:
    return BlobInfo(version=i.version, size=i.size, digest=i.digest)


def wait_result_from_pb(r: pb.WaitForReplicationResponse) -> WaitResult:
    return WaitResult(
        reached=r.reached,
        statuses=tuple(replication_from_pb(s) for s in r.status),
        waited_secs=r.waited_secs,
    )


def summary_from_pb(s: pb.ClusterSummaryResponse) -> ClusterSummary:
    return ClusterSummary(
        masters=tuple(master_from_pb(m) for m in s.masters),
        leader=s.leader,
        epoch=s.epoch,
        blob_count=s.blob_count,
        under_replicated=s.under_replicated,
        zookeeper_unreachable=s.zookeeper_unreachable,
    )


def replication_from_pb(r: pb.ReplicationStatus) -> ReplicationStatus:
    return ReplicationStatus(r.key, r.version, r.replication, r.replication_factor,
                             tuple(r.holders))


def replication_to_pb(r: ReplicationStatus) -> pb.ReplicationStatus:
    return pb.ReplicationStatus(key=r.key, version=r.version, replication=r.replication,
                                replication_factor=r.replication_factor, holders=r.holders)


def master_from_pb(m: pb.MasterSummary) -> MasterSummary:
    return MasterSummary(m.address, m.is_leader, m.uptime_secs, m.version, m.blob_count,
                         m.bytes_stored, m.disk_free, m.lag_blobs, m.reachable, m.epoch,
                         m.zookeeper_unreachable, m.keys_behind,
                         m.keys_unread_since_reconnect)


def master_to_pb(s: MasterSummary) -> pb.MasterSummary:
    return pb.MasterSummary(
        address=s.address, is_leader=s.is_leader, uptime_secs=s.uptime_secs, version=s.version,
        blob_count=s.blob_count, bytes_stored=s.bytes_stored, disk_free=s.disk_free,
        lag_blobs=s.lag_blobs, reachable=s.reachable, epoch=s.epoch,
        zookeeper_unreachable=s.zookeeper_unreachable, keys_behind=s.keys_behind,
        keys_unread_since_reconnect=s.keys_unread_since_reconnect,
    )


def job_token_to_pb(t: JobToken) -> pb.JobToken:
    return pb.JobToken(token=t.token, token_id=t.token_id, expires_at=t.expires_at,
                       keys=list(t.keys), user=t.user)


def job_token_from_pb(m: pb.JobToken) -> JobToken:
    return JobToken(token=m.token, token_id=m.token_id, expires_at=m.expires_at,
                    keys=tuple(m.keys), user=m.user)


def peer_plan_to_pb(plan: PeerPlan) -> pb.PeerPlanResponse:
    return pb.PeerPlanResponse(
        version=plan.version, size=plan.size, digest=plan.digest, created_at=plan.created_at,
        chunk_size=plan.chunk_size, chunk_digests=list(plan.chunk_digests),
        replicas=list(plan.replicas), peers=list(plan.peers), serve_key=plan.serve_key,
        grant_user=plan.grant_user, grant_expires=plan.grant_expires,
        ordinal=plan.ordinal, chunk_sha256=list(plan.chunk_sha256),
        grant_requester=plan.grant_requester,
        peer_grants=[pb.PeerGrant(address=a, mac=m) for a, m in plan.peer_grants])


def peer_plan_from_pb(key: str, m: pb.PeerPlanResponse) -> PeerPlan:
    return PeerPlan(key, m.version, m.size, m.digest, m.created_at, m.chunk_size,
                    tuple(m.chunk_digests), tuple(m.replicas), tuple(m.peers),
                    bytes(m.serve_key), m.grant_user, m.grant_expires, m.ordinal,
                    tuple(bytes(d) for d in m.chunk_sha256), m.grant_requester,
                    tuple((g.address, g.mac) for g in m.peer_grants))
