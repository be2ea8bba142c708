"""What the client takes and returns: plain values, transfer argument types, require_read.

The values are defined with the protocol (blobha.wire.status) and re-exported here."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO

from blobha.core.errors import NotAuthorized
from blobha.wire.status import (
    BlobInfo,
    BlobMeta,
    ClusterSummary,
    JobToken,
    MasterSummary,
    ReplicationStatus,
    WaitResult,
)

__all__ = [
    "BlobInfo",
    "BlobMeta",
    "ClusterSummary",
    "JobToken",
    "MasterSummary",
    "ProgressCallback",
    "ReplicationStatus",
    "UploadData",
    "WaitResult",
    "require_read",
]

ProgressCallback = Callable[[int, int], None]
UploadData = bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO


def require_read(meta: BlobMeta, user: str) -> BlobMeta:
    """``meta``, when it grants ``user`` READ; else the NotAuthorized a read would meet. For
    a caller about to serve the blob from elsewhere (a node cache) on the strength of the
    metadata: masters show it to writers and administrators too."""
    if not meta.readable:
        raise NotAuthorized(
            f"user {user!r} lacks READ permission on {meta.key!r} (it may see the metadata"
            " only); ask a user with ADMIN on it to grant access")
    return meta
