"""The blobha Python client: one small facade over the wire protocol.

:class:`Client` finds the leader, retries what is safe to retry until a deadline, resumes broken
uploads, spreads downloads over the replicas and verifies them end to end. Everything it returns
is a plain frozen dataclass defined here, and every failure is a
:class:`~blobha.core.errors.BlobError` subclass: no protobuf or gRPC type crosses this module's
boundary.

The network sits behind :class:`Transport` (four calls taking and returning plain values), so the
logic here can be exercised without sockets.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import getpass
import io
import os
import queue
import random
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, NoReturn, Protocol, TypeVar

import grpc

from blobha.core import errors
from blobha.core.acl import (
    ALL,
    READ,
    AccessControl,
    check_entries,
    name_problem,
    normalize_for_set,
    parse_acl,
)
from blobha.core.addresses import DEFAULT_PORT, host_of, parse_cluster
from blobha.core.digest import PUT_MAX_BYTES, Digester
from blobha.core.errors import (
    NO_ANSWER,
    BlobError,
    Busy,
    ChecksumMismatch,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    NotLeader,
    TlsMismatch,
    Unauthenticated,
    Unavailable,
    UploadNotFound,
    VersionConflict,
)
from blobha.core.keys import validate_key
from blobha.v1 import blobha_pb2 as pb
from blobha.wire import chunks as chunkwire
from blobha.wire.credentials import Credentials
from blobha.wire.dataplane import MIN_BYTES as _DATA_CHANNEL_MIN_BYTES
from blobha.wire.dataplane import DataChannels, DataChannelUnusable, DataOffer, send_upload
from blobha.wire.stallwatch import CallWatch, Pending, Stalled, StallWatch
from blobha.wire.status import (
    MasterSummary,
    ReplicationStatus,
    master_from_pb,
    replication_from_pb,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PORT",
    "BlobInfo",
    "BlobMeta",
    "Client",
    "ClusterSummary",
    "MasterSummary",
    "ReplicationStatus",
    "Transport",
    "WaitResult",
    "backoff_delay",
    "default_user",
    "parse_cluster",
]

KiB = 1024
MiB = 1024 * KiB

DEFAULT_CHUNK_SIZE = MiB
MIN_CHUNK_SIZE = 256 * KiB
MAX_CHUNK_SIZE = MiB
#: Bounded on both ends so one message can never exhaust memory; a chunk is at most 1 MiB.
MAX_MESSAGE_BYTES = 8 * MiB
USER_METADATA_KEY = "x-blobha-user"
#: Keys per List call: the most a master serves (blobha.master.facade.MAX_PAGE).
LIST_PAGE = 1000

BACKOFF_BASE = 0.05
# Low on purpose: during a failover every retry is a cheap probe, and a long sleep would leave
# the client idle after the new leader is ready (with full jitter the mean wait is cap / 2).
BACKOFF_CAP = 0.5

# Transfers move in segments, one RPC each: a segment is the unit of resumption (an upload
# segment is acknowledged as a whole, so a non-seekable source needs to keep at most one segment
# in memory), and a per-segment deadline catches a stalled peer without capping the total
# transfer time.
_UPLOAD_SEGMENT_BYTES = 16 * MiB
# Over the data channel a segment costs a GetUploadStatus call and a connection more, so a
# source that keeps nothing in memory (bytes, a file; not a pipe) sends larger ones.
_CHANNEL_SEGMENT_BYTES = 64 * MiB
#: Blobs up to this size go whole in one Put call (module level so tests can lower it).
_PUT_MAX_BYTES = PUT_MAX_BYTES
# Downloads keep nothing in memory, and each new stream pays a flow-control ramp-up, so their
# segments are larger (measured on loopback: 64 MiB segments are ~25% faster than 16 MiB).
_DOWNLOAD_SEGMENT_BYTES = 64 * MiB
#: Seconds a master may go silent before the client moves on: a replica that sends nothing
#: during a download (the download resumes from another where it stopped), or a master that
#: neither answers a call nor, after half of this, a status check. A paused, overloaded or
#: cut-off master keeps its connections open, its place in the replica list and its leadership
#: until its ZooKeeper session expires; the client's whole timeout is far too long to wait for
#: it. Data arrives in pieces of at most 1 MiB, so only a link slower than 100 KiB/s looks
#: stalled, and the download still goes on.
STALL_TIMEOUT = 10.0
_MIN_STALL_TIMEOUT = 0.5
# One round of leader discovery; ClusterSummary itself asks every master, so allow it time.
_PROBE_TIMEOUT = 10.0
#: Longest wait for a cheap control call (begin an upload, ask how much arrived). A leader that
#: takes longer is treated as gone (paused, partitioned, half-dead) and another is looked for;
#: retrying these calls is harmless, an unanswered upload simply expires on the server.
_CONTROL_TIMEOUT = 8.0
#: A server-side replication wait answers at its deadline (or half a second before the call's
#: own, whichever is first); the call, and a wait with all its retries, may outlive the wait's
#: timeout by this much, for that answer to arrive.
_WAIT_GRACE = 2.0
#: Seconds a write whose outcome is unknown at its deadline may take beyond it to find out.
_OUTCOME_GRACE = 2.0
# "Wait forever" is a loop of bounded server calls so a dead master is noticed.
_FOREVER_SLICE = 60.0
_ABORT_TIMEOUT = 2.0
#: What a master answers about the caller, not about itself: no credential, a wrong one, no
#: permission, a bad request. Every master would say the same, so it is reported at once
#: instead of being retried until the deadline as if the cluster were unavailable.
_REFUSALS: tuple[type[BlobError], ...] = (NotAuthorized, InvalidArgument)
#: How long a credential refused by every master is asked about again before the refusal is
#: final: a master reads its token file again at most once a second, so a token added just
#: now may be refused for that long (twice that, and some, for a busy master).
_REFUSAL_PATIENCE = 3.0
#: How long a call retries quietly before Client.on_retry hears of it: a failover's redirect
#: or a master's restart is usually over by then, and needs no word to the user.
_RETRY_NOTICE_AFTER = 2.0
_NOT_HELD_PREFIX = "not held here"

_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Masters are reached directly; an http_proxy variable meant for web traffic must not
    # silently reroute (or break) cluster traffic.
    ("grpc.enable_http_proxy", 0),
    # A paused or partitioned master still has a kernel that accepts TCP, so a call to it
    # would hang until its deadline. HTTP/2 pings need the process itself: an unanswered ping
    # closes the connection and fails the call with UNAVAILABLE, and the client moves on.
    ("grpc.keepalive_time_ms", 4000),
    ("grpc.keepalive_timeout_ms", 4000),
    # Likewise a reconnection to such a master gives up after this long instead of 20 s.
    ("grpc.min_reconnect_backoff_ms", 3000),
    ("grpc.http2.max_pings_without_data", 0),
    chunkwire.CALLER_THREAD_STREAMS,
)

T = TypeVar("T")

ProgressCallback = Callable[[int, int], None]
UploadData = bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO


# --------------------------------------------------------------------------------------------
# Plain results
# --------------------------------------------------------------------------------------------


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


def require_read(meta: BlobMeta, user: str) -> BlobMeta:
    """``meta``, when it grants ``user`` READ; else the NotAuthorized a read would meet. For
    a caller about to serve the blob from elsewhere (a node cache) on the strength of the
    metadata: masters show it to writers and administrators too."""
    if not meta.readable:
        raise NotAuthorized(
            f"user {user!r} lacks READ permission on {meta.key!r} (it may see the metadata"
            " only); ask a user with ADMIN on it to grant access ('blobha set-acl')")
    return meta


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


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------


def backoff_delay(
    attempt: int,
    base: float = BACKOFF_BASE,
    cap: float = BACKOFF_CAP,
    rand: Callable[[], float] = random.random,
) -> float:
    """Full-jitter exponential backoff: uniform in ``[0, min(cap, base * 2**attempt))``.

    Full jitter spreads the retries of many clients that failed together (a leader failover)
    instead of having them hit the new leader in waves.
    """
    ceiling = min(cap, base * 2.0 ** min(max(attempt, 0), 32))
    return float(rand()) * ceiling


def parse_address_map(text: str) -> dict[str, str]:
    """``"ADVERTISED=DIAL,..."``, e.g. ``"m1:6627=127.0.0.1:16627,m2:6627=127.0.0.1:16628"``.

    Masters identify themselves by their advertised address (``master.advertise``), which is
    what the cluster summary and replica lists return. A client outside the masters' network
    (containers reached through published ports, NAT) cannot dial those, so it maps them."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        advertised, sep, dial = item.partition("=")
        if not sep:
            raise InvalidArgument(
                f"bad address map entry {item!r}: expected ADVERTISED_HOST:PORT=DIAL_HOST:PORT"
            )
        out[parse_cluster(advertised)[0]] = parse_cluster(dial)[0]
    return out


def default_address_map() -> dict[str, str]:
    """``$BLOBHA_ADDRESS_MAP`` parsed (empty when unset)."""
    return parse_address_map(os.environ.get("BLOBHA_ADDRESS_MAP", ""))


def default_user() -> str:
    """The caller's identity: ``$BLOBHA_USER``, else the operating-system user."""
    user = os.environ.get("BLOBHA_USER", "").strip()
    if user:
        return user
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        raise InvalidArgument(
            "cannot tell who you are; set BLOBHA_USER or pass a user name"
        ) from None


def _check_user(user: str) -> str:
    # The masters' rule (a name appears in ACLs), checked here so a bad name fails before any
    # call with the reason, not as a refusal from every master.
    problem = name_problem(user)
    if problem:
        raise InvalidArgument(f"invalid user name {user!r}: it {problem}")
    # Call metadata values must be printable ASCII; a bad name would otherwise fail deep
    # inside gRPC with an obscure message on the first call.
    if not all(" " <= c <= "~" for c in user):
        raise InvalidArgument(
            f"invalid user name {user!r}: use printable ASCII (letters, digits, punctuation)"
        )
    return user


def _check_chunk_size(chunk_size: int) -> int:
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidArgument(
            f"chunk_size {chunk_size} is out of range: use {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}"
            " bytes"
        )
    return chunk_size


def _normalize_acl(acl: str | Sequence[AccessControl] | None) -> builtins.list[AccessControl]:
    if acl is None:
        return []
    if isinstance(acl, str):
        return parse_acl(acl)
    entries = builtins.list(acl)
    for e in entries:
        if not isinstance(e, AccessControl):
            raise InvalidArgument(
                f"ACL entries must be AccessControl values or a string like 'u:alice:rwa', not"
                f" {type(e).__name__}"
            )
    # Values built in code skip the parser: the same rules (type, access bits, user names,
    # duplicates) are checked here so a bad entry fails before any call, as a string would.
    return check_entries(entries)


#: The clock deadlines read; a module attribute so tests can drive time without sleeping.
_monotonic: Callable[[], float] = time.monotonic


class _Deadline:
    """A point in time, restartable: transfers restart it whenever they make progress."""

    def __init__(self, seconds: float, clock: Callable[[], float] | None = None) -> None:
        self.seconds = seconds
        self._clock = clock if clock is not None else _monotonic
        self._end = self._clock() + seconds
        #: Whether Client.on_retry has heard of this call's retries (once per call).
        self.noticed = False

    def remaining(self) -> float:
        return max(0.0, self._end - self._clock())

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def restart(self) -> None:
        self._end = self._clock() + self.seconds


# --------------------------------------------------------------------------------------------
# Protobuf <-> dataclasses (the only place that reads pb messages)
# --------------------------------------------------------------------------------------------


def _acl_from_pb(entries: Iterable[pb.AccessControl]) -> tuple[AccessControl, ...]:
    return tuple(AccessControl(e.type, e.name, e.access) for e in entries)


def _acl_to_pb(acl: Iterable[AccessControl]) -> builtins.list[pb.AccessControl]:
    return [pb.AccessControl(type=e.type, name=e.name, access=e.access) for e in acl]


def _meta_from_pb(m: pb.BlobMeta) -> BlobMeta:
    return BlobMeta(
        key=m.key,
        version=m.version,
        size=m.size,
        digest=m.digest,
        acl=_acl_from_pb(m.acl),
        replication_factor=m.replication_factor,
        meta_version=m.meta_version,
        created_at=m.created_at,
        updated_at=m.updated_at,
        creator=m.creator,
        replication=m.replication,
        acknowledged=m.acknowledged,
        access=m.access,
    )


def _info_from_pb(i: pb.BlobInfo) -> BlobInfo:
    return BlobInfo(version=i.version, size=i.size, digest=i.digest)


def _wait_result_from_pb(r: pb.WaitForReplicationResponse) -> WaitResult:
    return WaitResult(
        reached=r.reached,
        statuses=tuple(replication_from_pb(s) for s in r.status),
        waited_secs=r.waited_secs,
    )


def _summary_from_pb(s: pb.ClusterSummaryResponse) -> ClusterSummary:
    return ClusterSummary(
        masters=tuple(master_from_pb(m) for m in s.masters),
        leader=s.leader,
        epoch=s.epoch,
        blob_count=s.blob_count,
        under_replicated=s.under_replicated,
        zookeeper_unreachable=s.zookeeper_unreachable,
    )


# --------------------------------------------------------------------------------------------
# Transport
# --------------------------------------------------------------------------------------------


class Transport(Protocol):
    """How the client reaches one master. Implementations raise only :class:`BlobError`."""

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None) -> Any:
        """The call's answer; ``stall``: after this many seconds without one, the master is
        asked whether it is there at all, and a master that does not answer that either
        fails the call with :class:`Unavailable` (the call itself may still have run)."""
        ...

    def client_stream(
        self, address: str, method: str, requests: Iterator[Any], timeout: float | None,
        stall: float | None = None,
    ) -> Any:
        """The call's answer; ``stall`` as for :meth:`unary`."""
        ...

    def server_stream(
        self, address: str, method: str, request: Any, timeout: float | None,
        stall: float | None = None,
    ) -> Iterator[Any]:
        """The call's messages; ``stall``: seconds the master may send nothing before the
        call is abandoned with :class:`Unavailable` (time the consumer spends on a message
        does not count)."""
        ...

    def probe(
        self, addresses: Sequence[str], method: str, request: Any, timeout: float
    ) -> Generator[tuple[str, Any], None, None]:
        """Call every address at once; yield ``(address, response or BlobError)`` as they end."""
        ...

    def data_host(self, address: str) -> str | None:
        """The host to dial for the data channel of ``address`` (blobha.wire.dataplane), or None
        when downloads must stay in gRPC (over TLS, whose protection the channel lacks)."""
        ...

    def close(self) -> None: ...


class _HandshakeFailed(Unavailable):
    """The TLS handshake with ``addresses`` failed in a way only a TLS peer that disagrees
    can cause: its certificate did not verify against the client's CA, or it answered in plain
    text. Transient at most while certificates are being replaced (masters reload theirs), so
    the client gives up early once every master says so (see :meth:`Client._retry`)."""

    def __init__(self, message: str, addresses: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.addresses = addresses


def _handshake_failure(address: str, details: str, tls: bool) -> Unavailable | None:
    """What to say of a connection that failed, perhaps for want of TLS agreement, with what
    to change; None for any other unavailability. Only a :class:`_HandshakeFailed` is proof of
    a mismatch: a connection closed at once is also what a proxy or load balancer with no
    master behind it does, so that is only a hint."""
    lowered = details.lower()
    if "hostname verification check failed" in lowered:
        return _HandshakeFailed(
            f"no TLS connection to master {address}: its certificate does not name the address"
            " dialled; reach the masters by an address their certificates name (see"
            f" BLOBHA_ADDRESS_MAP), or give them certificates that name it ({details})",
            frozenset({address}))
    if "handshake failed" in lowered:
        if "wrong_version_number" in lowered:
            advice = ("it does not use TLS; drop --ca / BLOBHA_CA and any client certificate, or"
                      " enable TLS on the masters")
        else:
            advice = ("its certificate did not verify against the CA given in --ca / BLOBHA_CA;"
                      " pass the CA that signed the masters' certificates")
        return _HandshakeFailed(f"no TLS connection to master {address}: {advice} ({details})",
                                frozenset({address}))
    if ("failed to connect" in lowered and "socket closed" in lowered
            and "handshake read failed" not in lowered):
        # Closed before any HTTP/2 frame: what a TLS master does to a plain-text client, and
        # (TLS 1.3 ends the handshake before the server judges the client) a master that wants
        # a client certificate to one with none or a foreign one; but also a proxy whose
        # master is down. So it is retried like any unavailability, with the likely fix. (A
        # TLS client that a proxy cuts off sees its handshake's read fail: no hint there.)
        if tls:
            hint = ("if the masters ask for client certificates, pass --cert/--key"
                    " (BLOBHA_CERT/BLOBHA_KEY) with one that their CA signed")
        else:
            hint = ("if the masters use TLS, pass --ca / BLOBHA_CA with the CA that signed their"
                    " certificates")
        return Unavailable(f"master {address} unavailable: {details} ({hint})")
    return None


def _error_from_rpc(address: str, exc: grpc.RpcError, tls: bool = False) -> BlobError:
    if not isinstance(exc, grpc.Call):
        return Unavailable(f"master {address}: {exc}")
    code = exc.code()
    details = exc.details() or ""
    trailers = tuple((str(k), v) for k, v in (exc.trailing_metadata() or ()))
    if code == grpc.StatusCode.CANCELLED:
        # Our own cancellations never get here; a cancel from the far side means the master
        # is going away, which is worth a retry elsewhere.
        return Unavailable(f"master {address} cancelled the call: {details or 'no reason'}")
    error = errors.from_status(code, details, trailers)
    if isinstance(error, Busy):
        # Transient: back off and retry.
        return Busy(f"master {address} is busy: {error}")
    if isinstance(error, Unavailable):
        return (_handshake_failure(address, details, tls)
                or Unavailable(f"master {address} unavailable: {error}"))
    if isinstance(error, DeadlineExceeded):
        if details.strip().lower() != "deadline exceeded":
            # The master's own answer (a write quorum not reached in its time), not gRPC's:
            # it did answer, and its message says what happened.
            return DeadlineExceeded(f"master {address}: {details}")
        return DeadlineExceeded(f"master {address} did not answer in time ({error})")
    return error


class GrpcTransport:
    """The gRPC transport: one cached channel per address, over TLS when ``credentials`` name
    a CA or a client certificate, with the token (if any) on every call.

    ``address_map`` translates a master's advertised address to the one this client dials
    (see :func:`parse_address_map`); unlisted addresses are dialled as they are."""

    def __init__(self, user: str, credentials: Credentials | None = None,
                 address_map: Mapping[str, str] | None = None) -> None:
        self._credentials = credentials or Credentials()
        self._metadata: tuple[tuple[str, str], ...] = self._credentials.metadata(user)
        self._address_map = dict(address_map or {})
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self._stalls = StallWatch()
        self._calls = CallWatch(self._answers, self._cut)
        self._closed = False

    def _stub(self, address: str) -> Any:
        with self._lock:
            if self._closed:
                raise InvalidArgument("this Client is closed; create a new one")
            stub = self._stubs.get(address)
            if stub is None:
                target = self._address_map.get(address, address)
                options: list[tuple[str, object]] = list(_CHANNEL_OPTIONS)
                if target != address:
                    # TLS still checks the certificate against the advertised name.
                    options.append(("grpc.ssl_target_name_override", host_of(address)))
                channel = self._credentials.channel(target, options)
                self._channels[address] = channel
                stub = self._stubs[address] = chunkwire.stub(channel)
            return stub

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None) -> Any:
        return self._call(address, method, request, timeout, stall)

    def _call(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None) -> Any:
        # With a stall limit shorter than the timeout: half the limit waiting for the answer,
        # half for the status check, so a paused master is left after about ``stall`` seconds
        # (see CallWatch).
        pending: Pending | None = None
        if stall is not None and (timeout is None or timeout > stall):
            pending = self._calls.begin(address, stall / 2)
        stub: Any = None
        try:
            stub = self._stub(address)
            return getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        except (grpc.RpcError, ValueError) as exc:
            # ValueError: the channel was closed as this call began (cut for another call).
            if pending is not None and (pending.fired or self._was_cut(address, stub)):
                raise Unavailable(
                    f"master {address} stopped answering: {method} got no answer for"
                    f" {stall:g} s and neither did a status check (paused or cut off); trying"
                    " another master"
                ) from None
            if isinstance(exc, grpc.RpcError):
                raise _error_from_rpc(address, exc, self._credentials.tls) from None
            raise
        finally:
            if pending is not None:
                self._calls.end(pending)

    def _was_cut(self, address: str, stub: Any) -> bool:
        """Whether ``stub``'s channel was closed because its master stopped answering."""
        with self._lock:
            return stub is not None and not self._closed and self._stubs.get(address) is not stub

    def _cut(self, address: str) -> None:
        """End every call to ``address`` (it answered no status check): its channel is closed,
        and the next call opens a new one."""
        with self._lock:
            channel = self._channels.pop(address, None)
            self._stubs.pop(address, None)
        self._stalls.cancel(f"master {address}",
                            f"master {address} stopped answering (it failed a status check)")
        if channel is not None:
            channel.close()

    def _answers(self, address: str, limit: float) -> bool:
        """Whether ``address`` answers a status check within ``limit`` seconds."""
        try:
            self._stub(address).NodeStatus(pb.NodeStatusRequest(), timeout=limit,
                                           metadata=self._metadata)
        except grpc.RpcError as exc:
            # Any status is an answer, a refusal too; only silence or no connection is not.
            code = exc.code() if isinstance(exc, grpc.Call) else None
            return code not in (None, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNAVAILABLE)
        return True

    def client_stream(
        self, address: str, method: str, requests: Iterator[Any], timeout: float | None,
        stall: float | None = None,
    ) -> Any:
        return self._call(address, method, requests, timeout, stall)

    def data_host(self, address: str) -> str | None:
        if self._credentials.tls:
            return None
        return host_of(self._address_map.get(address, address))

    def server_stream(
        self, address: str, method: str, request: Any, timeout: float | None,
        stall: float | None = None,
    ) -> Iterator[Any]:
        multi = getattr(self._stub(address), method)
        call: Any = multi(request, timeout=timeout, metadata=self._metadata)
        try:
            if stall is None:
                try:
                    yield from call
                finally:
                    # Frees the stream at once when the consumer stops early (messages() does
                    # the same for a watched one); a no-op once finished.
                    call.cancel()
            else:
                yield from self._stalls.messages(call, stall, f"master {address}")
        except Stalled as e:
            raise Unavailable(f"{e}; moving on to another replica") from None
        except grpc.RpcError as exc:
            raise _error_from_rpc(address, exc, self._credentials.tls) from None

    def probe(
        self, addresses: Sequence[str], method: str, request: Any, timeout: float
    ) -> Generator[tuple[str, Any], None, None]:
        results: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        futures: builtins.list[Any] = []
        try:
            for address in addresses:
                future = getattr(self._stub(address), method).future(
                    request, timeout=timeout, metadata=self._metadata
                )
                futures.append(future)
                future.add_done_callback(functools.partial(
                    _probe_done, results, address, self._credentials.tls))
            for _ in addresses:
                try:
                    # gRPC ends every call by its deadline; the margin only guards that promise.
                    yield results.get(timeout=timeout + 5.0)
                except queue.Empty:
                    return
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stalls.close()
            self._calls.close()
            channels = builtins.list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        for channel in channels:
            channel.close()


def _probe_done(results: queue.SimpleQueue[tuple[str, Any]], address: str, tls: bool,
                future: Any) -> None:
    try:
        results.put((address, future.result()))
    except grpc.RpcError as exc:
        results.put((address, _error_from_rpc(address, exc, tls)))
    except grpc.FutureCancelledError:
        results.put((address, Unavailable(f"master {address}: probe cancelled")))


# --------------------------------------------------------------------------------------------
# Upload sources and download sinks
# --------------------------------------------------------------------------------------------


class _Source:
    """Upload input, readable at any offset from the last acknowledged one onwards."""

    #: Total bytes when known in advance, else -1.
    size: int = -1
    #: Whether it keeps the bytes not yet acknowledged in memory (a stream), which bounds
    #: how much one segment may carry.
    buffers: bool = False

    def read_at(self, offset: int, n: int) -> bytes:
        raise NotImplementedError

    def view_at(self, offset: int, n: int) -> bytes | memoryview:
        """As :meth:`read_at`, for a caller done with the bytes before it reads again: a
        source in memory answers with a view of its own, not a copy."""
        return self.read_at(offset, n)

    def ack(self, offset: int) -> None:
        """Bytes below ``offset`` are safe on the leader and will not be asked for again."""

    def can_restart(self) -> bool:
        """Whether reading can start over at offset 0 (needed when the leader changes)."""
        return True

    def close(self) -> None:
        pass


class _BytesSource(_Source):
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self.size = len(self._view)

    def read_at(self, offset: int, n: int) -> bytes:
        return bytes(self._view[offset : offset + n])

    def view_at(self, offset: int, n: int) -> memoryview:
        return self._view[offset : offset + n]


class _FileSource(_Source):
    """A seekable file; offsets are relative to where it was positioned when handed over."""

    def __init__(self, f: BinaryIO, owned: bool) -> None:
        self._f = f
        self._owned = owned
        self._start = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(self._start)
        self.size = max(0, end - self._start)

    def read_at(self, offset: int, n: int) -> bytes:
        self._f.seek(self._start + offset)
        return _read_up_to(self._f, n)

    def close(self) -> None:
        if self._owned:
            self._f.close()


class _StreamSource(_Source):
    """A non-seekable stream (a pipe, stdin). Keeps what the leader has not acknowledged yet,
    so a broken segment can be re-sent; once bytes are dropped it can no longer restart."""

    buffers = True

    def __init__(self, f: BinaryIO, owned: bool = False) -> None:
        self._f = f
        self._owned = owned
        self._buf = bytearray()
        self._base = 0
        self._eof = False

    def close(self) -> None:
        if self._owned:
            self._f.close()

    def read_at(self, offset: int, n: int) -> bytes:
        if offset < self._base:
            raise InternalError(
                f"cannot re-send bytes from offset {offset}: the input is a stream that was"
                " already consumed past it"
            )
        while not self._eof and self._base + len(self._buf) < offset + n:
            data = self._f.read(max(n, 64 * KiB))
            if not data:
                self._eof = True
            else:
                self._buf += data
        start = offset - self._base
        return bytes(self._buf[start : start + n])

    def ack(self, offset: int) -> None:
        if offset > self._base:
            del self._buf[: offset - self._base]
            self._base = offset

    def can_restart(self) -> bool:
        return self._base == 0


def _read_up_to(f: BinaryIO, n: int) -> bytes:
    # A raw file object may return short reads before the end; only b"" means end of file.
    parts: builtins.list[bytes] = []
    want = n
    while want > 0:
        data = f.read(want)
        if not data:
            break
        parts.append(data)
        want -= len(data)
    return b"".join(parts)


def _open_source(data: UploadData) -> _Source:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return _BytesSource(data)
    if isinstance(data, (str, os.PathLike)):
        f = open(data, "rb")  # noqa: SIM115 - the source owns it, and closes it
        # A named pipe, /dev/stdin or a shell's <(command) is a path too, but cannot seek.
        if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return _FileSource(f, owned=True)
        return _StreamSource(f, owned=True)
    if not hasattr(data, "read"):
        raise InvalidArgument(
            f"cannot upload a {type(data).__name__}: give bytes, a file path or a binary file"
        )
    seekable = False
    with contextlib.suppress(AttributeError, OSError, ValueError):
        seekable = bool(data.seekable())
    return _FileSource(data, owned=False) if seekable else _StreamSource(data)


class _Sink:
    """Where a download goes. What ``write`` gets is valid only during the call (the data
    channel reuses its buffer): a sink that keeps it keeps a copy."""

    def write(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def restart(self) -> bool:
        """Discard what was written, if possible, so the download can start over."""
        return False


class _BufferSink(_Sink):
    def __init__(self) -> None:
        # A list joined once at the end: growing one buffer would copy the blob repeatedly.
        self.parts: builtins.list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        # Read-only views are of a received message, which nobody reuses: kept as they are.
        if isinstance(data, memoryview) and not data.readonly:
            data = bytes(data)
        self.parts.append(data)

    def restart(self) -> bool:
        self.parts.clear()
        return True


class _FileSink(_Sink):
    """A file object; it can start over only when it is seekable."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._start: int | None = None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if f.seekable():
                self._start = f.tell()

    def write(self, data: bytes | memoryview) -> None:
        self._f.write(data)

    def restart(self) -> bool:
        if self._start is None:
            return False
        try:
            self._f.seek(self._start)
            self._f.truncate()
        except (OSError, ValueError):
            return False
        return True


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


class Client:
    """A connection to a blobha cluster.

    ``cluster`` lists some masters (``"m1:6627,m2:6627"`` or a list); the others and the leader
    are discovered. ``user`` defaults to the token's user, then ``$BLOBHA_USER``, then the
    operating-system user. ``credentials`` (TLS trust, client certificate, token file) default
    to ``$BLOBHA_CA``, ``$BLOBHA_CERT``/``$BLOBHA_KEY`` and ``$BLOBHA_TOKEN_FILE``.
    ``address_map`` (default ``$BLOBHA_ADDRESS_MAP``) maps advertised master addresses to the
    addresses this client dials, for clients outside the masters' network.
    ``timeout`` bounds how long one operation waits for the cluster, retries included (a
    transfer may run longer as long as every segment, 16 MiB up and 64 MiB down, moves within
    it, and a download as long as its bytes keep coming). ``stall_timeout`` is how long a
    master may stay silent (see :data:`STALL_TIMEOUT`) before the client moves on to another.

    Example::

        from blobha.client import Client

        with Client("m1:6627,m2:6627,m3:6627", user="alice") as c:
            meta = c.create("model.bin", "/tmp/model.bin", acl="u:alice:rwa,o::r")
            c.wait_for_replication(["model.bin"], min_replication=2, timeout=60)
            data = c.read("model.bin")
            for key in c.list(prefix="model"):
                print(key, c.get_meta(key).version)

    A client may be shared between threads.
    """

    def __init__(
        self,
        cluster: str | Sequence[str],
        user: str | None = None,
        timeout: float = 60.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        address_map: Mapping[str, str] | None = None,
        credentials: Credentials | None = None,
        transport: Transport | None = None,
        stall_timeout: float = STALL_TIMEOUT,
    ) -> None:
        self._addresses = parse_cluster(cluster)
        if transport is None:
            credentials = (credentials or Credentials.from_env()).check()
            token_user = credentials.token_user()
            if token_user and user and user != token_user:
                raise InvalidArgument(
                    f"the token belongs to {token_user!r}, not {user!r}; drop --user or use"
                    f" {user!r}'s token"
                )
            user = user or token_user
        self._user = _check_user(user if user else default_user())
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be positive seconds, not {timeout!r}")
        self._timeout = float(timeout)
        if not stall_timeout >= _MIN_STALL_TIMEOUT:
            # Below this, a master merely busy for a moment would count as gone.
            raise InvalidArgument(f"stall_timeout must be at least {_MIN_STALL_TIMEOUT:g} s, not"
                                  f" {stall_timeout!r}")
        self._stall_timeout = float(stall_timeout)
        self._chunk_size = _check_chunk_size(chunk_size)
        if address_map is None:
            address_map = default_address_map()
        self._transport: Transport = transport or GrpcTransport(self._user, credentials,
                                                                address_map)
        self._rng = random.Random()
        self._data_channels = DataChannels()
        #: Replaceable so tests do not wait for real backoff.
        self._sleep: Callable[[float], None] = time.sleep
        #: Told, once per call, when it has retried for a while: (what, why, seconds left before
        #: it gives up). The command line says it on a terminal, so a long wait (a ZooKeeper
        #: outage, say, retried for the whole timeout) is not a silent one.
        self.on_retry: Callable[[str, BlobError, float], None] | None = None
        self._lock = threading.Lock()
        self._known: builtins.list[str] = builtins.list(self._addresses)
        self._leader: str | None = None
        # Metadata reads stick to one master (the leader after a write, for read-your-writes)
        # and move on when it fails; the first pick is random to spread clients out.
        self._preferred = self._rng.choice(self._addresses)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def user(self) -> str:
        return self._user

    @property
    def timeout(self) -> float:
        return self._timeout

    def close(self) -> None:
        """Close every channel. The client cannot be used afterwards."""
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({','.join(self._addresses)!r}, user={self._user!r})"

    # -- writes ----------------------------------------------------------------------------

    def create(
        self,
        key: str,
        data: UploadData,
        acl: str | Sequence[AccessControl] | None = None,
        replication_factor: int = 0,
        write_quorum: int = 0,
        progress: ProgressCallback | None = None,
    ) -> BlobMeta:
        """Create ``key`` with ``data``: bytes, a file path (``str`` or path-like) or a binary
        file object. ``acl`` is Storm's grammar (``"u:alice:rwa,o::r"``) or entries; the
        creator always keeps full access. ``replication_factor``/``write_quorum`` 0 = the
        cluster default. ``progress(done, total)`` is called as bytes go out (total -1 when
        unknown). Raises :class:`KeyAlreadyExists` if the key exists."""
        validate_key(key)
        _check_count("replication_factor", replication_factor, _UINT32_MAX)
        _check_count("write_quorum", write_quorum, _UINT32_MAX)
        request = pb.BeginUploadRequest(
            key=key,
            create=True,
            acl=_acl_to_pb(_normalize_acl(acl)),
            replication_factor=replication_factor,
            write_quorum=write_quorum,
        )
        return self._upload(request, data, progress)

    def update(
        self,
        key: str,
        data: UploadData,
        expected_version: int = 0,
        write_quorum: int = 0,
        progress: ProgressCallback | None = None,
    ) -> BlobMeta:
        """Write a new version of ``key``. With ``expected_version`` the update fails with
        :class:`~blobha.core.errors.VersionConflict` unless that is the committed version."""
        validate_key(key)
        _check_count("expected_version", expected_version)
        _check_count("write_quorum", write_quorum, _UINT32_MAX)
        request = pb.BeginUploadRequest(
            key=key, create=False, expected_version=expected_version, write_quorum=write_quorum
        )
        return self._upload(request, data, progress)

    def set_acl(self, key: str, acl: str | Sequence[AccessControl],
                expected_meta_version: int | None = None) -> BlobMeta:
        """Replace the ACL of ``key`` (needs ADMIN); the caller keeps ADMIN. With
        ``expected_meta_version`` (a :class:`BlobMeta`'s ``meta_version``; 0 is a version, that
        of a new key) the change is made only if the metadata is still that version, else
        :class:`VersionConflict`."""
        validate_key(key)
        entries = _normalize_acl(acl)
        if expected_meta_version is not None:
            _check_count("expected_meta_version", expected_meta_version)
        request = pb.SetMetaRequest(key=key, set_acl=True, acl=_acl_to_pb(entries),
                                    expected_meta_version=expected_meta_version)

        def made_already(deadline: _Deadline) -> Any:
            # A conflict after an attempt whose answer was lost may be that attempt's own
            # change: the metadata one version on, with this ACL (the setter keeps ADMIN).
            meta = self._meta_within(key, deadline)
            acl = list(_acl_from_pb(meta.acl))
            ours = (meta.meta_version == (expected_meta_version or 0) + 1
                    and acl == normalize_for_set(entries, self._user))
            return meta if ours else None

        return _meta_from_pb(self._leader_call(
            f"set the ACL of {key!r}", "SetMeta", request,
            conflict_on_retry=made_already if expected_meta_version is not None else None))

    def set_replication_factor(self, key: str, replication_factor: int) -> BlobMeta:
        """Change how many masters should hold ``key``."""
        validate_key(key)
        _check_count("replication_factor", replication_factor, _UINT32_MAX, minimum=1)
        request = pb.SetMetaRequest(key=key, replication_factor=replication_factor)
        return _meta_from_pb(
            self._leader_call(f"set the replication factor of {key!r}", "SetMeta", request)
        )

    def delete(self, key: str) -> None:
        """Delete ``key`` and all its versions. Raises :class:`KeyNotFound` if absent."""
        validate_key(key)
        what = f"delete {key!r}"
        deadline = _Deadline(self._timeout)
        while True:
            # The delete names the key it read (by its creation time): a retry after a lost
            # answer must not delete a key created again meanwhile by someone else.
            request = pb.DeleteRequest(key=key)
            created_at = self._created_at(key, deadline)
            if created_at is not None:
                request.expected_created_at = created_at
            try:
                self._leader_call(
                    what, "Delete", request, missing_ok_on_retry=True,
                    # The key read is gone, and a newer one of the same name is not ours to
                    # delete: an attempt whose answer was lost deleted it (or someone did).
                    conflict_on_retry=lambda _: pb.DeleteResponse(), deadline=deadline,
                )
                return
            except VersionConflict:
                # Deleted and created again between the read and the delete, by others: the
                # key asked to be deleted is the one there now.
                if deadline.expired():
                    raise
                continue

    def _created_at(self, key: str, deadline: _Deadline) -> float | None:
        """The creation time of ``key`` as the leader sees it (a follower may not know of a
        key just created), or None when the leader will not show this user the metadata (a
        master older than showing it to writers): the delete is then unconditional, as before
        the condition existed."""
        try:
            meta = self._leader_call(f"read the metadata of {key!r}", "GetMeta",
                                     pb.GetMetaRequest(key=key, any_access=True),
                                     deadline=deadline)
        except NotAuthorized:
            return None
        return float(meta.created_at)

    # -- reads -----------------------------------------------------------------------------

    def get_meta(self, key: str) -> BlobMeta:
        """The metadata of ``key``'s committed version, for a user holding any permission on
        it; ``access`` says which (:func:`require_read` before serving the blob elsewhere)."""
        validate_key(key)
        return _meta_from_pb(self._meta_within(key, None))

    def _meta_within(self, key: str, deadline: _Deadline | None) -> Any:
        """GetMeta's answer, within ``deadline`` (None: this client's timeout)."""
        return self._read_call(f"read the metadata of {key!r}", "GetMeta",
                               pb.GetMetaRequest(key=key, any_access=True), deadline)

    def get_replication(self, key: str) -> ReplicationStatus:
        validate_key(key)
        request = pb.GetReplicationRequest(key=key)
        status = self._read_call(f"read the replication of {key!r}", "GetReplication", request)
        self._learn(status.holders)
        return replication_from_pb(status)

    def node_status(self, address: str) -> MasterSummary:
        """The status of one master, asked directly (no leader discovery, no retries): what a
        health check wants to know about the node it runs on."""
        target = parse_cluster(address)[0]
        reply = self._transport.unary(target, "NodeStatus", pb.NodeStatusRequest(),
                                      min(self._timeout, _PROBE_TIMEOUT))
        return master_from_pb(reply)

    def cluster_summary(self) -> ClusterSummary:
        summary = self._read_call(
            "read the cluster summary", "ClusterSummary", pb.ClusterSummaryRequest()
        )
        self._learn(m.address for m in summary.masters)
        return _summary_from_pb(summary)

    def wait_for_replication(
        self, keys: str | Iterable[str], min_replication: int, timeout: float
    ) -> WaitResult:
        """Wait (on the server, from ZooKeeper watches) until every key has at least
        ``min_replication`` live replicas of its committed version, or ``timeout`` seconds
        pass (``reached`` is then False).

        The whole call, retries on unreachable masters included, ends within ``timeout`` plus
        a grace of :data:`_WAIT_GRACE` (2 s) for the master's last answer to arrive; if no
        master answered by then it raises (:class:`~blobha.core.errors.Unavailable`). A negative
        timeout waits forever, in bounded server calls; each of those may retry unreachable
        masters for the client's own timeout before the wait gives up."""
        names = [keys] if isinstance(keys, str) else builtins.list(keys)
        if not names:
            raise InvalidArgument("give at least one key to wait for")
        for name in names:
            validate_key(name)
        _check_count("min_replication", min_replication, _UINT32_MAX)
        started = _monotonic()
        if timeout >= 0:
            return self._wait_once(names, min_replication, float(timeout), _WAIT_GRACE)
        while True:
            # No end to keep to: a failover gets the client's usual time, as any call would.
            result = self._wait_once(names, min_replication, _FOREVER_SLICE, self._timeout)
            if result.reached:
                return WaitResult(True, result.statuses, _monotonic() - started)

    def read(self, key: str, version: int = 0) -> bytes:
        """The content of ``key`` (``version`` 0 = the committed one), verified."""
        validate_key(key)
        _check_count("version", version)
        sink = _BufferSink()
        self._download(key, sink, version, 0, 0, None)
        return b"".join(sink.parts)

    def download(
        self,
        key: str,
        dest: str | os.PathLike[str] | BinaryIO,
        version: int = 0,
        offset: int = 0,
        length: int = 0,
        progress: ProgressCallback | None = None,
    ) -> BlobInfo:
        """Download ``key`` into a file path or a binary file object.

        A path is written through a temporary file next to it and renamed into place only once
        complete and verified, so a failure never leaves a partial file; through a symbolic
        link, the file it points to is replaced. A path that is not a regular file (a device,
        a named pipe, ``/dev/fd/N``) is written into directly. ``offset``/``length``
        (0 = to the end) select a range; only a whole download is checked against the digest
        (ranged reads are still verified chunk by chunk by the server)."""
        validate_key(key)
        for name, value in (("version", version), ("offset", offset), ("length", length)):
            _check_count(name, value)
        if not isinstance(dest, (str, os.PathLike)):
            return self._download(key, _FileSink(dest), version, offset, length, progress)
        path = Path(dest)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            mode = 0
        # Checked first so the error names the user's path, not our temporary file.
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if mode and not stat.S_ISREG(mode):
            # A device, a pipe or a shell's /dev/fd/N: written into, as any program would.
            # Renaming a file over it would replace /dev/null or a reader's pipe with a file.
            with open(path, "wb") as f:
                return self._download(key, _FileSink(f), version, offset, length, progress)
        if path.is_symlink():
            # The file it points to is the one to replace, not the link.
            path = Path(os.path.realpath(path))
        if not path.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(path.parent))
        # The name is cut so the temporary's stays under the usual 255-byte limit.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".part",
                                        dir=path.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as f:
                info = self._download(key, _FileSink(f), version, offset, length, progress)
                f.flush()
                os.fsync(f.fileno())
            _copy_mode(path, tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return info

    def list(self, prefix: str = "", page_size: int = LIST_PAGE) -> Iterator[str]:
        """Every key starting with ``prefix``, in server order, following pages as needed.
        ``page_size``: keys asked for per call, at most the default, the largest page a master
        serves (a listing of 100,000 keys is 100 calls); fewer where only the first few keys
        are wanted."""
        if not 1 <= page_size <= LIST_PAGE:
            raise InvalidArgument(f"page_size must be 1 to {LIST_PAGE}, not {page_size}")
        token = ""
        while True:
            request = pb.ListRequest(prefix=prefix, page_token=token, page_size=page_size)
            page = self._read_call("list keys", "List", request)
            yield from page.keys
            token = page.next_page_token
            if not token:
                return

    # -- routing and retries ---------------------------------------------------------------

    def _learn(self, addresses: Iterable[str]) -> None:
        with self._lock:
            for address in addresses:
                if address and address not in self._known:
                    self._known.append(address)

    def _known_addresses(self) -> builtins.list[str]:
        with self._lock:
            return builtins.list(self._known)

    def _redirect(self, tried: str, leader: str) -> None:
        with self._lock:
            # A follower naming itself, or naming nobody, knows no better than we do:
            # forget and discover again after the backoff.
            self._leader = leader if leader and leader != tried else None
        if leader:
            self._learn([leader])

    def _forget_leader(self, address: str) -> None:
        with self._lock:
            if self._leader == address:
                self._leader = None
            if self._preferred == address:
                self._preferred = self._next_known(address)

    def _next_known(self, address: str) -> str:
        # Lock held by the caller.
        if address not in self._known:
            return self._known[0]
        return self._known[(self._known.index(address) + 1) % len(self._known)]

    def _after_write(self, leader: str) -> None:
        with self._lock:
            self._preferred = leader

    def _discover_leader(self, deadline: _Deadline) -> str:
        with self._lock:
            if self._leader:
                return self._leader
        addresses = self._known_addresses()
        timeout = min(deadline.remaining(), _PROBE_TIMEOUT)
        if timeout <= 0:
            raise DeadlineExceeded("no leader found before the deadline")
        first_error: BlobError | None = None
        refusal: BlobError | None = None
        cut_off: BlobError | None = None
        answered = False
        no_handshake: set[str] = set()
        with contextlib.closing(
            self._transport.probe(addresses, "ClusterSummary", pb.ClusterSummaryRequest(), timeout)
        ) as results:
            for source, result in results:
                if isinstance(result, _REFUSALS):
                    # About the caller, not the cluster: a retry would only be refused again.
                    refusal = refusal or result
                    continue
                if isinstance(result, BlobError):
                    if isinstance(result, _HandshakeFailed):
                        no_handshake.update(result.addresses)
                    # A master's own reason ("ZooKeeper is unreachable") says more than
                    # another one's silence, whichever came first.
                    if first_error is None or isinstance(first_error, DeadlineExceeded):
                        first_error = result
                    continue
                self._learn(m.address for m in result.masters)
                if result.leader:
                    self._learn([result.leader])
                    with self._lock:
                        self._leader = result.leader
                    return str(result.leader)
                if result.zookeeper_unreachable:
                    # It answered from what it last saw: its reason says more than silence.
                    cut_off = cut_off or Unavailable(
                        f"ZooKeeper is unreachable from master {source}, and no master it"
                        " knows of leads; retry when ZooKeeper is back")
                    continue
                answered = True
        if answered:
            # Some master accepted us (one that refused may not have reloaded its tokens yet).
            raise Unavailable("no leader is elected yet (a failover may be in progress)")
        if cut_off is not None:
            raise cut_off
        if refusal is not None:
            waited = deadline.seconds - deadline.remaining()
            if isinstance(refusal, Unauthenticated) and waited < _REFUSAL_PATIENCE:
                raise Unavailable(f"{refusal} (asking again for a moment: a token added just now"
                                  " may not be loaded yet)")
            raise refusal
        if isinstance(first_error, _HandshakeFailed) and no_handshake.issuperset(addresses):
            raise _HandshakeFailed(str(first_error), frozenset(no_handshake))
        if isinstance(first_error, DeadlineExceeded) and deadline.expired():
            # Every probe ran into the end of the caller's deadline: the caller reports why it
            # was retrying (see _retry), not that its last look for a leader was cut short.
            raise DeadlineExceeded(f"no master answered at {', '.join(addresses)} before the"
                                   f" deadline ({first_error})")
        # Not "no master answered": each may have answered, with its reason ("ZooKeeper is
        # unreachable"), and the first such reason is given.
        raise Unavailable(
            f"no master at {', '.join(addresses)} named a leader"
            + (f" ({first_error})" if first_error else "")
        )

    def _pause(self, attempt: int, deadline: _Deadline, last: BlobError, what: str) -> None:
        """Sleep before retry ``attempt``, or raise ``last`` if the deadline would pass."""
        delay = backoff_delay(attempt, rand=self._rng.random)
        left = deadline.remaining()
        if delay >= left:
            raise _gave_up(last, what, deadline.seconds)
        if (self.on_retry is not None and not deadline.noticed
                and deadline.seconds - left >= _RETRY_NOTICE_AFTER):
            deadline.noticed = True
            self.on_retry(what, last, left)
        self._sleep(delay)

    def _retry(self, what: str, deadline: _Deadline, attempt_fn: Callable[[], T]) -> T:
        attempt = 0
        last: BlobError | None = None
        mismatches = _Mismatches()
        while True:
            try:
                return attempt_fn()
            except (NotLeader, Unavailable) as exc:
                last = exc
                self._give_up_on_tls(exc, mismatches)
                self._pause(attempt, deadline, exc, what)
            except DeadlineExceeded as exc:
                self._cut_short(exc, last, what, deadline)
            attempt += 1

    def _give_up_on_tls(self, exc: BlobError, run: _Mismatches) -> None:
        """Raise :class:`TlsMismatch` once every known master has failed the TLS handshake, in
        failures one after the other for at least :data:`_REFUSAL_PATIENCE` (``run``: this
        call's current run of them): the client's TLS settings are wrong, and waiting out the
        whole timeout would not change them. Any other failure ends the run."""
        if not isinstance(exc, _HandshakeFailed):
            run.clear()
            return
        now = _monotonic()
        if run.since is None:
            run.since = now
        run.addresses.update(exc.addresses)
        if (now - run.since >= _REFUSAL_PATIENCE
                and run.addresses.issuperset(self._known_addresses())):
            raise TlsMismatch(str(exc)) from None

    @staticmethod
    def _cut_short(exc: DeadlineExceeded, last: BlobError | None, what: str,
                   deadline: _Deadline) -> NoReturn:
        """Raise ``exc``, unless a retry ran into the end of the deadline: then why it was
        retrying (``last``: "ZooKeeper is unreachable") is the news, not that its last try
        was cut short."""
        if last is None or not deadline.expired():
            raise exc
        raise _gave_up(last, what, deadline.seconds) from None

    def _leader_call(
        self, what: str, method: str, request: Any, missing_ok_on_retry: bool = False,
        conflict_on_retry: Callable[[_Deadline], Any] | None = None,
        deadline: _Deadline | None = None,
    ) -> Any:
        """Call the leader, retried until the deadline. ``conflict_on_retry``: for a
        conditional change, given a conflict after an attempt whose answer was lost, the
        response that attempt made (None: not ours, the conflict stands)."""
        deadline = deadline or _Deadline(self._timeout)
        uncertain = False

        def attempt() -> Any:
            nonlocal uncertain
            leader = self._discover_leader(deadline)
            try:
                response = self._transport.unary(leader, method, request, deadline.remaining(),
                                                 stall=self._stall_timeout)
            except NotLeader as exc:
                self._redirect(leader, exc.leader)
                raise
            except Unavailable as exc:
                uncertain = uncertain or _may_have_run(exc)
                self._forget_leader(leader)
                raise
            except KeyNotFound:
                # An earlier attempt may have deleted the key before its answer was lost.
                if missing_ok_on_retry and uncertain:
                    return None
                raise
            except VersionConflict:
                if conflict_on_retry is not None and uncertain:
                    made = conflict_on_retry(deadline)
                    if made is not None:
                        return made
                raise
            self._after_write(leader)
            return response

        return self._retry(what, deadline, attempt)

    def _control_call(self, address: str, method: str, request: Any, deadline: _Deadline
                      ) -> Any:
        """A cheap call, given at most :data:`_CONTROL_TIMEOUT` of ``deadline``: a master that
        neither answers nor refuses in that time (paused, cut off) raises :class:`Unavailable`,
        so the caller moves on to another master; only the deadline's own end raises
        :class:`DeadlineExceeded`."""
        remaining = deadline.remaining()
        limit = min(remaining, _CONTROL_TIMEOUT)
        try:
            return self._transport.unary(address, method, request, limit)
        except DeadlineExceeded:
            # Whether the deadline's end was the limit, as it stood when the call began:
            # compared after the call, a limit that merely took what it was given (8 of the
            # 14 s left) read as the deadline's end, and the caller tried no other master.
            if limit >= remaining:
                raise
            raise Unavailable(f"master {address} did not answer {method} within"
                              f" {_CONTROL_TIMEOUT:.0f}s; trying another") from None

    def _read_call(
        self, what: str, method: str, request: Any, deadline: _Deadline | None = None
    ) -> Any:
        deadline = deadline or _Deadline(self._timeout)

        def attempt() -> Any:
            with self._lock:
                address = self._preferred
            try:
                return self._control_call(address, method, request, deadline)
            except Unavailable:
                self._forget_leader(address)
                raise

        return self._retry(what, deadline, attempt)

    def _wait_once(self, keys: builtins.list[str], minimum: int, secs: float, overrun: float
                   ) -> WaitResult:
        """One server-side wait of ``secs``, retried on other masters; the call and its
        retries end within ``secs + overrun``."""
        started = _monotonic()
        end = started + secs
        deadline = _Deadline(secs + overrun)

        def attempt() -> Any:
            left = max(0.0, end - _monotonic())
            limit = min(left + _WAIT_GRACE, deadline.remaining())
            if limit <= 0:
                raise DeadlineExceeded("the replication wait ran out of time between retries")
            request = pb.WaitForReplicationRequest(
                keys=keys, min_replication=minimum, timeout_secs=left
            )
            with self._lock:
                address = self._preferred
            try:
                return self._transport.unary(address, "WaitForReplication", request, limit,
                                             stall=self._stall_timeout)
            except Unavailable:
                self._forget_leader(address)
                raise

        response = self._retry("wait for replication", deadline, attempt)
        result = _wait_result_from_pb(response)
        return WaitResult(result.reached, result.statuses, _monotonic() - started)

    # -- transfers -------------------------------------------------------------------------

    def _upload(
        self, request: pb.BeginUploadRequest, data: UploadData, progress: ProgressCallback | None
    ) -> BlobMeta:
        base_version = 0
        if not request.create:
            # Remembered so a commit whose answer was lost can be recognised by a newer version
            # carrying our digest; a writer not shown the metadata (by a master older than
            # showing it to writers) still uploads, less precisely.
            try:
                base_version = self.get_meta(request.key).version
            except NotAuthorized:
                base_version = request.expected_version
        source = _open_source(data)
        try:
            request.size_hint = source.size
            return _UploadJob(self, request, source, base_version, progress).run()
        finally:
            source.close()

    def _download(
        self,
        key: str,
        sink: _Sink,
        version: int,
        offset: int,
        length: int,
        progress: ProgressCallback | None,
    ) -> BlobInfo:
        return _DownloadJob(self, key, sink, version, offset, length, progress).run()


_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def _check_count(name: str, value: int, maximum: int = _UINT64_MAX, minimum: int = 0) -> None:
    # Checked here so a bad number is an InvalidArgument, not a ValueError from protobuf.
    if not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidArgument(
            f"{name} must be a whole number from {minimum} to {maximum}, not {value!r}")


class _Mismatches:
    """A run of failed TLS handshakes within one call: since when, and with which masters."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.addresses: set[str] = set()

    def clear(self) -> None:
        self.since = None
        self.addresses.clear()


def _may_have_run(exc: Unavailable) -> bool:
    """Whether a call that failed with ``exc`` may have run on the master (its answer lost),
    as opposed to refused unsent: no connection, or the master too busy to take it."""
    return not isinstance(exc, Busy) and not any(
        s in str(exc) for s in ("failed to connect", "Connection refused"))


def _gave_up(last: BlobError, what: str, seconds: float) -> BlobError:
    message = f"could not {what} within {seconds:g} s: {last}"
    if isinstance(last, NotLeader):
        return Unavailable(message)
    return type(last)(message)


def _copy_mode(dest: Path, tmp: Path) -> None:
    # mkstemp creates 0600 files; keep the mode of the file being replaced, else give the 0644
    # a plain write would usually get, so a download is as readable as any other file.
    try:
        mode = stat.S_IMODE(dest.stat().st_mode)
    except OSError:
        mode = 0o644
    tmp.chmod(mode)


class _UploadJob:
    """One create/update: begin, append segments, commit; resumed or restarted on failures."""

    def __init__(
        self,
        client: Client,
        begin: pb.BeginUploadRequest,
        source: _Source,
        base_version: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.c = client
        self.begin = begin
        if not begin.write_id:
            # One name for every attempt of this write: a master that committed an attempt
            # whose answer was lost answers the next one with that version, never a second.
            begin.write_id = os.urandom(16)
        self.source = source
        self.base_version = base_version
        self.progress = progress
        self.what = f"{'create' if begin.create else 'update'} {begin.key!r}"
        self.leader = ""
        self.upload_id = ""
        self.started = False
        self.commit_unknown = False
        self.digester = Digester()
        self.hashed = 0  # bytes fed to the digester: the digest covers [0, hashed)
        # gRPC reads an upload segment on a thread of its own, which may still be inside a read
        # (of a slow pipe) when its call was given up and the next attempt starts reading.
        self._read_lock = threading.Lock()
        self.source_error: BaseException | None = None
        self.high_water = 0  # most bytes any attempt of this upload got acknowledged
        # Cleared when the leader offers no data channel (TLS, turned off, an older release),
        # so the rest of this upload does not ask again.
        self.channel = True

    def run(self) -> BlobMeta:
        deadline = _Deadline(self.c._timeout)
        attempt = 0
        last: BlobError | None = None
        mismatches = _Mismatches()
        try:
            while True:
                try:
                    return self._step(deadline)
                except _CannotRestart:
                    raise
                except DeadlineExceeded as exc:
                    self.c._cut_short(exc, last, self.what, deadline)
                except NotLeader as exc:
                    self.c._redirect(self.leader, exc.leader)
                    self.upload_id = ""  # bound to the old leader
                    last = exc
                except UploadNotFound as exc:
                    self.upload_id = ""
                    self.c._forget_leader(self.leader)
                    last = exc
                except Unavailable as exc:
                    self.c._forget_leader(self.leader)
                    last = exc
                except KeyAlreadyExists:
                    meta = self._committed_meta(deadline) if self.commit_unknown else None
                    if meta is None:
                        raise
                    return meta
                self.c._give_up_on_tls(last, mismatches)
                self.c._pause(attempt, deadline, last, self.what)
                attempt += 1
        except NO_ANSWER as exc:
            self._abort_quietly()
            if not self.commit_unknown:
                raise
            # Giving up after a commit whose answer was lost: it may have been made, and a
            # plain "unavailable" would send the user to write it again.
            note = (f"{exc}; an earlier attempt's commit got no answer, so the {self.what}"
                    " may have been made: check with 'blobha meta' before writing again")
            raise type(exc)(note) from None
        except BaseException:
            self._abort_quietly()
            raise

    def _step(self, deadline: _Deadline) -> BlobMeta:
        if self.commit_unknown:
            meta = self._committed_meta(deadline)
            if meta is not None:
                return meta
        if self.upload_id and self.c._discover_leader(deadline) != self.leader:
            self.upload_id = ""  # upload ids die with the leadership that issued them
        if not self.upload_id and 0 <= self.source.size <= _PUT_MAX_BYTES:
            return self._put(deadline)
        offset = 0
        if self.upload_id:
            status = self._control(
                "GetUploadStatus", pb.UploadStatusRequest(upload_id=self.upload_id), deadline
            )
            offset = int(status.received)
        else:
            done = self._begin(deadline)
            if done is not None:
                return done
        self._send(offset, deadline)
        return self._commit(deadline)

    def _begin(self, deadline: _Deadline) -> BlobMeta | None:
        """Open an upload session; or, where the leader says this write (its write id) is
        committed already, its answer."""
        stuck = self.started and not self.source.can_restart()
        if stuck and not self.commit_unknown:
            raise _CannotRestart(
                f"the leader changed during the upload of {self.begin.key!r} and the data cannot"
                " be read again (it comes from a stream); nothing was written, upload it again"
                " (from a file, it would have restarted by itself)"
            )
        self.leader = self.c._discover_leader(deadline)
        response = self._control("BeginUpload", self.begin, deadline)
        if response.HasField("committed"):
            self.commit_unknown = False
            self.upload_id = ""
            self.c._after_write(self.leader)
            return _meta_from_pb(response.committed)
        self.upload_id = response.upload_id
        if stuck:
            # Asked only to learn whether the commit whose answer was lost applied: it did not
            # (as of now), and the data cannot be sent again.
            self._abort_quietly()
            raise _CannotRestart(
                f"the commit of {self.begin.key!r} got no answer, and the leader has no record of"
                " it; the data cannot be read again (it comes from a stream): upload it again"
                " (from a file, it would have restarted by itself)"
            )
        self.started = True
        return None

    def _control(self, method: str, request: Any, deadline: _Deadline) -> Any:
        return self.c._control_call(self.leader, method, request, deadline)

    def _read(self, offset: int, view: bool = False) -> bytes | memoryview:
        with self._read_lock:
            if view:
                data = self.source.view_at(offset, self.c._chunk_size)
            else:
                data = self.source.read_at(offset, self.c._chunk_size)
            end = offset + len(data)
            if offset <= self.hashed < end:
                self.digester.update(memoryview(data)[self.hashed - offset :])
                self.hashed = end
            return data

    def _send(self, offset: int, deadline: _Deadline) -> None:
        """Append from ``offset`` to the end of the source."""
        while True:
            first = self._read(offset)
            if not first:
                if offset != self.hashed:
                    raise InternalError(
                        f"the input ended at {offset} bytes but {self.hashed} were read before;"
                        " was the file truncated during the upload?"
                    )
                return
            received = self._channel_segment(offset, first, deadline)
            if received is None:
                received = self._stream_segment(offset, first)
            if received <= offset:
                raise InternalError(
                    f"the leader acknowledged no progress at offset {offset} of upload"
                    f" {self.upload_id!r}"
                )
            self.source.ack(received)
            offset = received
            if received > self.high_water:
                # Only new ground renews the deadline; re-sending bytes that an earlier attempt
                # already delivered is not progress, so a commit that keeps failing still ends.
                self.high_water = received
                deadline.restart()

    def _channel_segment(self, offset: int, first: bytes | memoryview, deadline: _Deadline
                         ) -> int | None:
        """Send a segment from ``offset`` (whose first piece is ``first``) over the leader's
        data channel (blobha.wire.dataplane); the bytes the leader then holds, or None when the
        channel cannot be used and the segment goes in an ``AppendUpload`` stream."""
        channels = self.c._data_channels
        if not self.channel or not channels.usable(self.leader):
            return None
        left = self.source.size - offset
        if 0 <= left < _DATA_CHANNEL_MIN_BYTES:
            return None  # a connection of its own costs more than the copies it saves
        host = self.c._transport.data_host(self.leader)
        if host is None:
            return None
        status = self._control(
            "GetUploadStatus",
            pb.UploadStatusRequest(upload_id=self.upload_id, data_channel=True), deadline)
        if not status.ticket:
            self.channel = False
            return None
        if int(status.received) != offset:
            return int(status.received)  # an earlier stream's bytes arrived after all
        segment = _UPLOAD_SEGMENT_BYTES if self.source.buffers else _CHANNEL_SEGMENT_BYTES

        def pieces() -> Iterator[bytes | memoryview]:
            pos, data = offset, first
            while data:
                yield data
                pos += len(data)
                if self.progress is not None:
                    self.progress(pos, self.source.size)
                if pos - offset >= segment:
                    return
                data = self._read(pos, view=True)

        # The channel's own time limits (connect, answer, each send) are the stall limit.
        limit = min(self.c._timeout, self.c._stall_timeout)
        try:
            return send_upload(host, status.data_port, status.ticket, limit, pieces())
        except DataChannelUnusable as e:
            channels.failed(self.leader, e)
            return None

    def _stream_segment(self, offset: int, first: bytes | memoryview) -> int:
        """Send a segment from ``offset`` in an ``AppendUpload`` stream; the bytes the leader
        then holds."""
        sent = offset
        self.source_error = None

        def chunks(start: int = offset, data: bytes | memoryview = first
                   ) -> Iterator[chunkwire.UploadPiece]:
            nonlocal sent
            # gRPC pulls this iterator on its own thread and reports failures inside it only
            # as a cancelled call, so keep the real error to raise it ourselves.
            pos = start
            try:
                while data:
                    yield chunkwire.UploadPiece(self.upload_id, pos, memoryview(data))
                    pos += len(data)
                    sent = pos
                    if self.progress is not None:
                        self.progress(pos, self.source.size)
                    if pos - start >= _UPLOAD_SEGMENT_BYTES:
                        return
                    data = self._read(pos)
            except GeneratorExit:
                raise
            except BaseException as exc:
                self.source_error = exc
                raise

        try:
            status = self.c._transport.client_stream(
                self.leader, "AppendUpload", chunks(), self.c._timeout,
                stall=self.c._stall_timeout,
            )
        except BlobError:
            if self.source_error is not None:
                raise self.source_error from None
            raise
        received = int(status.received)
        if received <= offset:
            raise InternalError(
                f"the leader acknowledged no progress at offset {offset} of upload"
                f" {self.upload_id!r} ({sent - offset} bytes were sent)"
            )
        return received

    def _put(self, deadline: _Deadline) -> BlobMeta:
        """A small blob of known size: begin, append and commit in one call."""
        data = self.source.read_at(0, PUT_MAX_BYTES + 1)
        if len(data) != self.source.size:
            raise InternalError(
                f"the input changed size during the {self.what}: {self.source.size} bytes"
                f" expected, {len(data)} read; nothing was written"
            )
        self.digester = Digester()
        self.digester.update(data)
        self.hashed = len(data)
        self.leader = self.c._discover_leader(deadline)
        self.started = True
        request = pb.PutRequest(begin=self.begin, data=data, digest=self.digester.hexdigest())
        return self._finish("Put", request, deadline)

    def _commit(self, deadline: _Deadline) -> BlobMeta:
        request = pb.CommitUploadRequest(
            upload_id=self.upload_id, size=self.hashed, digest=self.digester.hexdigest()
        )
        return self._finish("CommitUpload", request, deadline)

    def _finish(self, method: str, request: Any, deadline: _Deadline) -> BlobMeta:
        """The call that commits (CommitUpload or Put), and what a lost answer means."""
        try:
            response = self.c._transport.unary(self.leader, method, request, deadline.remaining(),
                                               stall=self.c._stall_timeout)
        except Unavailable:
            # The commit may have happened and only its answer been lost.
            self.commit_unknown = True
            raise
        except DeadlineExceeded:
            if deadline.remaining() > 1.0:
                # The master's own answer (write quorum not reached in its time): its message
                # says what became of the version.
                raise
            meta = self._committed_meta(_Deadline(_OUTCOME_GRACE))
            if meta is None:
                # A leader that let the whole deadline pass without an answer may be paused
                # or cut off: the next operation looks for the leader again.
                self.c._forget_leader(self.leader)
                raise
            return meta
        self.upload_id = ""
        self.c._after_write(self.leader)
        return _meta_from_pb(response)

    def _committed_meta(self, deadline: _Deadline) -> BlobMeta | None:
        """The blob's metadata if its committed version is exactly what we uploaded (asked
        within ``deadline``, the upload's own: the check must not add a timeout of its own)."""
        if deadline.remaining() < _OUTCOME_GRACE / 2:
            deadline = _Deadline(_OUTCOME_GRACE)
        try:
            meta = _meta_from_pb(self.c._meta_within(self.begin.key, deadline))
        except (KeyNotFound, NotAuthorized, Unavailable, DeadlineExceeded):
            return None
        if (
            meta.size == self.hashed
            and meta.digest == self.digester.hexdigest()
            and meta.version > self.base_version
            # Committed is not enough: a version its leader could not get acknowledged (the
            # leader failed before the write quorum) may be rolled back by the next leader, so
            # it is not ours to report as written; the upload is made again instead.
            and meta.acknowledged
        ):
            self.commit_unknown = False
            self.upload_id = ""
            return meta
        return None

    def _abort_quietly(self) -> None:
        if not self.upload_id or not self.leader:
            return
        with contextlib.suppress(BlobError):
            self.c._transport.unary(
                self.leader,
                "AbortUpload",
                pb.AbortUploadRequest(upload_id=self.upload_id),
                _ABORT_TIMEOUT,
            )
        self.upload_id = ""


class _CannotRestart(UploadNotFound):
    """Raised out of the retry loop: the only way forward would be re-reading a stream."""


class _DownloadJob:
    """One download: segments from a chosen replica, failing over and resuming at the byte
    where the previous replica stopped (pinned to the version first seen)."""

    def __init__(
        self,
        client: Client,
        key: str,
        sink: _Sink,
        version: int,
        offset: int,
        length: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.c = client
        self.key = key
        self.sink = sink
        self.version = version
        self.offset = offset
        self.limit = offset + length if length else None
        self.progress = progress
        self.candidates: builtins.list[str] = []
        self.failed: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self.info: BlobInfo | None = None
        self.pos = self.offset
        self.end: int | None = self.limit
        self.digester = Digester()

    def run(self) -> BlobInfo:
        deadline = _Deadline(self.c._timeout)
        attempt = 0
        what = f"download {self.key!r}"
        may_guess = True
        guessing = False
        # The last failure of a master that should have served the bytes (down, corrupt,
        # failing), which says more than the "not held here" of the others.
        unreached: BlobError | None = None
        last: BlobError | None = None
        while True:
            if not self.candidates:
                known = self.c._known_addresses() if may_guess else []
                may_guess = False
                guessing = bool(known)
                if guessing:
                    # Any master that holds the committed version serves it, and one that does
                    # not says so: try one straight away and ask where the replicas are only
                    # on a miss (one call instead of two for most reads).
                    self.candidates = [self.c._rng.choice(known)]
                else:
                    try:
                        self._choose_replicas(deadline)
                    except DeadlineExceeded:
                        # The last pause left too little of the deadline for this call: why
                        # the download was retrying ("no reachable master holds v1") is the
                        # news, not that its next question was cut short.
                        if last is None or not deadline.expired():
                            raise
                        raise _gave_up(self._why(last, unreached), what,
                                       deadline.seconds) from None
            address = self.candidates[0]
            before = self.pos
            try:
                try:
                    self._segment(address)
                except DeadlineExceeded as exc:
                    if self.pos == before:
                        raise
                    # The segment's deadline passed while its bytes still came (a slow link):
                    # that is progress, and the download goes on from where it got to.
                    raise Unavailable(f"{exc}; resuming at byte {self.pos}") from None
            except (Unavailable, ChecksumMismatch, InternalError) as exc:
                # A replica that is down, sent bad bytes, or failed (a disk error there): the
                # others hold the same version.
                last = exc
                unreached = exc
                self.candidates.pop(0)
                self.failed.add(address)
            except KeyNotFound as exc:
                # "No longer kept" of the version this download began on (the latest then):
                # the key was updated meanwhile, and the replica list tells which to start over.
                replaced = self.version == 0 and self.info is not None
                if str(exc).startswith(_NOT_HELD_PREFIX) or replaced:
                    last = exc
                    self.candidates.pop(0)
                    self.failed.add(address)
                else:
                    raise
            else:
                deadline.restart()
                attempt = 0
                if self.end is not None and self.pos >= self.end:
                    return self._finish()
                continue
            if self.pos > before:
                # Bytes still arrive, from one replica or the next: the deadline bounds a wait
                # for the cluster, not a download that is progressing.
                deadline.restart()
                attempt = 0
            if not self.candidates and not guessing:
                self.c._pause(attempt, deadline, self._why(last, unreached), what)
                attempt += 1
            guessing = False

    def _why(self, last: BlobError, unreached: BlobError | None) -> BlobError:
        """What to give up with: a failure of a master that should have served the bytes,
        else, where every master said it lacks the version, that none holds it now. The key
        exists (its replica list was read), so "key not found" (exit 3), the last master's
        "not held here", would tell a script that it is gone, and name the internal call to
        ask instead."""
        if unreached is not None:
            return unreached
        if isinstance(last, KeyNotFound):
            version = self.info.version if self.info else self.version
            which = f"v{version}" if version else "the latest version"
            return Unavailable(
                f"no reachable master holds {which} of {self.key!r}: its copies may be on"
                " masters that are down, or being repaired; retry later ('blobha replication"
                f" --read {self.key}' shows how many masters hold it)")
        return last

    def _choose_replicas(self, deadline: _Deadline) -> None:
        status = self.c._read_call(
            f"find replicas of {self.key!r}",
            "GetReplication",
            pb.GetReplicationRequest(key=self.key),
            deadline,
        )
        if self.info is not None and self.version == 0 and status.version != self.info.version:
            # Every replica failed us on a version that is no longer the latest: it was
            # replaced mid-download and is probably pruned. Start over on the new one.
            if not self.sink.restart():
                raise KeyNotFound(
                    f"{self.key!r} was updated during the download and version"
                    f" {self.info.version} is no longer served; download it again"
                )
            self._reset()
        holders = [h for h in status.holders if h]
        self.c._learn(holders)
        wanted = self.info.version if self.info else self.version
        rng = self.c._rng
        others = [a for a in self.c._known_addresses() if a not in holders]
        rng.shuffle(others)
        if wanted in (0, status.version):
            rng.shuffle(holders)
            self.candidates = holders + others
        else:
            self.candidates = others + holders
            rng.shuffle(self.candidates)
        # Masters that already failed this download go last (stable: the order stays random).
        self.candidates.sort(key=lambda a: a in self.failed)

    def _segment(self, address: str, stream_only: bool = False) -> None:
        want = _DOWNLOAD_SEGMENT_BYTES
        bound = self.end if self.end is not None else self.limit
        if bound is not None:
            want = min(want, bound - self.pos)
        host = None
        if not stream_only and self.c._data_channels.usable(address):
            host = self.c._transport.data_host(address)
        request = pb.DownloadRequest(
            key=self.key,
            version=self.info.version if self.info else self.version,
            offset=self.pos,
            length=want,
            data_channel=host is not None,
        )
        start = self.pos
        seen_info = False
        offer: DataOffer | None = None
        for message in self.c._transport.server_stream(
            address, "Download", request, self.c._timeout, stall=self.c._stall_timeout
        ):
            if not seen_info:
                if not message.HasField("info"):
                    raise InternalError(f"master {address} sent data before the blob info")
                self._check_info(address, _info_from_pb(message.info))
                seen_info = True
            if message.ticket:  # offered only when asked for: the data comes over the channel
                offer = DataOffer(message.data_port, message.ticket)
            self._take(address, message.data)
        if host is not None and offer is not None:
            assert self.info is not None
            size = min(self.pos + want, self.info.size) - self.pos  # the master's range
            # The channel's own timeouts (connect, answer, each receive) are the stall limit.
            limit = min(self.c._timeout, self.c._stall_timeout)
            if not self.c._data_channels.take(address, host, offer, size, limit,
                                              functools.partial(self._take, address)):
                self._segment(address, stream_only=True)
            return
        if not seen_info:
            raise Unavailable(f"master {address} ended the download stream without data")
        if self.pos - start < want and self.end is not None and self.pos < self.end:
            raise Unavailable(f"master {address} ended the download early at byte {self.pos}")

    def _take(self, address: str, data: bytes | memoryview) -> None:
        if not data:
            return
        if self.end is not None and self.pos + len(data) > self.end:
            raise ChecksumMismatch(f"master {address} sent more bytes than the blob holds")
        self.sink.write(data)
        self.digester.update(data)
        self.pos += len(data)
        if self.progress is not None and self.end is not None:
            self.progress(self.pos - self.offset, self.end - self.offset)

    def _check_info(self, address: str, info: BlobInfo) -> None:
        if self.info is None:
            self.info = info
            self.end = info.size if self.limit is None else min(self.limit, info.size)
            self.end = max(self.end, self.offset)
            return
        if info != self.info:
            raise ChecksumMismatch(
                f"master {address} served version {info.version} ({info.digest}) while resuming"
                f" version {self.info.version} ({self.info.digest})"
            )

    def _finish(self) -> BlobInfo:
        info = self.info
        assert info is not None
        whole = self.offset == 0 and self.end == info.size
        if whole and (self.digester.size != info.size or self.digester.hexdigest() != info.digest):
            raise ChecksumMismatch(
                f"{self.key!r} version {info.version} arrived corrupt: digest"
                f" {self.digester.hexdigest()} over {self.digester.size} bytes, expected"
                f" {info.digest} over {info.size}; a destination path is left untouched, try"
                " again"
            )
        return info
