"""The :class:`Client`: the public calls, each checking its arguments and delegating.

The work goes to the router (blobha.client.routing) or a transfer (blobha.client.upload,
blobha.client.download)."""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, BinaryIO, Literal, overload

from blobha.client import peering, reads, writes
from blobha.client.arguments import (
    DEFAULT_CHUNK_SIZE,
    MIN_STALL_TIMEOUT,
    STALL_TIMEOUT,
    UINT32_MAX,
    check_chunk_size,
    check_count,
    check_user,
    default_address_map,
    default_user,
    normalize_acl,
)
from blobha.client.download import DownloadJob
from blobha.client.limits import ClientLimits
from blobha.client.retry import Deadline
from blobha.client.routing import PROBE_TIMEOUT, Router
from blobha.client.seen import DEFAULT_REMEMBERED_KEYS
from blobha.client.sources import BufferSink, Sink, download_into
from blobha.client.transport import GrpcTransport, Transport
from blobha.client.values import (
    BlobInfo,
    BlobMeta,
    ClusterSummary,
    JobToken,
    MasterSummary,
    ProgressCallback,
    ReplicationStatus,
    UploadData,
    WaitResult,
)
from blobha.client.waiting import wait_for_replication
from blobha.core.acl import AccessControl, normalize_for_set
from blobha.core.addresses import parse_cluster
from blobha.core.auth import job_token_id
from blobha.core.consistency import View
from blobha.core.errors import (
    BlobError,
    InvalidArgument,
)
from blobha.core.keys import validate_key
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import (
    acl_from_pb,
    acl_to_pb,
    job_token_from_pb,
    master_from_pb,
    meta_from_pb,
    replication_from_pb,
    summary_from_pb,
)
from blobha.wire.credentials import Credentials
from blobha.wire.status import PeerPlan

_CONSISTENCIES = {"session": View.SESSION, "linearizable": View.LINEARIZABLE}
_CONSISTENCY_NAMES = {v: k for k, v in _CONSISTENCIES.items()}

#: Keys per List call: the most a master serves (blobha.master.facade.MAX_PAGE).
LIST_PAGE = 1000


class Client:
    """A connection to a blobha cluster.

    ``cluster`` lists some masters (``"m1:6627,m2:6627"`` or a list); the others and the leader
    are discovered. ``user`` defaults to the token's user, then ``$BLOBHA_USER``, then the
    operating-system user. ``credentials`` (TLS trust, client certificate, token file) default
    to ``$BLOBHA_CA``, ``$BLOBHA_CERT``/``$BLOBHA_KEY`` and ``$BLOBHA_TOKEN_FILE``.
    ``address_map`` (default ``$BLOBHA_ADDRESS_MAP``) maps advertised master addresses to the
    addresses this client dials, for clients outside the masters' network.
    ``timeout`` bounds how long one operation waits for the cluster, retries included (a
    transfer may run longer as long as every segment, 16 MiB up and 64 MiB down by default,
    moves within it, and a download as long as its bytes keep coming). ``limits``
    (:class:`~blobha.client.limits.ClientLimits`) sets those segment sizes, the largest blob
    sent in one call, and how long a refused credential is asked about again.
    ``stall_timeout`` is how long a master may stay silent (see :data:`STALL_TIMEOUT`) before
    the client moves on to another.
    ``remembered_keys`` bounds how many keys the client remembers the newest version it wrote
    or read of, for read-your-writes (docs/architecture.md, "The read guarantee"; 0: none).
    ``consistency="linearizable"`` makes every read (``read``, ``download``, ``get_meta``,
    ``get_replication``) serve the latest committed version, confirmed with ZooKeeper by the
    master that answers; without ZooKeeper it fails (:class:`Unavailable`) instead of
    answering from a master's last view.

    Example::

        from pathlib import Path

        from blobha.client import Client

        with Client("m1:6627,m2:6627,m3:6627", user="alice") as c:
            meta = c.create("model.bin", Path("/tmp/model.bin"), acl="u:alice:rwa,o::r")
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
        remembered_keys: int = DEFAULT_REMEMBERED_KEYS,
        consistency: str = "session",
        unreachable_after: float | None = None,
        limits: ClientLimits | None = None,
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
        self._user = check_user(user if user else default_user())
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be positive seconds, not {timeout!r}")
        self._timeout = float(timeout)
        if not stall_timeout >= MIN_STALL_TIMEOUT:
            raise InvalidArgument(f"stall_timeout must be at least {MIN_STALL_TIMEOUT:g} s, not"
                                  f" {stall_timeout!r}")
        chunk_size = check_chunk_size(chunk_size)
        if address_map is None:
            address_map = default_address_map()
        self._transport: Transport = transport or GrpcTransport(self._user, credentials,
                                                                address_map)
        self._router = Router(self._addresses, self._transport, self._timeout,
                              float(stall_timeout), chunk_size, remembered_keys, limits)
        self.consistency = consistency
        # None: a call waits out its timeout even while no master answers at all.
        self._router.unreachable_after = unreachable_after

    @classmethod
    def from_profile(cls, name: str | None = None, *, path: str | os.PathLike[str] | None = None,
                     **kwargs: Any) -> Client:
        """A client with the settings of client profile ``name`` (None: ``$BLOBHA_PROFILE``,
        else ``[default]``) from ``path`` (None: ``$BLOBHA_CONFIG``, else
        ``~/.config/blobha/client.toml``), as the command line takes them: the ``BLOBHA_*``
        variables that are set win over the profile, and keyword arguments (``cluster``,
        ``user``, ``timeout``, ``credentials`` and the others of the constructor) over both.
        Raises :class:`~blobha.core.profiles.ProfileError` (an InvalidArgument) naming the file
        and line of a setting it cannot use, or the profiles it has."""
        from pathlib import Path

        from blobha.core import profiles, settings

        found = profiles.load(name, None if path is None else Path(path))
        env = {**found.environment(), **{k: v for k, v in os.environ.items()
                                         if k in profiles.ENVIRONMENT.values()}}
        cluster = kwargs.pop("cluster", None) or env.get("BLOBHA_CLUSTER")
        if not cluster:
            raise InvalidArgument(f"no cluster: profile {found.name!r} names none and"
                                  " BLOBHA_CLUSTER is not set; pass cluster=")
        credentials = kwargs.pop("credentials", None) or Credentials.from_env(env)
        if "user" not in kwargs and not credentials.token_user():
            # Below the token's user, as $BLOBHA_USER is for any client.
            kwargs["user"] = env.get("BLOBHA_USER") or None
        if "timeout" not in kwargs and env.get("BLOBHA_TIMEOUT"):
            try:
                timeout = settings.real(env["BLOBHA_TIMEOUT"])
            except settings.SettingError:
                raise InvalidArgument(f"BLOBHA_TIMEOUT: expected a number of seconds, not"
                                      f" {env['BLOBHA_TIMEOUT']!r}") from None
            # Negative: the command line's "wait forever" for replication; calls keep 60 s.
            kwargs["timeout"] = timeout if timeout > 0 else 60.0
        return cls(cluster, credentials=credentials, **kwargs)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def user(self) -> str:
        return self._user

    @property
    def consistency(self) -> str:
        """``"session"`` (the default) or ``"linearizable"``: see the class's description."""
        return _CONSISTENCY_NAMES[self._router.view]

    @consistency.setter
    def consistency(self, value: str) -> None:
        try:
            self._router.view = _CONSISTENCIES[value]
        except (KeyError, TypeError):
            raise InvalidArgument(f"consistency must be 'session' or 'linearizable', not"
                                  f" {value!r}") from None

    @property
    def limits(self) -> ClientLimits:
        """Segment sizes, the largest blob sent in one call and the patience with refusals
        (see :class:`ClientLimits`); set another for the calls that start after."""
        return self._router.limits

    @limits.setter
    def limits(self, value: ClientLimits) -> None:
        if not isinstance(value, ClientLimits):
            raise InvalidArgument(f"limits must be a ClientLimits, not {value!r}")
        self._router.limits = value

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def on_retry(self) -> Callable[[str, BlobError, float], None] | None:
        """Told, once per call, when it has retried for a while: (what, why, seconds left
        before it gives up). The command line says it on a terminal, so a long wait (a
        ZooKeeper outage, say, retried for the whole timeout) is not a silent one."""
        return self._router.on_retry

    @on_retry.setter
    def on_retry(self, hook: Callable[[str, BlobError, float], None] | None) -> None:
        self._router.on_retry = hook

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
        """Create ``key`` with ``data``: bytes or a binary file object (the content), or a
        ``pathlib.Path`` (a file holding it); a ``str`` is refused (:class:`TypeError`), being
        either. ``acl`` is Storm's grammar (``"u:alice:rwa,o::r"``) or entries; the
        creator always keeps full access. ``replication_factor``/``write_quorum`` 0 = the
        cluster default. ``progress(done, total)`` is called as bytes go out (total -1 when
        unknown). Raises :class:`KeyAlreadyExists` if the key exists."""
        return writes.create(self._router, key, data, acl, replication_factor, write_quorum,
                             progress)

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
        return writes.update(self._router, key, data, expected_version, write_quorum, progress)

    def put(
        self,
        key: str,
        data: UploadData,
        acl: str | Sequence[AccessControl] | None = None,
        replication_factor: int = 0,
        write_quorum: int = 0,
        progress: ProgressCallback | None = None,
    ) -> BlobMeta:
        """Write ``data`` as ``key``'s next version, creating the key when it does not exist
        (with ``acl`` and ``replication_factor``, which an existing key keeps). Safe under
        concurrent callers: each succeeds, one creating the key and the others writing the
        versions after it; a file object body is rewound between attempts."""
        return writes.put(self._router, key, data, acl, replication_factor, write_quorum,
                          progress)

    def set_acl(self, key: str, acl: str | Sequence[AccessControl],
                expected_meta_version: int | None = None) -> BlobMeta:
        """Replace the ACL of ``key`` (needs ADMIN); the caller keeps ADMIN. With
        ``expected_meta_version`` (a :class:`BlobMeta`'s ``meta_version``; 0 is a version, that
        of a new key) the change is made only if the metadata is still that version, else
        :class:`VersionConflict`."""
        validate_key(key)
        entries = normalize_acl(acl)
        if expected_meta_version is not None:
            check_count("expected_meta_version", expected_meta_version)
        request = pb.SetMetaRequest(key=key, set_acl=True, acl=acl_to_pb(entries),
                                    expected_meta_version=expected_meta_version)

        def made_already(deadline: Deadline) -> Any:
            # A conflict after an attempt whose answer was lost may be that attempt's own
            # change: the metadata one version on, with this ACL (the setter keeps ADMIN).
            meta = self._router.read_meta(key, deadline)
            acl = list(acl_from_pb(meta.acl))
            ours = (meta.meta_version == (expected_meta_version or 0) + 1
                    and acl == normalize_for_set(entries, self._user))
            return meta if ours else None

        return self._saw(key, meta_from_pb(self._router.leader_call(
            f"set the ACL of {key!r}", "SetMeta", request,
            conflict_on_retry=made_already if expected_meta_version is not None else None)))

    def set_replication_factor(self, key: str, replication_factor: int) -> BlobMeta:
        """Change how many masters should hold ``key``."""
        validate_key(key)
        check_count("replication_factor", replication_factor, UINT32_MAX, minimum=1)
        request = pb.SetMetaRequest(key=key, replication_factor=replication_factor)
        return self._saw(key, meta_from_pb(
            self._router.leader_call(f"set the replication factor of {key!r}", "SetMeta", request)
        ))

    def issue_job_token(self, keys: Iterable[str], lifetime_secs: int = 0) -> JobToken:
        """A job token (docs/security.md, Job tokens): READ on exactly ``keys``, as this user
        (who must be able to read each now), for ``lifetime_secs`` (0: 24 hours; the cluster
        cuts a longer one to ``auth.job.token.max.lifetime.secs``). Its ``token`` is shown
        only here; hand it to the job's executors as their credential
        (``Credentials(bearer=...)``); ``expires_at`` says when it stops working."""
        wanted = builtins.list(keys)
        for key in wanted:
            validate_key(key)
        if not wanted:
            raise InvalidArgument("a job token needs at least one key")
        if lifetime_secs < 0:
            raise InvalidArgument(f"lifetime_secs must be positive, not {lifetime_secs!r}")
        request = pb.IssueJobTokenRequest(keys=wanted, lifetime_secs=int(lifetime_secs))
        # A retry after a lost answer issues a second token; the first, never handed out,
        # only waits for its expiry.
        return job_token_from_pb(self._router.leader_call(
            f"issue a job token for {len(wanted)} keys", "IssueJobToken", request))

    def revoke_job_token(self, token_or_id: str) -> str:
        """Revoke a job token, given whole or by its id (yours, or any as an admin); every
        master refuses it within seconds (docs/security.md). Returns its id."""
        try:
            token_id = job_token_id(token_or_id)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        request = pb.RevokeJobTokenRequest(token_or_id=token_id)  # the id: no secret on the wire
        # Missing on a retry: the attempt whose answer was lost revoked it.
        self._router.leader_call("revoke a job token", "RevokeJobToken", request,
                                 missing_ok_on_retry=True)
        return token_id

    def rotate_cluster_secret(self) -> tuple[int, float]:
        """Replace the cluster secret the masters prove themselves with (admins only; see
        docs/security.md): its generation, and the seconds the old one is still accepted."""
        answer = self._router.leader_call("rotate the cluster secret", "RotateClusterSecret",
                                          pb.RotateClusterSecretRequest())
        return int(answer.generation), float(answer.old_accepted_secs)

    def delete(self, key: str) -> None:
        """Delete ``key`` and all its versions. Raises :class:`KeyNotFound` if absent."""
        writes.delete(self._router, key, self._timeout)

    # -- reads -----------------------------------------------------------------------------

    def remember_version(self, key: str, version: int, created_at: float) -> None:
        """Read ``key`` from now on as if this client had read ``version`` of it (the key
        created at ``created_at``, :attr:`BlobMeta.created_at`): no later read returns an
        older one. For a process reading what another wrote, with the version it was handed
        (a job launched after its inputs were updated); a minimum already newer stays."""
        validate_key(key)
        check_count("version", version)
        if not created_at > 0:
            raise InvalidArgument(f"created_at must be the key's creation time (seconds since"
                                  f" the epoch, from its metadata), not {created_at!r}")
        self._router.seen.saw(key, version, created_at)

    def get_meta(self, key: str) -> BlobMeta:
        """The metadata of ``key``'s committed version, for a user holding any permission on
        it; ``access`` says which (:func:`require_read` before serving the blob elsewhere)."""
        return reads.meta(self._router, key)

    def stat(self, key: str) -> BlobMeta:
        """The committed version of ``key``: its size, version, digest, creation and update
        times and live replicas (``replication``); as :meth:`get_meta`."""
        return reads.meta(self._router, key)

    info = stat

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (a user with no permission on it is refused all the same,
        :class:`NotAuthorized`)."""
        return reads.exists(self._router, key)

    def get_replication(self, key: str) -> ReplicationStatus:
        validate_key(key)
        status = self._router.read_call(f"read the replication of {key!r}", "GetReplication",
                                        pb.GetReplicationRequest(key=key), key=key)
        self._router.learn(status.holders)
        return replication_from_pb(status)

    def node_status(self, address: str) -> MasterSummary:
        """The status of one master, asked directly (no leader discovery, no retries): what a
        health check wants to know about the node it runs on."""
        target = parse_cluster(address)[0]
        reply = self._transport.unary(target, "NodeStatus", pb.NodeStatusRequest(),
                                      min(self._timeout, PROBE_TIMEOUT))
        return master_from_pb(reply)

    def cluster_summary(self) -> ClusterSummary:
        summary = self._router.read_call(
            "read the cluster summary", "ClusterSummary", pb.ClusterSummaryRequest()
        )
        self._router.learn(m.address for m in summary.masters)
        return summary_from_pb(summary)

    def wait_for_replication(
        self, keys: str | Iterable[str], min_replication: int, timeout: float
    ) -> WaitResult:
        """Wait (on the server, from ZooKeeper watches) until every key has at least
        ``min_replication`` live replicas of its committed version, or ``timeout`` seconds
        pass (``reached`` is then False).

        The whole call, retries on unreachable masters included, ends within ``timeout`` plus
        a grace of :data:`~blobha.client.waiting.WAIT_GRACE` (2 s) for the master's last answer
        to arrive; if no master answered by then it raises
        (:class:`~blobha.core.errors.Unavailable`). A negative timeout waits forever, in
        bounded server calls; each of those may retry unreachable masters for the client's own
        timeout before the wait gives up."""
        names = [keys] if isinstance(keys, str) else builtins.list(keys)
        if not names:
            raise InvalidArgument("give at least one key to wait for")
        for name in names:
            validate_key(name)
        check_count("min_replication", min_replication, UINT32_MAX)
        return wait_for_replication(self._router, names, min_replication, float(timeout))

    def read(self, key: str, version: int = 0) -> bytes:
        """The content of ``key`` (``version`` 0 = the committed one), verified."""
        validate_key(key)
        check_count("version", version)
        sink = BufferSink()
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
            check_count(name, value)

        def into(sink: Sink) -> BlobInfo:
            return self._download(key, sink, version, offset, length, progress)

        return download_into(dest, into)

    @overload
    def list(self, prefix: str = "", page_size: int = LIST_PAGE, *,
             detail: Literal[False] = False) -> Iterator[str]: ...

    @overload
    def list(self, prefix: str = "", page_size: int = LIST_PAGE, *,
             detail: Literal[True]) -> Iterator[BlobMeta]: ...

    def list(self, prefix: str = "", page_size: int = LIST_PAGE, *,
             detail: bool = False) -> Iterator[str] | Iterator[BlobMeta]:
        """Every key starting with ``prefix``, in server order, following pages as needed.
        ``page_size``: keys asked for per call, at most the default, the largest page a master
        serves (a listing of 100,000 keys is 100 calls); fewer where only the first few keys
        are wanted. With ``detail`` each key's :class:`BlobMeta` (a metadata call per key, a
        few at a time; a key deleted meanwhile is left out)."""
        if not 1 <= page_size <= LIST_PAGE:
            raise InvalidArgument(f"page_size must be 1 to {LIST_PAGE}, not {page_size}")
        if detail:
            return reads.list_detail(self._router, prefix, page_size)
        return (key for page in reads.list_keys(self._router, prefix, page_size) for key in page)

    def open(self, key: str, version: int | None = None) -> io.BufferedReader:
        """``key`` as a seekable, buffered, read-only binary file, read in ranges as needed,
        of the version committed now (or ``version``) for as long as it is open. Read from the
        start to the end in order, it is checked against the blob's digest
        (:class:`~blobha.core.errors.ChecksumMismatch`)."""
        return reads.open_blob(self._router, key, version, self._router.chunk_size)

    def iter_chunks(self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE,
                    version: int = 0) -> Iterator[bytes]:
        """The content of one version of ``key`` (``version`` 0: the one committed when the
        iteration starts) in pieces of ``chunk_size`` bytes, each a ranged download; the
        whole is checked against the blob's digest before the last piece is handed out."""
        check_count("version", version)
        if chunk_size < 1:
            raise InvalidArgument(f"chunk_size must be positive, not {chunk_size!r}")
        return reads.iter_chunks(self._router, key, chunk_size, version)

    # -- node caches fetching from each other (blobha.cache.peers) ----------------------------

    def peer_plan(self, key: str, version: int = 0, peer_address: str = "",
                  complete: bool = False) -> PeerPlan:
        """A plan to fetch ``key`` v``version`` (0: the committed one) from peers and the
        replicas, announcing ``peer_address`` as a cache that serves it (empty: none). READ
        is needed, as for a download. A master that predates plans answers with an error
        (UNIMPLEMENTED): the caller then downloads as before."""
        validate_key(key)
        check_count("version", version)
        return peering.peer_plan(self._router, key, version, peer_address, complete)

    def read_range(self, key: str, version: int, offset: int, length: int, prefer: str,
                   on_data: Callable[[memoryview], object]) -> None:
        """Bytes of one version from the replica ``prefer`` first (see
        :func:`blobha.client.peering.read_range`); ``on_data``'s views are valid during the
        call only."""
        peering.read_range(self._router, key, version, offset, length, prefer, on_data)

    def addresses(self) -> builtins.list[str]:
        """The masters this client knows of (given and discovered)."""
        return self._router.known_addresses()

    @property
    def credentials(self) -> Credentials | None:
        """The TLS and token settings this client dials the masters with (None: a test's
        transport)."""
        creds = getattr(self._transport, "credentials", None)
        return creds if isinstance(creds, Credentials) else None

    # -- internals -------------------------------------------------------------------------

    def _saw(self, key: str, meta: BlobMeta) -> BlobMeta:
        return writes.saw(self._router, key, meta)

    def _download(
        self,
        key: str,
        sink: Sink,
        version: int,
        offset: int,
        length: int,
        progress: ProgressCallback | None,
    ) -> BlobInfo:
        return DownloadJob(self._router, key, sink, version, offset, length, progress).run()
