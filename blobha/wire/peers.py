"""Master-to-master calls: fetching a version for sync, and asking a peer for its status.

This is the gRPC edge of the synchroniser and the cluster summary: it takes and returns plain
values, so the sync logic never sees protobuf or channels.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import grpc

from blobha.core.addresses import host_of
from blobha.core.auth import MASTER_SECRET_METADATA_KEY, USER_METADATA_KEY
from blobha.core.errors import BlobError, ChecksumMismatch, Unavailable, from_status
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire import chunks
from blobha.wire.convert import master_from_pb
from blobha.wire.credentials import Credentials
from blobha.wire.datachannel import DataChannels, DataOffer, FileRange, send_upload
from blobha.wire.stagelinks import StageLinks
from blobha.wire.stallwatch import Stalled, StallWatch
from blobha.wire.status import MasterSummary

__all__ = [
    "CHANNEL_OPTIONS", "MAX_MESSAGE", "STALL_SECS", "USER_METADATA_KEY", "Appendable", "Peers",
]

MAX_MESSAGE = 8 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    # Fail fast on a dead peer instead of waiting out TCP's retransmission timeout.
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
]
#: How long a fetch may receive nothing before its peer counts as stalled and the fetch goes
#: on from another replica (the default of ``blobstore.sync.stall.secs``). A paused master
#: keeps its connections open and answers nothing; keepalive pings end such a call only when
#: the peer's kernel stops acknowledging too.
STALL_SECS = 10.0
#: How long a peer that stalled or left is tried after the others.
_SUSPECT_SECS = 60.0


class Appendable(Protocol):
    """Where a fetch appends what arrives (the store's temp blob, or a buffer in memory)."""

    @property
    def size(self) -> int: ...

    def write_at(self, offset: int, data: bytes | memoryview) -> int: ...


class Peers:
    """Channels to the other masters, authenticated as the master principal: the principal
    is proven by the cluster secret (see blobha.wire.authn); with TLS, the peer's certificate is
    verified against tls.ca and this master's own certificate is presented as client
    certificate. Renewed certificate files are picked up by re-opening the channels."""

    def __init__(self, principal: str, credentials: Credentials | None = None,
                 stall_secs: float = STALL_SECS) -> None:
        self._principal = principal
        self._metadata: tuple[tuple[str, str], ...] = ((USER_METADATA_KEY, principal),)
        self._credentials = credentials or Credentials()
        self._stamp = self._credentials.stamp()
        self._stubs: dict[str, pb_grpc.BlobStoreStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._guard = threading.Lock()
        self._data_channels = DataChannels(tls=self._credentials.data_tls)
        self.links = StageLinks(self._begin_link, self._stage_call, self._data_channels)
        self._stall = stall_secs
        self._stalls = StallWatch()
        #: Peers that stalled or left, and when: tried last for a while (see :meth:`rank`).
        self._suspects: dict[str, float] = {}

    def set_cluster_secret(self, secret: str) -> None:
        self._metadata = ((USER_METADATA_KEY, self._principal),
                          (MASTER_SECRET_METADATA_KEY, secret))

    def _stub(self, address: str) -> pb_grpc.BlobStoreStub:
        with self._guard:
            stamp = self._credentials.stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                for c in self._channels.values():
                    c.close()
                self._channels.clear()
                self._stubs.clear()
            stub = self._stubs.get(address)
            if stub is None:
                channel = self._credentials.channel(
                    address, [*CHANNEL_OPTIONS, chunks.CALLER_THREAD_STREAMS])
                self._channels[address] = channel
                stub = self._stubs[address] = chunks.stub(channel)
            return stub

    def close(self) -> None:
        self.links.close()
        self._stalls.close()
        with self._guard:
            for c in self._channels.values():
                c.close()
            self._channels.clear()
            self._stubs.clear()

    def fetch(
        self, address: str, key: str, seq: int, digest: str, dest: Appendable,
        timeout: float, stream_only: bool = False,
    ) -> None:
        """Append version ``seq`` of ``key`` from ``address`` to ``dest``, resuming at its size.

        Raises a :class:`BlobError` on failure; ``dest`` keeps what arrived, so the caller can
        resume from another replica.
        """
        data_channel = not stream_only and self._data_channels.usable(address)
        request = pb.DownloadRequest(key=key, version=seq, offset=dest.size,
                                     data_channel=data_channel)
        offer: DataOffer | None = None
        size = 0
        # Chunks decoded by hand (blobha.wire.chunks): their data are views, not copies.
        call = self._stub(address).Download(request, timeout=timeout, metadata=self._metadata)
        try:
            first = True
            for chunk in self._stalls.messages(call, self._stall, address):
                if first:
                    first = False
                    offered = chunk.info.digest if chunk.info is not None else "none"
                    if offered != digest:
                        raise ChecksumMismatch(
                            f"{address} offers {key!r} v{seq} with digest {offered},"
                            f" ZooKeeper says {digest}"
                        )
                    size = chunk.info.size if chunk.info is not None else 0
                if chunk.ticket:  # offered only when asked for
                    offer = DataOffer(chunk.data_port, chunk.ticket)
                if chunk.data:
                    dest.write_at(dest.size, chunk.data)
        except Stalled as e:
            raise self._stalled(address, e) from None
        except grpc.RpcError as e:
            raise _error(e) from None
        # The data channel's receive waits at most this long for each piece (its own stall).
        limit = min(timeout, self._stall)
        if offer is not None and not self._data_channels.take(
                address, host_of(address), offer, size - dest.size, limit,
                lambda data: dest.write_at(dest.size, data)):
            self.fetch(address, key, seq, digest, dest, timeout, stream_only=True)

    def fetch_many(self, address: str, refs: Sequence[tuple[str, int]], timeout: float
                   ) -> list[tuple[str, int, str, bytes]]:
        """Small versions from ``address`` in one call: (key, seq, digest, data) for each one it
        holds; those it lacks are left out. The caller verifies every one against the digest
        ZooKeeper holds. Raises a :class:`BlobError` when the call fails (a master of an
        older release answers UNIMPLEMENTED): fetch them one by one then."""
        request = pb.FetchVersionsRequest(
            versions=[pb.VersionRef(key=key, version=seq) for key, seq in refs])
        out: list[tuple[str, int, str, bytes]] = []
        call = self._stub(address).FetchVersions(request, timeout=timeout,
                                                 metadata=self._metadata)
        try:
            for reply in self._stalls.messages(call, self._stall, address):
                out.extend((v.key, v.version, v.digest, v.data)
                           for v in reply.versions if not v.missing)
        except Stalled as e:
            raise self._stalled(address, e) from None
        except grpc.RpcError as e:
            raise _error(e) from None
        return out

    def stage(self, address: str, epoch: int, versions: Sequence[tuple[str, int, str, bytes]],
              timeout: float) -> list[bool]:
        """Forward (key, size, digest, data) versions to ``address`` to keep staged (see
        blobha.master.forward): one bool per version, true once its copy there is synced and
        digest-checked. Over a stage link where one can be had (wire.stagelinks), else a
        StageVersions call. Raises a :class:`BlobError` when the call fails or takes longer
        than ``timeout`` (a master of an older release answers UNIMPLEMENTED)."""
        return self.links.stage(address, epoch, versions, timeout)

    def _begin_link(self, address: str, epoch: int, timeout: float) -> DataOffer | None:
        reply = self._begin(address, pb.BeginStagingRequest(link=True, epoch=epoch), timeout)
        return DataOffer(reply.data_port, reply.ticket) if reply.ticket else None

    def _begin(self, address: str, request: pb.BeginStagingRequest, timeout: float
               ) -> pb.UploadStatus:
        try:
            reply: pb.UploadStatus = self._stub(address).BeginStaging(
                request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return reply

    def _stage_call(self, address: str, epoch: int,
                    versions: Sequence[tuple[str, int, str, bytes]], timeout: float
                    ) -> list[bool]:
        request = pb.StageVersionsRequest(epoch=epoch, versions=[
            pb.StagedVersion(key=key, size=size, digest=digest, data=data)
            for key, size, digest, data in versions])
        try:
            reply = self._stub(address).StageVersions(request, timeout=timeout,
                                                      metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        staged = list(reply.staged)
        if len(staged) != len(versions):
            raise Unavailable(f"{address} answered {len(staged)} of {len(versions)} staged")
        return staged

    def begin_staging(self, address: str, key: str, epoch: int, timeout: float
                      ) -> tuple[str, DataOffer | None]:
        """Open a staging session for a streamed upload of ``key`` on ``address`` (see
        blobha.master.streamforward): its id, and the data channel it offers for the bytes
        (None: it has none, or this master cannot reach it now)."""
        reply = self._begin(address, pb.BeginStagingRequest(key=key, epoch=epoch), timeout)
        if not reply.ticket or not self._data_channels.usable(address):
            return reply.upload_id, None
        return reply.upload_id, DataOffer(reply.data_port, reply.ticket)

    def send_staging(self, address: str, offer: DataOffer,
                     pieces: Iterable[bytes | memoryview | FileRange], timeout: float
                     ) -> int:
        """Send ``pieces`` to a staging session over ``address``'s data channel; the bytes it
        then holds. ``timeout`` bounds the connect and each send (a stalled peer's limit)."""
        return send_upload(host_of(address), offer.port, offer.ticket, timeout, pieces,
                           self._data_channels.tls())

    def finish_staging(self, address: str, upload_id: str, key: str, epoch: int, size: int,
                       digest: str, timeout: float) -> bool:
        """End a staging session: whether ``address`` now keeps a synced copy of ``size``
        bytes with ``digest``."""
        try:
            reply = self._stub(address).FinishStaging(
                pb.FinishStagingRequest(upload_id=upload_id, key=key, epoch=epoch, size=size,
                                        digest=digest),
                timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from None
        return bool(reply.staged) and bool(reply.staged[0])

    def abandon(self, address: str, reason: str) -> None:
        """End the fetches from ``address`` now (it left the cluster: whatever it holds is no
        longer counted, and a paused master would keep them waiting for the stall limit)."""
        self._suspect(address)
        self._stalls.cancel(address, reason)

    def _suspect(self, address: str) -> None:
        """Rank ``address`` last for a while (see :meth:`rank`)."""
        with self._guard:
            self._suspects[address] = time.monotonic()

    def rank(self, addresses: Iterable[str]) -> list[str]:
        """``addresses`` shuffled, with those that stalled or left lately last: a fetch that
        gave up on a silent peer must not pick it again first."""
        now = time.monotonic()
        with self._guard:
            for address, since in list(self._suspects.items()):
                if now - since >= _SUSPECT_SECS:
                    del self._suspects[address]
            suspect = set(self._suspects)
        out = list(addresses)
        random.shuffle(out)
        out.sort(key=lambda a: a in suspect)  # stable: each group stays shuffled
        return out

    def _stalled(self, address: str, e: Stalled) -> BlobError:
        self._suspect(address)
        return Unavailable(f"{e}; fetching from another replica")

    def status(self, address: str, timeout: float) -> MasterSummary:
        try:
            reply = self._stub(address).NodeStatus(
                pb.NodeStatusRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise _error(e) from None
        return master_from_pb(reply)


def _error(e: grpc.RpcError) -> BlobError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    trailers = e.trailing_metadata() if hasattr(e, "trailing_metadata") else ()
    # grpc types each entry as _Metadatum, a (key, value) named tuple.
    pairs = tuple((str(m[0]), m[1]) for m in (trailers or ()))  # type: ignore[index]
    return from_status(code, details or "", pairs)
