"""Background replica synchronisation (imported as ``blobha.sync``)."""

from blobha.sync.membership import IdentityInUse, Membership, SessionRecord
from blobha.sync.protocols import ClusterGuard, LeaderDuties, ReplicaSync
from blobha.sync.synchronizer import KeyView, SyncDeferred, Synchronizer, SyncSettings
from blobha.sync.view import Usage, acl_bytes
from blobha.sync.workqueue import WorkQueue

__all__ = [
    "ClusterGuard", "IdentityInUse", "KeyView", "LeaderDuties", "Membership", "ReplicaSync",
    "SessionRecord", "SyncDeferred", "SyncSettings", "Synchronizer", "Usage", "WorkQueue",
    "acl_bytes",
]
