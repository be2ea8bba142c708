"""The blobha Python client: one small facade over the wire protocol.

:class:`Client` finds the leader, retries what is safe to retry until a deadline, resumes broken
uploads, spreads downloads over the replicas and verifies them end to end. Everything it returns
is a plain frozen dataclass, and every failure is a :class:`~blobha.core.errors.BlobError`
subclass: no protobuf or gRPC type crosses this package's boundary.

The network sits behind :class:`Transport` (four calls taking and returning plain values), so the
logic can be exercised without sockets. The parts: ``facade`` (:class:`Client`), ``writes``
(create, update, put, delete), ``reads`` (exists, metadata, listings with it, a blob as a file or in
pieces), ``routing`` (leader discovery, redirects, retries), ``upload`` and ``download`` (the
transfers),
``sources`` (upload sources, download sinks), ``transport`` (gRPC), ``retry`` (backoff and
deadlines), ``arguments`` (defaults and checks) and ``values`` (what the calls return).
"""

from __future__ import annotations

from blobha.client.arguments import DEFAULT_CHUNK_SIZE, default_user
from blobha.client.arguments import MAX_CHUNK_SIZE as MAX_CHUNK_SIZE
from blobha.client.arguments import MIN_CHUNK_SIZE as MIN_CHUNK_SIZE
from blobha.client.arguments import STALL_TIMEOUT as STALL_TIMEOUT
from blobha.client.arguments import KiB as KiB
from blobha.client.arguments import MiB as MiB
from blobha.client.arguments import default_address_map as default_address_map
from blobha.client.arguments import parse_address_map as parse_address_map
from blobha.client.facade import LIST_PAGE as LIST_PAGE
from blobha.client.facade import Client
from blobha.client.limits import ClientLimits
from blobha.client.retry import BACKOFF_BASE as BACKOFF_BASE
from blobha.client.retry import BACKOFF_CAP as BACKOFF_CAP
from blobha.client.retry import backoff_delay
from blobha.client.transport import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from blobha.client.transport import GrpcTransport as GrpcTransport
from blobha.client.transport import Transport
from blobha.client.values import (
    BlobInfo,
    BlobMeta,
    ClusterSummary,
    JobToken,
    MasterSummary,
    ReplicationStatus,
    WaitResult,
)
from blobha.client.values import ProgressCallback as ProgressCallback
from blobha.client.values import UploadData as UploadData
from blobha.client.values import require_read as require_read
from blobha.core.addresses import DEFAULT_PORT, parse_cluster
from blobha.core.auth import USER_METADATA_KEY as USER_METADATA_KEY
from blobha.core.digest import PUT_MAX_BYTES as PUT_MAX_BYTES

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PORT",
    "BlobInfo",
    "BlobMeta",
    "Client",
    "ClientLimits",
    "ClusterSummary",
    "JobToken",
    "MasterSummary",
    "ReplicationStatus",
    "Transport",
    "WaitResult",
    "backoff_delay",
    "default_user",
    "parse_cluster",
]
