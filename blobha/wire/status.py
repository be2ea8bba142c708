"""Plain values the protocol carries: blob metadata, download info, replication and cluster status.

The client returns them and the masters build them. No protobuf here: their one conversion to
and from the wire is blobha.wire.convert."""

from __future__ import annotations

from dataclasses import dataclass

from blobha.core.acl import ALL, READ, AccessControl


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
    #: Keys whose last-read state awaits a read of a change ZooKeeper announced (or predates
    #: the latest reconnect): refused to reads while ZooKeeper is out of reach.
    keys_behind: int = 0
    #: Of those, the keys not read since the master's latest reconnect to ZooKeeper (0 once
    #: its full reconcile after the reconnect read them).
    keys_unread_since_reconnect: int = 0


@dataclass(frozen=True)
class BlobMeta:
    """Metadata of a blob's committed version."""

    key: str
    version: int
    size: int
    digest: str
    acl: tuple[AccessControl, ...]
    replication_factor: int
    meta_version: int
    created_at: float
    updated_at: float
    creator: str
    #: Live replicas holding this version when the answer was made (set on commit; else 0).
    replication: int
    #: The version reached its write quorum (its commit was acknowledged). False only for a
    #: version whose leader failed before the quorum: it may still be rolled back.
    acknowledged: bool = True
    #: What the caller may do with the key: bits READ (1), WRITE (2) and ADMIN (4). The
    #: metadata is shown to a user holding any of them (as in Storm), without the digest and
    #: the live replicas where it lacks READ; reading the blob takes READ (see
    #: :meth:`readable`). 0: a master older than the field, which answered readers alone.
    access: int = ALL

    @property
    def readable(self) -> bool:
        """Whether the caller may read the blob itself, not only its metadata."""
        return not self.access or bool(self.access & READ)


@dataclass(frozen=True)
class BlobInfo:
    """What a download delivered: the version, and the size and digest of the whole version."""

    version: int
    size: int
    digest: str


@dataclass(frozen=True)
class WaitResult:
    reached: bool
    statuses: tuple[ReplicationStatus, ...]
    waited_secs: float


@dataclass(frozen=True)
class ClusterSummary:
    masters: tuple[MasterSummary, ...]
    leader: str
    epoch: int
    blob_count: int
    under_replicated: int
    #: The master that answered has no ZooKeeper connection: the masters are those it last
    #: saw, and ``blob_count`` is unknown (0).
    zookeeper_unreachable: bool = False


@dataclass(frozen=True)
class JobToken:
    """A job token as issued (``blobha token job``): the token itself (shown once: the masters
    keep only its hash), its public id, when it expires (wall-clock seconds since the epoch),
    the keys it may read and the user it acts as."""

    token: str
    token_id: str
    expires_at: float
    keys: tuple[str, ...]
    user: str

    def __repr__(self) -> str:
        # The token is a secret: never in a log line or a traceback's locals.
        return (f"JobToken(token_id={self.token_id!r}, expires_at={self.expires_at!r},"
                f" keys={self.keys!r}, user={self.user!r})")


@dataclass(frozen=True)
class PeerPlan:
    """What a node cache needs to fetch one version from its peers and the replicas."""

    key: str
    version: int
    size: int
    digest: str
    created_at: float
    chunk_size: int
    chunk_digests: tuple[str, ...]
    #: gRPC host:port of the live masters holding the version.
    replicas: tuple[str, ...]
    #: host:port of caches that hold or fetch the version (never the caller).
    peers: tuple[str, ...]
    #: The key the caller's cache checks grants under when it serves this version at the
    #: address it announced (blobha.core.grants.serve_key); empty when it announced none.
    serve_key: bytes
    grant_user: str
    grant_expires: float
    #: Caches that announced the version to this master before the caller (see the proto).
    ordinal: int = 0
    #: SHA-256 of each chunk, from the masters' own bytes: what a piece from a peer must match
    #: (the xxh3 ``chunk_digests`` can be forged on purpose). Empty from an older master.
    chunk_sha256: tuple[bytes, ...] = ()
    #: The host the grants are bound to (the address the master saw the plan's call from).
    grant_requester: str = ""
    #: (peer address, grant MAC) for the peers the caller may ask, each under that peer's key.
    peer_grants: tuple[tuple[str, str], ...] = ()
