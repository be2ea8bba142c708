"""blobha: a ZooKeeper-coordinated, highly available, replicated blob store."""

from blobha.acl import AccessControl, format_acl, parse_acl
from blobha.errors import (
    BlobError,
    ChecksumMismatch,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    NotLeader,
    ResourceExhausted,
    Unavailable,
    UploadNotFound,
    VersionConflict,
)
from blobha.version import __version__

__all__ = [
    "AccessControl",
    "BlobError",
    "ChecksumMismatch",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "KeyAlreadyExists",
    "KeyNotFound",
    "NotAuthorized",
    "NotLeader",
    "ResourceExhausted",
    "Unavailable",
    "UploadNotFound",
    "VersionConflict",
    "__version__",
    "format_acl",
    "parse_acl",
]
