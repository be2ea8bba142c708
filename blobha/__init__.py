"""blobha: a ZooKeeper-coordinated, highly available, replicated blob store.

>>> from blobha import Client
>>> with Client("127.0.0.1:6627", user="alice") as c:  # doctest: +SKIP
...     c.create("geo", b"...", acl="o::r")
...     c.read("geo")
"""

from blobha.acl import AccessControl, format_acl, parse_acl
from blobha.cache import BlobCache
from blobha.client import Client
from blobha.credentials import Credentials
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
    Unauthenticated,
    Unavailable,
    UploadNotFound,
    VersionConflict,
)
from blobha.version import __version__

__all__ = [
    "AccessControl",
    "BlobCache",
    "BlobError",
    "ChecksumMismatch",
    "Client",
    "Credentials",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "KeyAlreadyExists",
    "KeyNotFound",
    "NotAuthorized",
    "NotLeader",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "UploadNotFound",
    "VersionConflict",
    "__version__",
    "format_acl",
    "parse_acl",
]
