"""The fake cluster behind blobha.client's Transport interface and the fake clock the client
unit tests (tests/unit/client) drive it with: no sockets, no sleeping."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any

import grpc

from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    BlobError,
    DeadlineExceeded,
    KeyAlreadyExists,
    KeyNotFound,
    NotLeader,
    Unavailable,
    upload_not_found,
)
from blobha.v1 import blobha_pb2 as pb

KiB = 1024


M1, M2, M3 = "m1:1", "m2:2", "m3:3"


class FakeCluster:
    """Three masters in memory with the protocol's leader/replica rules, plus fault hooks."""

    def __init__(self, leader: str = M1) -> None:
        self.masters = [M1, M2, M3]
        self.leader = leader
        self.blobs: dict[str, tuple[int, bytes]] = {}
        self.holders: dict[str, list[str]] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.down: set[str] = set()
        self.faults: list[tuple[str, str, BlobError]] = []
        self.calls: list[tuple[str, str]] = []
        self.append_break_after: int | None = None  # chunks accepted before the stream breaks
        self.download_break_after: int | None = None
        #: Every Download sends this many chunks, then stalls: ``stall_clock`` moves on by
        #: ``stall_secs`` and the call fails as the transport's stall watch fails it.
        self.download_stall_after: int | None = None
        #: The next Download sends this many chunks, then its deadline passes.
        self.download_deadline_after: int | None = None
        self.stall_clock: FakeClock | None = None
        self.stall_secs = 0.0
        self.stall_limits: list[float | None] = []
        self.commit_then_fail = False
        #: Keys whose committed version is not acknowledged (its leader failed before quorum).
        self.unacknowledged: set[str] = set()
        self.corrupt: set[str] = set()  # masters that serve flipped bytes without noticing
        self.failover_on_break: str | None = None
        self.closed = False
        self._next_id = 0

    # -- Transport ----------------------------------------------------------------------------

    def _enter(self, address: str, method: str) -> None:
        self.calls.append((address, method))
        if address in self.down:
            raise Unavailable(f"master {address} unavailable: connection refused")
        for i, (where, name, error) in enumerate(self.faults):
            if name == method and where in ("*", address):
                del self.faults[i]
                raise error

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        assert timeout is None or timeout > 0
        self._enter(address, method)
        return getattr(self, "_" + method)(address, request)

    def client_stream(
        self, address: str, method: str, requests: Iterator[Any], timeout: float | None,
        stall: float | None = None, rivals: Any = (),
    ) -> Any:
        self._enter(address, method)
        return self._append(address, requests)

    def server_stream(
        self, address: str, method: str, request: Any, timeout: float | None,
        stall: float | None = None,
    ) -> Iterator[Any]:
        self._enter(address, method)
        self.stall_limits.append(stall)
        return self._download(address, request)

    def data_host(self, address: str) -> str | None:
        return None  # every download streams (the data channel has tests of its own)

    def data_tls(self) -> None:
        return None

    def probe(
        self, addresses: Sequence[str], method: str, request: Any, timeout: float
    ) -> Generator[tuple[str, Any], None, None]:
        for address in addresses:
            try:
                yield address, self.unary(address, method, request, timeout)
            except BlobError as exc:
                yield address, exc

    def close(self) -> None:
        self.closed = True

    # -- helpers ------------------------------------------------------------------------------

    def count(self, method: str, address: str | None = None) -> int:
        return sum(1 for a, m in self.calls if m == method and address in (None, a))

    def fail_over(self, new_leader: str) -> None:
        old, self.leader = self.leader, new_leader
        self.uploads = {k: u for k, u in self.uploads.items() if u["leader"] != old}

    def _leader_only(self, address: str) -> None:
        if address != self.leader:
            raise NotLeader(f"{address} is not the leader", self.leader)

    def _upload(self, address: str, upload_id: str) -> dict[str, Any]:
        up = self.uploads.get(upload_id)
        if up is None or up["leader"] != address:
            raise upload_not_found(upload_id)
        return up

    def _meta(self, key: str) -> pb.BlobMeta:
        if key not in self.blobs:
            raise KeyNotFound(f"no blob with key {key!r}")
        version, data = self.blobs[key]
        return pb.BlobMeta(key=key, version=version, size=len(data), digest=digest_bytes(data),
                           acknowledged=key not in self.unacknowledged)

    # -- methods ------------------------------------------------------------------------------

    def _ClusterSummary(self, address: str, request: Any) -> pb.ClusterSummaryResponse:
        return pb.ClusterSummaryResponse(
            masters=[pb.MasterSummary(address=m, reachable=True) for m in self.masters],
            leader=self.leader,
        )

    def _BeginUpload(self, address: str, r: pb.BeginUploadRequest) -> pb.BeginUploadResponse:
        self._leader_only(address)
        if r.create and r.key in self.blobs:
            raise KeyAlreadyExists(f"key {r.key!r} already exists")
        if not r.create and r.key not in self.blobs:
            raise KeyNotFound(f"no blob with key {r.key!r}")
        self._next_id += 1
        upload_id = f"up{self._next_id}"
        self.uploads[upload_id] = {"leader": address, "key": r.key, "data": bytearray()}
        return pb.BeginUploadResponse(upload_id=upload_id)

    def _append(self, address: str, chunks: Iterator[Any]) -> pb.UploadStatus:
        up: dict[str, Any] | None = None
        for n, chunk in enumerate(chunks):
            if self.append_break_after is not None and n >= self.append_break_after:
                self.append_break_after = None
                if self.failover_on_break:
                    self.fail_over(self.failover_on_break)
                raise Unavailable(f"master {address} unavailable: connection reset")
            up = self._upload(address, chunk.upload_id)
            data: bytearray = up["data"]
            assert chunk.offset <= len(data), "a gap"
            data[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
        assert up is not None, "empty append stream"
        return pb.UploadStatus(received=len(up["data"]))

    def _GetUploadStatus(self, address: str, r: pb.UploadStatusRequest) -> pb.UploadStatus:
        return pb.UploadStatus(received=len(self._upload(address, r.upload_id)["data"]))

    def _CommitUpload(self, address: str, r: pb.CommitUploadRequest) -> pb.BlobMeta:
        self._leader_only(address)
        up = self._upload(address, r.upload_id)
        data = bytes(up["data"])
        assert r.size == len(data) and r.digest == digest_bytes(data)
        del self.uploads[r.upload_id]
        version = self.blobs.get(up["key"], (0, b""))[0] + 1
        self.blobs[up["key"]] = (version, data)
        self.holders[up["key"]] = [address]
        if self.commit_then_fail:
            self.commit_then_fail = False
            raise Unavailable(f"master {address} unavailable: connection reset")
        return self._meta(up["key"])

    def _Put(self, address: str, r: pb.PutRequest) -> pb.BlobMeta:
        # The three steps at once, with the same rules and fault hooks as the resumable upload.
        upload_id = self._BeginUpload(address, r.begin).upload_id
        self.uploads[upload_id]["data"] = bytearray(r.data)
        return self._CommitUpload(
            address, pb.CommitUploadRequest(upload_id=upload_id, size=len(r.data), digest=r.digest)
        )

    def _AbortUpload(self, address: str, r: pb.AbortUploadRequest) -> pb.AbortUploadResponse:
        self.uploads.pop(r.upload_id, None)
        return pb.AbortUploadResponse()

    def _GetMeta(self, address: str, r: pb.GetMetaRequest) -> pb.BlobMeta:
        return self._meta(r.key)

    def _Delete(self, address: str, r: pb.DeleteRequest) -> pb.DeleteResponse:
        self._leader_only(address)
        self._meta(r.key)
        del self.blobs[r.key]
        return pb.DeleteResponse()

    def _List(self, address: str, r: pb.ListRequest) -> pb.ListResponse:
        keys = sorted(k for k in self.blobs if k.startswith(r.prefix) and k > r.page_token)
        size = min(r.page_size, 2)  # pages of two at most, to make several
        page = keys[:size]
        token = page[-1] if len(keys) > size else ""
        return pb.ListResponse(keys=page, next_page_token=token)

    def _GetReplication(self, address: str, r: pb.GetReplicationRequest) -> pb.ReplicationStatus:
        meta = self._meta(r.key)
        holders = self.holders.get(r.key, [])
        return pb.ReplicationStatus(
            key=r.key, version=meta.version, replication=len(holders), holders=holders
        )

    def _WaitForReplication(
        self, address: str, r: pb.WaitForReplicationRequest
    ) -> pb.WaitForReplicationResponse:
        statuses = [self._GetReplication(address, pb.GetReplicationRequest(key=k)) for k in r.keys]
        reached = all(s.replication >= r.min_replication for s in statuses)
        return pb.WaitForReplicationResponse(reached=reached, status=statuses)

    def _download(self, address: str, r: pb.DownloadRequest) -> Iterator[pb.DownloadChunk]:
        meta = self._meta(r.key)
        version = r.version or meta.version
        if address not in self.holders.get(r.key, []) or version != meta.version:
            raise KeyNotFound(f"not held here: {address} does not hold v{version} of {r.key!r}")
        data = self.blobs[r.key][1]
        if address in self.corrupt:
            data = bytes(b ^ 1 for b in data)
        end = len(data) if not r.length else min(len(data), r.offset + r.length)
        info = pb.BlobInfo(version=version, size=len(data), digest=meta.digest)
        sent = 0
        pos = r.offset
        first = True
        while first or pos < end:
            if self.download_break_after is not None and sent >= self.download_break_after:
                self.download_break_after = None
                raise Unavailable(f"master {address} unavailable: connection reset")
            if self.download_deadline_after is not None and sent >= self.download_deadline_after:
                self.download_deadline_after = None
                raise DeadlineExceeded(f"master {address} did not answer in time")
            if self.download_stall_after is not None and sent >= self.download_stall_after:
                assert self.stall_clock is not None
                self.stall_clock.now += self.stall_secs
                raise Unavailable(f"master {address} sent nothing for {self.stall_secs:g} s")
            piece = data[pos : min(end, pos + 256 * KiB)]
            yield pb.DownloadChunk(info=info, data=piece) if first else pb.DownloadChunk(data=piece)
            first = False
            pos += len(piece)
            sent += 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        assert secs >= 0
        self.sleeps.append(secs)
        self.now += secs


def payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


class _Status(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What gRPC raises for a call that ended with a status."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailers: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers
