"""Background replica synchronisation (imported as ``blobha.sync``)."""

from blobha.sync.membership import IdentityInUse, Membership, SessionRecord
from blobha.sync.synchronizer import KeyView, SyncDeferred, Synchronizer, SyncSettings
from blobha.sync.workqueue import WorkQueue

__all__ = [
    "IdentityInUse", "KeyView", "Membership", "SessionRecord", "SyncDeferred", "SyncSettings",
    "Synchronizer", "WorkQueue",
]
