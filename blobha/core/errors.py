"""The error hierarchy, and its one mapping to and from gRPC status codes.

Every error a user can see is a :class:`BlobError` subclass whose message states what happened.
Where a built-in exception means the same, the class derives from it too (``KeyNotFound`` is a
``FileNotFoundError`` and a ``KeyError``, ``Unavailable`` a ``ConnectionError``...), so code
written against files or mappings handles blobha's errors as it handles theirs. Servicers raise
them; :func:`to_status` turns them into a gRPC status in exactly one place, and the client turns
a status back into the same class with :func:`from_status`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

#: Trailing-metadata key naming the leader when a non-leader refuses a leader-only call.
LEADER_METADATA_KEY = "x-blobha-leader"
#: Trailing-metadata key marking a RESOURCE_EXHAUSTED that is only "too many calls at once":
#: clients back off and retry it, unlike a full disk.
BUSY_METADATA_KEY = "x-blobha-busy"
#: Trailing-metadata key marking an UNAVAILABLE given before the call ran (no leader yet, no
#: ZooKeeper connection): a client need not ask whether a write it carried was made.
REFUSED_METADATA_KEY = "x-blobha-refused"
#: Trailing-metadata key marking an UNAVAILABLE because this master's committed view of the key
#: is older than the client has written or read (its ``min_version``): another master, or
#: this one a moment later, can serve it.
STALE_METADATA_KEY = "x-blobha-stale"
#: What grpcio's server says, with RESOURCE_EXHAUSTED, to a call that finds every one of its
#: threads taken (``maximum_concurrent_rpcs``, see
#: :func:`blobha.master.edge.service.new_server`): busy too.
SERVER_FULL_DETAILS = "Concurrent RPC limit exceeded!"


class _StatusCode:
    """A class's gRPC status code, looked up by name on first use.

    Every blobha module raises these errors, but not every process makes gRPC calls: a Spark
    task served from a warm node cache never does, and importing grpc there would cost it more
    (tens of milliseconds) than the whole lookup. So this module names codes and imports grpc
    only when one is asked for.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> grpc.StatusCode:
        import grpc

        return grpc.StatusCode[self.name]


class BlobError(Exception):
    """Base class of every blobha error. ``code`` is the gRPC status it maps to."""

    code = _StatusCode("INTERNAL")
    #: Process exit status used by the CLI for this class of error.
    exit_code: int = 1

    def __str__(self) -> str:
        # The plain message, whatever built-in a subclass also derives from: KeyError's own
        # would quote it, OSError's would format an (errno, text) pair.
        if len(self.args) == 1:
            return str(self.args[0])
        return super().__str__()


class KeyNotFound(BlobError, FileNotFoundError, KeyError):
    code = _StatusCode("NOT_FOUND")
    exit_code = 3


class KeyAlreadyExists(BlobError, FileExistsError):
    code = _StatusCode("ALREADY_EXISTS")
    exit_code = 4


class NotAuthorized(BlobError, PermissionError):
    code = _StatusCode("PERMISSION_DENIED")
    exit_code = 5


class Unauthenticated(NotAuthorized):
    """The call carried no credential, or a wrong one. A subclass of NotAuthorized, so code that
    handles "not allowed" handles it too; the message says which credential to pass."""

    code = _StatusCode("UNAUTHENTICATED")
    exit_code = 15


class TlsMismatch(BlobError):
    """No master accepted a TLS connection with the client's settings: another CA, a
    certificate that does not name the address dialled, or TLS on one side only.
    Found by the client, never sent by a master. Not a NotAuthorized:
    it says nothing of what this user may read, and code that would, on a refusal, forget
    what the user was once allowed (the node cache) must not."""

    code = _StatusCode("UNAUTHENTICATED")
    exit_code = 16


class InvalidArgument(BlobError, ValueError):
    code = _StatusCode("INVALID_ARGUMENT")
    exit_code = 6


class NotLeader(BlobError):
    """A leader-only call reached a follower. ``leader`` is where to go instead, if known."""

    code = _StatusCode("FAILED_PRECONDITION")
    exit_code = 7

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class VersionConflict(BlobError):
    code = _StatusCode("ABORTED")
    exit_code = 8


class ChecksumMismatch(BlobError):
    code = _StatusCode("DATA_LOSS")
    exit_code = 9


class ResourceExhausted(BlobError):
    code = _StatusCode("RESOURCE_EXHAUSTED")
    exit_code = 10


class Unavailable(BlobError, ConnectionError):
    """ZooKeeper is unreachable, there is no leader yet, or leadership was lost mid-call."""

    code = _StatusCode("UNAVAILABLE")
    exit_code = 11


class Refused(Unavailable):
    """A master refused the call before running it: it does not lead (an election is under
    way), or it lost its ZooKeeper connection. Retried like any Unavailable; known not to have
    run, so a write it carried was not made. On the wire: UNAVAILABLE with the refused
    trailer."""


class Stale(Refused):
    """A master refused a read because its committed view of the key is older than the
    version the client has already written or read (read-your-writes): it is cut off from
    ZooKeeper, or its view trails. Retried at another master. On the wire: UNAVAILABLE with
    the stale trailer (and the refused one, which older clients know)."""


class Busy(Unavailable):
    """A master refused the call before running it: the threads it gives such calls were all
    taken (master.rpc.threads, master.max.calls.per.client). An Unavailable, so retried after
    a pause, there or at another master; known not to have run. On the wire:
    RESOURCE_EXHAUSTED with the busy trailer (or grpcio's own refusal)."""

    code = _StatusCode("RESOURCE_EXHAUSTED")
    exit_code = 17


class DeadlineExceeded(BlobError, TimeoutError):
    code = _StatusCode("DEADLINE_EXCEEDED")
    exit_code = 12


#: What a call raises when no master gave it an answer (none reachable, none in time, or none
#: with the client's TLS settings), as opposed to an answer that refuses it: where a node can
#: go on with what it holds (the node cache), it does.
NO_ANSWER: tuple[type[BlobError], ...] = (Unavailable, DeadlineExceeded, TlsMismatch)


class UploadNotFound(BlobError):
    """The upload id is unknown: it expired, was aborted, or its leader changed."""

    code = _StatusCode("NOT_FOUND")
    exit_code = 13


class InternalError(BlobError):
    code = _StatusCode("INTERNAL")
    exit_code = 14


@functools.cache
def _by_code() -> dict[grpc.StatusCode, type[BlobError]]:
    import grpc

    codes = grpc.StatusCode
    return {
        codes.NOT_FOUND: KeyNotFound,
        codes.ALREADY_EXISTS: KeyAlreadyExists,
        codes.PERMISSION_DENIED: NotAuthorized,
        codes.UNAUTHENTICATED: Unauthenticated,
        codes.INVALID_ARGUMENT: InvalidArgument,
        codes.OUT_OF_RANGE: InvalidArgument,
        codes.FAILED_PRECONDITION: NotLeader,
        codes.ABORTED: VersionConflict,
        codes.DATA_LOSS: ChecksumMismatch,
        codes.RESOURCE_EXHAUSTED: ResourceExhausted,
        codes.UNAVAILABLE: Unavailable,
        codes.DEADLINE_EXCEEDED: DeadlineExceeded,
        codes.INTERNAL: InternalError,
        codes.UNKNOWN: InternalError,
    }


# An upload-id miss and a key miss share NOT_FOUND on the wire; the message prefix tells them
# apart so the client can raise the precise class.
_UPLOAD_PREFIX = "upload "


def to_status(error: BlobError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The (code, details, trailing metadata) a servicer aborts with for ``error``."""
    trailers: tuple[tuple[str, str], ...] = ()
    if isinstance(error, NotLeader) and error.leader:
        trailers = ((LEADER_METADATA_KEY, error.leader),)
    elif isinstance(error, Busy):
        trailers = ((BUSY_METADATA_KEY, "1"),)
    elif isinstance(error, Stale):
        trailers = ((REFUSED_METADATA_KEY, "1"), (STALE_METADATA_KEY, "1"))
    elif isinstance(error, Refused):
        trailers = ((REFUSED_METADATA_KEY, "1"),)
    return error.code, str(error), trailers


def from_status(
    code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str | bytes], ...] = ()
) -> BlobError:
    """The error a client raises for a failed call."""
    import grpc

    if code == grpc.StatusCode.NOT_FOUND and details.startswith(_UPLOAD_PREFIX):
        return UploadNotFound(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Busy, not out of room: another master may serve, or this one a moment later. Said
        # by grpcio itself when every thread is taken, or by the Gatekeeper's trailer.
        if details == SERVER_FULL_DETAILS:
            return Busy(f"every one of its call threads is in use (master.rpc.threads; {details})")
        if any(k == BUSY_METADATA_KEY for k, _ in trailers):
            return Busy(details)
    cls = _by_code().get(code, InternalError)
    if cls is NotLeader:
        leader = ""
        for k, v in trailers:
            if k == LEADER_METADATA_KEY:
                leader = v.decode() if isinstance(v, bytes) else v
        return NotLeader(details, leader)
    if code == grpc.StatusCode.UNAVAILABLE and any(k == STALE_METADATA_KEY for k, _ in trailers):
        return Stale(details)
    if code == grpc.StatusCode.UNAVAILABLE and any(k == REFUSED_METADATA_KEY for k, _ in trailers):
        return Refused(details)
    if code == grpc.StatusCode.UNAVAILABLE and not details:
        details = "no master answered: check the cluster's addresses and that its masters run"
    return cls(details or code.name)


def upload_not_found(upload_id: str) -> UploadNotFound:
    return UploadNotFound(
        f"{_UPLOAD_PREFIX}{upload_id!r} is unknown: it expired, was aborted or committed, or the"
        " leader changed; begin a new upload"
    )
