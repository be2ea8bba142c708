"""The server interceptor on an in-process gRPC server: request ids, per-call metrics, and
requests that do not parse."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blobha.core import logs
from blobha.core.errors import SERVER_FULL_DETAILS, InvalidArgument, NotLeader
from blobha.master.edge.metrics import MasterMetrics
from blobha.master.edge.service import new_server, streaming, unary
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc


class Servicer(pb_grpc.BlobStoreServicer):
    master = SimpleNamespace(identity="test:1")

    @unary
    def GetMeta(self, request: pb.GetMetaRequest, context: grpc.ServicerContext) -> pb.BlobMeta:
        if request.key == "bad":
            raise InvalidArgument("bad key")
        # The handler runs with the call's request id current (log lines carry it).
        return pb.BlobMeta(key=request.key, creator=logs.current_request_id())

    @unary
    def SetMeta(self, request: pb.SetMetaRequest, context: grpc.ServicerContext) -> pb.BlobMeta:
        raise NotLeader("not me", "leader:1")

    @unary
    def AppendUpload(self, request_iterator: Iterator[pb.UploadChunk],
                     context: grpc.ServicerContext) -> pb.UploadStatus:
        return pb.UploadStatus(received=sum(len(c.data) for c in request_iterator))

    @streaming
    def Download(self, request: pb.DownloadRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.DownloadChunk]:
        for _ in range(3):
            yield pb.DownloadChunk(data=b"x" * 1000)


@pytest.fixture
def server() -> Iterator[tuple[Any, grpc.Channel, MasterMetrics]]:
    metrics = MasterMetrics()
    srv = new_server(metrics=metrics.rpc)
    pb_grpc.add_BlobStoreServicer_to_server(Servicer(), srv)  # type: ignore[no-untyped-call]
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.BlobStoreStub(channel), channel, metrics  # type: ignore[no-untyped-call]
    finally:
        channel.close()
        srv.stop(0)


def value(metrics: MasterMetrics, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total += s.value
    return total


def test_request_id_is_taken_current_and_returned(server: Any) -> None:
    stub, _, _ = server
    reply, call = stub.GetMeta.with_call(pb.GetMetaRequest(key="k"),
                                         metadata=(("x-request-id", "abc-1"),))
    assert reply.creator == "abc-1"
    assert ("x-request-id", "abc-1") in call.trailing_metadata()
    reply, call = stub.GetMeta.with_call(pb.GetMetaRequest(key="k"))
    generated = dict(call.trailing_metadata())["x-request-id"]
    assert len(generated) == 16 and reply.creator == generated
    assert logs.current_request_id() == logs.NO_REQUEST


def test_errors_keep_their_trailers_and_get_the_request_id(server: Any) -> None:
    stub, _, metrics = server
    with pytest.raises(grpc.RpcError) as e:
        stub.SetMeta(pb.SetMetaRequest(key="k"), metadata=(("x-request-id", "r2"),))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    trailers = dict(e.value.trailing_metadata())
    assert trailers == {"x-blobha-leader": "leader:1", "x-request-id": "r2"}
    with pytest.raises(grpc.RpcError) as e:
        stub.GetMeta(pb.GetMetaRequest(key="bad"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert value(metrics, "grpc_server_handled_total", grpc_method="SetMeta",
                 grpc_code="FAILED_PRECONDITION") == 1
    assert value(metrics, "grpc_server_handled_total", grpc_method="GetMeta",
                 grpc_code="INVALID_ARGUMENT") == 1
    assert value(metrics, "grpc_server_handling_seconds_count", grpc_method="GetMeta") == 1


def test_streams_are_counted_in_messages_bytes(server: Any) -> None:
    stub, _, metrics = server
    chunks = [pb.UploadChunk(upload_id="u", data=b"y" * 500) for _ in range(4)]
    assert stub.AppendUpload(iter(chunks)).received == 2000
    assert value(metrics, "blobha_rpc_received_bytes_total",
                 grpc_method="AppendUpload") == sum(c.ByteSize() for c in chunks)
    got = list(stub.Download(pb.DownloadRequest(key="k")))
    assert value(metrics, "blobha_rpc_sent_bytes_total",
                 grpc_method="Download") == sum(c.ByteSize() for c in got)
    assert value(metrics, "grpc_server_handled_total", grpc_method="Download",
                 grpc_code="OK") == 1
    assert value(metrics, "grpc_server_started_total", grpc_service="blobha.v1.BlobStore") == 2


def test_requests_that_do_not_parse_are_invalid_argument(server: Any) -> None:
    _, channel, metrics = server
    bad_utf8 = b"\x0a\x01\xff"  # field 1 (a string) holding an invalid UTF-8 byte
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary("/blobha.v1.BlobStore/GetMeta")(bad_utf8)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid GetMeta message" in (e.value.details() or "")
    assert dict(e.value.trailing_metadata())["x-request-id"]
    with pytest.raises(grpc.RpcError) as e:
        channel.stream_unary("/blobha.v1.BlobStore/AppendUpload")(iter([bad_utf8]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_stream("/blobha.v1.BlobStore/Download")(b"\xff\xff\xff").next()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Unknown methods are not counted: callers cannot invent label values.
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary("/blobha.v1.BlobStore/Invented")(b"")
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Invented" not in metrics.render().decode()


def test_a_call_that_finds_every_thread_taken_is_refused_at_once_and_not_counted() -> None:
    # Queued, it would wait unseen (a status check too); refused, the client knows the master
    # is busy and retries. The refusal comes before any handler, so it counts as neither
    # started nor handled: "started - handled" stays the calls in progress.
    release = threading.Event()
    entered = threading.Semaphore(0)

    class Blocking(Servicer):
        @unary
        def NodeStatus(self, request: pb.NodeStatusRequest, context: grpc.ServicerContext
                       ) -> pb.MasterSummary:
            entered.release()
            release.wait(30)
            return pb.MasterSummary(address="test:1")

    metrics = MasterMetrics()
    srv = new_server(metrics=metrics.rpc, threads=2)
    pb_grpc.add_BlobStoreServicer_to_server(Blocking(), srv)  # type: ignore[no-untyped-call]
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.BlobStoreStub(channel)  # type: ignore[no-untyped-call]
    try:
        held = [stub.NodeStatus.future(pb.NodeStatusRequest(), timeout=30) for _ in range(2)]
        for _ in held:
            assert entered.acquire(timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetMeta(pb.GetMetaRequest(key="k"), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == SERVER_FULL_DETAILS
        release.set()
        assert [f.result().address for f in held] == ["test:1", "test:1"]
        assert stub.GetMeta(pb.GetMetaRequest(key="k"), timeout=10).key == "k"
        for method, calls in (("NodeStatus", 2), ("GetMeta", 1)):
            assert value(metrics, "grpc_server_started_total", grpc_method=method) == calls
            assert value(metrics, "grpc_server_handled_total", grpc_method=method) == calls
    finally:
        release.set()
        channel.close()
        srv.stop(0)
