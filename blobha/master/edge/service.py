"""The gRPC servicer: converts protobuf to plain values, calls :class:`blobha.master.facade.Master`,
and converts back. Errors become gRPC statuses here and only here (via blobha.core.errors)."""

from __future__ import annotations

import errno
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from blobha.core.acl import READ
from blobha.core.blobstate import BlobState
from blobha.core.digest import CHUNK_SIZE
from blobha.core.errors import BlobError, InvalidArgument, ResourceExhausted, Unavailable, to_status
from blobha.master.edge.audit import audited
from blobha.master.edge.gatekeeper import authenticated_user
from blobha.master.edge.health import BLOBSTORE_SERVICE, MasterHealth
from blobha.master.edge.interceptor import ObservingInterceptor
from blobha.master.edge.metrics import RpcMetrics
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.chunks import (
    UploadPiece,
    decode_upload_chunk,
    encode_chunk,
    serialize_response,
)
from blobha.wire.convert import (
    acl_from_pb,
    job_token_to_pb,
    master_to_pb,
    min_version_from_pb,
    peer_plan_to_pb,
    replication_to_pb,
    state_to_pb,
    view_from_pb,
)
from blobha.wire.datachannel import DataOffer
from blobha.wire.peers import CHANNEL_OPTIONS
from blobha.zk.connection import UNREACHABLE

if TYPE_CHECKING:
    from blobha.master.facade import Master

log = logging.getLogger("blobha.service")

T = TypeVar("T")
MAX_WORKERS = 64
#: FetchVersions packs versions into messages of about this size (well under MAX_MESSAGE).
FETCH_MESSAGE_BYTES = 1024 * 1024


#: Clients and peers ping every few seconds during long calls (a commit waiting for its write
#: quorum sends no data) to notice a paused master; the server must not count those pings as
#: abuse and close the connection ("too many pings").
SERVER_OPTIONS = [
    # gRPC sets SO_REUSEPORT by default, and a second master started on the same address
    # then binds too and takes a share of the calls; without it, the second one fails to start.
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


def new_server(interceptors: Iterable[grpc.ServerInterceptor] = (),  # type: ignore[type-arg]
               options: Iterable[tuple[str, Any]] = (),
               metrics: RpcMetrics | None = None, threads: int = MAX_WORKERS) -> grpc.Server:
    """A gRPC server with ``threads`` threads for calls. With ``metrics``, every call first
    gets a request id, metrics and decoding by
    :class:`blobha.master.edge.interceptor.ObservingInterceptor`
    (so the interceptors' refusals are counted too); ``interceptors`` (authentication) come
    after it.

    A call that finds every thread taken is refused at once with RESOURCE_EXHAUSTED
    (:data:`blobha.core.errors.SERVER_FULL_DETAILS`), which clients take for "busy, retry". Queued
    instead, it would wait unseen, and so would the status check with which a client tells a
    busy master from a paused one: the client would give up on a master that works. (grpcio
    refuses such a call before any handler runs: no metric counts it.)"""
    chain: list[Any] = []
    if metrics is not None:
        chain.append(ObservingInterceptor(metrics, _abort))
    chain.extend(interceptors)
    return grpc.server(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                       interceptors=chain,
                       options=[*CHANNEL_OPTIONS, *SERVER_OPTIONS, *options],
                       maximum_concurrent_rpcs=threads)


class _HandlerCapture:
    """Stands in for a server to take the generated method handlers, so one can be changed."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.handlers = dict(handlers)


def add_to_server(master: Master, server: grpc.Server, checks: MasterHealth) -> None:
    servicer = BlobStoreServicer(master)
    capture = _HandlerCapture()
    pb_grpc.add_BlobStoreServicer_to_server(servicer, capture)  # type: ignore[no-untyped-call]
    if "Download" not in capture.handlers:
        raise RuntimeError("the generated gRPC code registers no handlers; regenerate it with"
                           " proto/generate.sh")
    # Upload and download chunks are (de)serialised by hand: one copy of each MiB, not three.
    capture.handlers["AppendUpload"] = grpc.stream_unary_rpc_method_handler(
        servicer.AppendUpload,
        request_deserializer=decode_upload_chunk,
        response_serializer=pb.UploadStatus.SerializeToString,
    )
    capture.handlers["Download"] = grpc.unary_stream_rpc_method_handler(
        servicer.Download,
        request_deserializer=pb.DownloadRequest.FromString,
        response_serializer=serialize_response,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(BLOBSTORE_SERVICE, capture.handlers),)
    )
    server.add_registered_method_handlers(  # type: ignore[attr-defined]
        BLOBSTORE_SERVICE, capture.handlers
    )
    # The standard services, so grpcurl and health probes work without the .proto file.
    checks.add_to_server(server)
    reflection.enable_server_reflection(
        (BLOBSTORE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )


def _abort(context: grpc.ServicerContext, error: BlobError) -> NoReturn:
    code, details, trailers = to_status(error)
    if trailers:
        context.set_trailing_metadata(trailers)
    context.abort(code, details)
    raise AssertionError("unreachable")  # context.abort raises


def translate_error(identity: str, method: str, e: Exception) -> BlobError:
    """What a caller is told of ``e``, raised while serving ``method`` (a call, or the data
    channel's upload): the error itself, or one that says what to do."""
    if isinstance(e, BlobError):
        return e
    if isinstance(e, UNREACHABLE):
        return Unavailable(
            f"ZooKeeper is unreachable from master {identity} ({type(e).__name__}); retry shortly"
        )
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        # Past the reservation check (another process filled the disk, or a quota): the disk,
        # not a bug. Every write path cleans up what it began before this reaches here.
        log.warning("%s failed: %s", method, e)
        return ResourceExhausted(
            f"master {identity} is out of disk space ({e.strerror}); nothing was stored by this"
            " call: free space there and retry")
    log.exception("internal error in %s", method)
    return BlobError(f"internal error on master {identity} in {method} (logged there); retry or"
                     " report it")


def unary(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(self: BlobStoreServicer, request: Any, context: grpc.ServicerContext) -> T:
        # Handlers never call context.abort themselves (it raises a bare Exception that would
        # look like a bug here); they raise BlobError and this is the one place that aborts.
        try:
            return fn(self, request, context)
        except Exception as e:
            _abort(context, translate_error(self.master.identity, fn.__name__, e))
    return wrapper


def streaming(fn: Callable[..., Iterator[T]]) -> Callable[..., Iterator[T]]:
    @functools.wraps(fn)
    def wrapper(self: BlobStoreServicer, request: Any, context: grpc.ServicerContext
                ) -> Iterator[T]:
        try:
            yield from fn(self, request, context)
        except Exception as e:
            _abort(context, translate_error(self.master.identity, fn.__name__, e))
    return wrapper


def user_of(context: grpc.ServicerContext) -> str:
    # Authenticated by the gatekeeper interceptor before any handler runs (blobha.wire.authn).
    return authenticated_user(context)


class BlobStoreServicer(pb_grpc.BlobStoreServicer):
    def __init__(self, master: Master) -> None:
        self.master = master

    def _meta(self, user: str, key: str, state: BlobState, replication: int) -> pb.BlobMeta:
        """A key's metadata as ``user`` is answered it: with the permissions it holds."""
        return state_to_pb(key, state, replication, self.master.access(user, state.acl, key))

    @unary
    def BeginUpload(self, request: pb.BeginUploadRequest, context: grpc.ServicerContext
                    ) -> pb.BeginUploadResponse:
        user = user_of(context)
        with audited(user, "begin-create" if request.create else "begin-update", request.key):
            upload_id, expires, committed = self.master.begin_upload(
                user, request.key, request.create, list(acl_from_pb(request.acl)),
                request.replication_factor, request.expected_version, request.size_hint,
                request.write_quorum, request.write_id,
            )
        if committed is not None:
            return pb.BeginUploadResponse(committed=self._meta(user, *committed))
        return pb.BeginUploadResponse(upload_id=upload_id, expires_after_secs=expires)

    @unary
    def AppendUpload(self, request_iterator: Iterator[UploadPiece],
                     context: grpc.ServicerContext) -> pb.UploadStatus:
        user = user_of(context)
        upload_id = ""
        received = 0
        for chunk in request_iterator:
            upload_id = chunk.upload_id or upload_id
            if not upload_id:
                raise InvalidArgument("the first chunk must carry the upload id")
            received = self.master.append(user, upload_id, chunk.offset, chunk.data)
        return pb.UploadStatus(upload_id=upload_id, received=received)

    @unary
    def GetUploadStatus(self, request: pb.UploadStatusRequest, context: grpc.ServicerContext
                        ) -> pb.UploadStatus:
        user = user_of(context)
        offer = None
        if request.data_channel:
            received, offer = self.master.offer_upload(user, request.upload_id)
        else:
            received = self.master.upload_status(user, request.upload_id)
        if offer is None:
            return pb.UploadStatus(upload_id=request.upload_id, received=received)
        return pb.UploadStatus(upload_id=request.upload_id, received=received,
                               data_port=offer.port, ticket=offer.ticket)

    @unary
    def CommitUpload(self, request: pb.CommitUploadRequest, context: grpc.ServicerContext
                     ) -> pb.BlobMeta:
        user = user_of(context)
        with audited(user, "commit", self.master.upload_key(request.upload_id)) as rec:
            key, state, replication = self.master.commit(
                user, request.upload_id, request.size, request.digest
            )
            rec.key, rec.version = key, state.seq
        return self._meta(user, key, state, replication)

    @unary
    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext) -> pb.BlobMeta:
        user = user_of(context)
        b = request.begin
        with audited(user, "put-create" if b.create else "put-update", b.key) as rec:
            key, state, replication = self.master.put(
                user, b.key, b.create, list(acl_from_pb(b.acl)), b.replication_factor,
                b.expected_version, b.write_quorum, request.data, request.digest, b.write_id,
            )
            rec.version = state.seq
        return self._meta(user, key, state, replication)

    @unary
    def AbortUpload(self, request: pb.AbortUploadRequest, context: grpc.ServicerContext
                    ) -> pb.AbortUploadResponse:
        user = user_of(context)
        with audited(user, "abort-upload", self.master.upload_key(request.upload_id)):
            self.master.abort(user, request.upload_id)
        return pb.AbortUploadResponse()

    @streaming
    def Download(self, request: pb.DownloadRequest, context: grpc.ServicerContext
                 ) -> Iterator[bytes | pb.DownloadChunk]:
        info, created_at, chunks = self.master.open_download(
            user_of(context), request.key, request.version, request.offset, request.length,
            request.data_channel, min_version_from_pb(request), view_from_pb(request),
        )
        first: pb.BlobInfo | None = pb.BlobInfo(version=info.seq, size=info.size,
                                                digest=info.digest, created_at=created_at)
        if isinstance(chunks, DataOffer):
            yield pb.DownloadChunk(info=first, data_port=chunks.port, ticket=chunks.ticket)
            return
        for data in chunks:
            # Chunks come verified from the store, at most CHUNK_SIZE each; encoded by hand
            # (blobha.wire.chunks), as serialised DownloadChunk messages.
            assert len(data) <= CHUNK_SIZE
            yield encode_chunk(data, first)
            first = None
        if first is not None:
            yield encode_chunk(b"", first)

    @streaming
    def FetchVersions(self, request: pb.FetchVersionsRequest, context: grpc.ServicerContext
                      ) -> Iterator[pb.FetchedVersions]:
        found = self.master.fetch_versions(
            user_of(context), [(r.key, r.version) for r in request.versions])
        reply, size = pb.FetchedVersions(), 0
        for key, seq, info, data in found:
            if info is None:
                reply.versions.add(key=key, version=seq, missing=True)
            else:
                reply.versions.add(key=key, version=seq, digest=info.digest, data=data)
                size += len(data)
            if size >= FETCH_MESSAGE_BYTES:
                yield reply
                reply, size = pb.FetchedVersions(), 0
        if reply.versions:
            yield reply

    @unary
    def StageVersions(self, request: pb.StageVersionsRequest, context: grpc.ServicerContext
                      ) -> pb.StageVersionsResponse:
        staged = self.master.stage_versions(
            user_of(context), request.epoch,
            [(v.key, v.size, v.digest, v.data) for v in request.versions])
        return pb.StageVersionsResponse(staged=staged)

    @unary
    def BeginStaging(self, request: pb.BeginStagingRequest, context: grpc.ServicerContext
                     ) -> pb.UploadStatus:
        if request.link:
            link = self.master.begin_stage_link(user_of(context), request.epoch)
            if link is None:
                return pb.UploadStatus()
            return pb.UploadStatus(data_port=link.port, ticket=link.ticket)
        upload_id, offer = self.master.begin_staging(user_of(context), request.key,
                                                     request.epoch)
        if offer is None:
            return pb.UploadStatus(upload_id=upload_id)
        return pb.UploadStatus(upload_id=upload_id, data_port=offer.port, ticket=offer.ticket)

    @unary
    def FinishStaging(self, request: pb.FinishStagingRequest, context: grpc.ServicerContext
                      ) -> pb.StageVersionsResponse:
        staged = self.master.finish_staging(user_of(context), request.upload_id, request.key,
                                            request.epoch, request.size, request.digest)
        return pb.StageVersionsResponse(staged=[staged])

    @unary
    def GetMeta(self, request: pb.GetMetaRequest, context: grpc.ServicerContext) -> pb.BlobMeta:
        user = user_of(context)
        state, replication = self.master.get_meta(user, request.key, request.any_access,
                                                  min_version_from_pb(request),
                                                  view_from_pb(request))
        meta = self._meta(user, request.key, state, replication)
        if not meta.access & READ:
            # What READ alone may learn: a writer could test guesses of a small secret
            # against the digest, and the live copies are GetReplication's, which needs READ.
            meta.digest, meta.replication = "", 0
        return meta

    @unary
    def SetMeta(self, request: pb.SetMetaRequest, context: grpc.ServicerContext) -> pb.BlobMeta:
        user = user_of(context)
        with audited(user, "set-meta", request.key) as rec:
            acl = list(acl_from_pb(request.acl)) if request.set_acl else None
            expected = (request.expected_meta_version
                        if request.HasField("expected_meta_version") else None)
            state = self.master.set_meta(user, request.key, acl, request.replication_factor,
                                         expected)
            rec.version = state.seq
        return self._meta(user, request.key, state, 0)

    @unary
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext
               ) -> pb.DeleteResponse:
        user = user_of(context)
        with audited(user, "delete", request.key):
            expected = (request.expected_created_at if request.HasField("expected_created_at")
                        else None)
            self.master.delete(user, request.key, expected)
        return pb.DeleteResponse()

    @unary
    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        keys, token = self.master.list_keys(user_of(context), request.prefix, request.page_token,
                                            request.page_size)
        return pb.ListResponse(keys=keys, next_page_token=token)

    @unary
    def GetReplication(self, request: pb.GetReplicationRequest, context: grpc.ServicerContext
                       ) -> pb.ReplicationStatus:
        return replication_to_pb(self.master.get_replication(
            user_of(context), request.key, min_version_from_pb(request), view_from_pb(request)))

    @unary
    def PeerPlan(self, request: pb.PeerPlanRequest, context: grpc.ServicerContext
                 ) -> pb.PeerPlanResponse:
        return peer_plan_to_pb(self.master.peer_plan(
            user_of(context), request.key, request.version, request.peer_address,
            request.complete, min_version_from_pb(request), view_from_pb(request),
            caller=context.peer()))

    @unary
    def WaitForReplication(self, request: pb.WaitForReplicationRequest,
                           context: grpc.ServicerContext) -> pb.WaitForReplicationResponse:
        timeout = request.timeout_secs
        remaining = context.time_remaining()
        if remaining is not None:
            # Answer before the caller's own deadline, so it learns the counts.
            cap = max(remaining - 0.5, 0.0)
            timeout = cap if timeout < 0 else min(timeout, cap)
        # A caller that went away (cancelled, or its connection lost) gets no answer: the
        # wait would hold one of the master's call threads to its end for nothing (a "forever"
        # wait from a client without a deadline, for ever).
        abandoned = threading.Event()
        if not context.add_callback(abandoned.set):
            abandoned.set()  # gone already: the callback would never run
        reached, infos, waited = self.master.wait_for_replication(
            user_of(context), list(request.keys), request.min_replication, timeout, abandoned
        )
        return pb.WaitForReplicationResponse(
            reached=reached, status=[replication_to_pb(i) for i in infos], waited_secs=waited
        )

    @unary
    def IssueJobToken(self, request: pb.IssueJobTokenRequest, context: grpc.ServicerContext
                      ) -> pb.JobToken:
        user = user_of(context)
        with audited(user, "issue-job-token", ",".join(request.keys)[:200]) as rec:
            issued = self.master.issue_job_token(user, list(request.keys), request.lifetime_secs)
            rec.detail = f"job token {issued.token_id}"
        return job_token_to_pb(issued)

    @unary
    def RevokeJobToken(self, request: pb.RevokeJobTokenRequest, context: grpc.ServicerContext
                       ) -> pb.RevokeJobTokenResponse:
        user = user_of(context)
        with audited(user, "revoke-job-token", "") as rec:
            token_id = self.master.revoke_job_token(user, request.token_or_id)
            rec.detail = f"job token {token_id}"
        return pb.RevokeJobTokenResponse(token_id=token_id)

    @unary
    def RotateClusterSecret(self, request: pb.RotateClusterSecretRequest,
                            context: grpc.ServicerContext) -> pb.RotateClusterSecretResponse:
        user = user_of(context)
        with audited(user, "rotate-secret", "") as rec:
            generation, old_secs = self.master.rotate_cluster_secret(user)
            rec.detail = f"generation {generation}"
        return pb.RotateClusterSecretResponse(generation=generation, old_accepted_secs=old_secs)

    @unary
    def ClusterSummary(self, request: pb.ClusterSummaryRequest, context: grpc.ServicerContext
                       ) -> pb.ClusterSummaryResponse:
        view = self.master.cluster_summary()
        return pb.ClusterSummaryResponse(
            masters=[master_to_pb(s) for s in view.masters], leader=view.leader,
            epoch=view.epoch, blob_count=view.blob_count, under_replicated=view.under_replicated,
            zookeeper_unreachable=view.zookeeper_unreachable,
        )

    @unary
    def NodeStatus(self, request: pb.NodeStatusRequest, context: grpc.ServicerContext
                   ) -> pb.MasterSummary:
        return master_to_pb(self.master.node_status())
