"""blobha: a ZooKeeper-coordinated, highly available, replicated blob store.

>>> from blobha import Client
>>> with Client("127.0.0.1:6627", user="alice") as c:  # doctest: +SKIP
...     c.create("geo", b"...", acl="o::r")
...     c.read("geo")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blobha.core.lazy import lazy_attributes

if TYPE_CHECKING:
    from blobha.cache import BlobCache
    from blobha.client import Client
    from blobha.core.acl import AccessControl, format_acl, parse_acl
    from blobha.core.errors import (
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
        TlsMismatch,
        Unauthenticated,
        Unavailable,
        UploadNotFound,
        VersionConflict,
    )
    from blobha.core.version import __version__
    from blobha.wire.credentials import Credentials

# Where each public name lives. They are imported on first access, not with the package:
# every submodule import (blobha.spark in a Spark task, say) runs this file first, and the
# client brings grpc, protobuf and cryptography, which a task served from a warm node cache
# never uses; loading them would cost it more than the lookup itself.
_EXPORTS = {
    "AccessControl": "blobha.core.acl",
    "format_acl": "blobha.core.acl",
    "parse_acl": "blobha.core.acl",
    "BlobCache": "blobha.cache",
    "Client": "blobha.client",
    "Credentials": "blobha.wire.credentials",
    "BlobError": "blobha.core.errors",
    "ChecksumMismatch": "blobha.core.errors",
    "DeadlineExceeded": "blobha.core.errors",
    "InternalError": "blobha.core.errors",
    "InvalidArgument": "blobha.core.errors",
    "KeyAlreadyExists": "blobha.core.errors",
    "KeyNotFound": "blobha.core.errors",
    "NotAuthorized": "blobha.core.errors",
    "NotLeader": "blobha.core.errors",
    "ResourceExhausted": "blobha.core.errors",
    "TlsMismatch": "blobha.core.errors",
    "Unauthenticated": "blobha.core.errors",
    "Unavailable": "blobha.core.errors",
    "UploadNotFound": "blobha.core.errors",
    "VersionConflict": "blobha.core.errors",
    "__version__": "blobha.core.version",
}


__getattr__, __dir__ = lazy_attributes("blobha", _EXPORTS, globals())


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
    "TlsMismatch",
    "Unauthenticated",
    "Unavailable",
    "UploadNotFound",
    "VersionConflict",
    "__version__",
    "format_acl",
    "parse_acl",
]
