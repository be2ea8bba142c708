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
    "check_body",
    "require_read",
]

ProgressCallback = Callable[[int, int], None]
#: What a write takes as the blob's body: bytes (bytes, bytearray, memoryview) or a binary file
#: object are the content; a path-like (``pathlib.Path``) names a file holding it. A plain
#: ``str`` is neither (see :func:`check_body`).
UploadData = bytes | bytearray | memoryview | os.PathLike[str] | BinaryIO


def check_body(data: object) -> None:
    """Refuse a ``str`` body: it could be the content or a file's name, and guessing either
    way writes the wrong blob without a word."""
    if isinstance(data, str):
        raise TypeError("a str body is ambiguous: pass data.encode() for content or Path(...)"
                        " for a file")


def require_read(meta: BlobMeta, user: str) -> BlobMeta:
    """``meta``, when it grants ``user`` READ; else the NotAuthorized a read would meet. For
    a caller about to serve the blob from elsewhere (a node cache) on the strength of the
    metadata: masters show it to writers and administrators too."""
    if not meta.readable:
        raise NotAuthorized(
            f"user {user!r} lacks READ permission on {meta.key!r} (it may see the metadata"
            " only); ask a user with ADMIN on it to grant access")
    return meta
