"""blobha: a ZooKeeper-coordinated, highly available, replicated blob store.

>>> from blobha import Client
>>> with Client("127.0.0.1:6627", user="alice") as c:  # doctest: +SKIP
...     c.create("geo", b"...", acl="o::r")
...     c.read("geo")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        TlsMismatch,
        Unauthenticated,
        Unavailable,
        UploadNotFound,
        VersionConflict,
    )
    from blobha.version import __version__

# Where each public name lives. They are imported on first access, not with the package:
# every submodule import (blobha.spark in a Spark task, say) runs this file first, and the
# client brings grpc, protobuf and cryptography, which a task served from a warm node cache
# never uses; loading them would cost it more than the lookup itself.
_EXPORTS = {
    "AccessControl": "blobha.acl",
    "format_acl": "blobha.acl",
    "parse_acl": "blobha.acl",
    "BlobCache": "blobha.cache",
    "Client": "blobha.client",
    "Credentials": "blobha.credentials",
    "BlobError": "blobha.errors",
    "ChecksumMismatch": "blobha.errors",
    "DeadlineExceeded": "blobha.errors",
    "InternalError": "blobha.errors",
    "InvalidArgument": "blobha.errors",
    "KeyAlreadyExists": "blobha.errors",
    "KeyNotFound": "blobha.errors",
    "NotAuthorized": "blobha.errors",
    "NotLeader": "blobha.errors",
    "ResourceExhausted": "blobha.errors",
    "TlsMismatch": "blobha.errors",
    "Unauthenticated": "blobha.errors",
    "Unavailable": "blobha.errors",
    "UploadNotFound": "blobha.errors",
    "VersionConflict": "blobha.errors",
    "__version__": "blobha.version",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'blobha' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
