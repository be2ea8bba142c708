"""Unit tests of blobha.client: pure helpers, and the retry/redirect/resume logic driven through
an in-memory fake :class:`~blobha.client.Transport` (no sockets, no sleeping)."""

from __future__ import annotations

import getpass
import io
import re
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import grpc
import pytest

from blobha import client as client_mod
from blobha.client import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    BlobInfo,
    BlobMeta,
    Client,
    ClusterSummary,
    MasterSummary,
    ReplicationStatus,
    WaitResult,
    backoff_delay,
    parse_cluster,
)
from blobha.client import arguments as arguments_mod
from blobha.client import download as download_mod
from blobha.client import retry as retry_mod
from blobha.client import routing as routing_mod
from blobha.client import sources as sources_mod
from blobha.client import transport as transport_mod
from blobha.client import upload as upload_mod
from blobha.client import waiting as waiting_mod
from blobha.core.acl import AccessControl
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
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
    Refused,
    ResourceExhausted,
    TlsMismatch,
    Unauthenticated,
    Unavailable,
    UploadNotFound,
    upload_not_found,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.wire import convert
from blobha.wire.convert import replication_from_pb

KiB = 1024

# ------------------------------------------------------------------------------------------------
# Pure helpers
# ------------------------------------------------------------------------------------------------


class TestParseCluster:
    def test_comma_separated_with_spaces_and_duplicates(self) -> None:
        assert parse_cluster(" a:1, b:2 ,a:1,") == ("a:1", "b:2")

    def test_list_and_default_port(self) -> None:
        assert parse_cluster(["m1", "m2:7000,m3"]) == ("m1:6627", "m2:7000", "m3:6627")

    def test_ipv6_in_brackets(self) -> None:
        assert parse_cluster("[::1]:7000,[fe80::1]") == ("[::1]:7000", "[fe80::1]:6627")

    @pytest.mark.parametrize(
        "text", ["", " , ", "h:0", "h:70000", "h:x", ":80", "::1", "[::1", "[]:80", "a b:1"]
    )
    def test_rejects(self, text: str) -> None:
        with pytest.raises(InvalidArgument):
            parse_cluster(text)


class TestBackoff:
    @pytest.mark.parametrize("attempt", range(12))
    def test_within_full_jitter_bounds(self, attempt: int) -> None:
        ceiling = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)
        for _ in range(50):
            assert 0.0 <= backoff_delay(attempt) <= ceiling

    def test_extremes(self) -> None:
        assert backoff_delay(0, rand=lambda: 0.0) == 0.0
        assert backoff_delay(0, rand=lambda: 1.0) == pytest.approx(BACKOFF_BASE)
        assert backoff_delay(3, rand=lambda: 1.0) == pytest.approx(BACKOFF_BASE * 8)
        assert backoff_delay(100_000, rand=lambda: 1.0) == BACKOFF_CAP  # no overflow
        assert backoff_delay(-5, rand=lambda: 1.0) == pytest.approx(BACKOFF_BASE)

    def test_custom_base_and_cap(self) -> None:
        assert backoff_delay(10, base=1.0, cap=5.0, rand=lambda: 0.5) == 2.5


class TestDeadline:
    def test_remaining_expiry_and_restart(self) -> None:
        now = [100.0]
        d = retry_mod.Deadline(10.0, clock=lambda: now[0])
        assert d.remaining() == 10.0
        now[0] = 108.0
        assert d.remaining() == pytest.approx(2.0)
        now[0] = 111.0
        assert d.remaining() == 0.0 and d.expired()
        d.restart()
        assert d.remaining() == 10.0


class TestUserAndOptions:
    def test_user_from_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BLOBHA_USER", "carol")
        assert client_mod.default_user() == "carol"
        assert Client("h:1", transport=FakeCluster()).user == "carol"

    def test_explicit_user_wins(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BLOBHA_USER", "carol")
        assert Client("h:1", user="dave", transport=FakeCluster()).user == "dave"

    def test_os_user_fallback(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("BLOBHA_USER", raising=False)
        monkeypatch.setattr(getpass, "getuser", lambda: "osuser")
        assert client_mod.default_user() == "osuser"

    @pytest.mark.parametrize("user", ["", " bob", "bob\n", "zoé"])
    def test_bad_user(self, user: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BLOBHA_USER", "x")
        with pytest.raises(InvalidArgument):
            arguments_mod.check_user(user)

    @pytest.mark.parametrize(
        ("user", "problem"),
        [
            ("carol,x", "must not contain ':' or ','"),
            ("a:b", "must not contain ':' or ','"),
            ("x" * 257, "must be 1-256 characters"),
            ("tab\tname", "must not contain control characters"),
        ],
    )
    def test_user_names_follow_the_masters_rules(self, user: str, problem: str) -> None:
        # The masters refuse these names (they would break an ACL's text form): the client
        # says why before making any call.
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            Client("h:1", user=user, transport=FakeCluster())

    @pytest.mark.parametrize("size", [1, 256 * KiB - 1, 1024 * KiB + 1])
    def test_chunk_size_bounds(self, size: int) -> None:
        with pytest.raises(InvalidArgument):
            Client("h:1", user="u", chunk_size=size, transport=FakeCluster())

    def test_timeout_must_be_positive(self) -> None:
        with pytest.raises(InvalidArgument):
            Client("h:1", user="u", timeout=0, transport=FakeCluster())

    def test_acl_forms(self) -> None:
        entries = [AccessControl("u", "a", 7)]
        assert arguments_mod.normalize_acl(None) == []
        assert arguments_mod.normalize_acl("u:a:rwa") == entries
        assert arguments_mod.normalize_acl(entries) == entries
        with pytest.raises(InvalidArgument):
            arguments_mod.normalize_acl("u:a:rwa,u:a:r")
        with pytest.raises(InvalidArgument):
            arguments_mod.normalize_acl(["u:a:rwa"])  # type: ignore[list-item]

    @pytest.mark.parametrize(
        ("entry", "problem"),
        [
            (AccessControl("u", "carol,x", 1), "must not contain ':' or ','"),
            (AccessControl("u", "a:b", 1), "must not contain ':' or ','"),
            (AccessControl("u", " bob", 1), "must not start or end with spaces"),
            (AccessControl("u", "", 1), "must be 1-256 characters"),
            (AccessControl("u", "bob", 8), "bad ACL access 8"),
            (AccessControl("x", "bob", 1), "bad ACL entry type 'x'"),
            (AccessControl("o", "bob", 1), "takes no name"),
        ],
    )
    def test_acl_values_follow_the_string_rules(
        self, entry: AccessControl, problem: str, cluster: FakeCluster
    ) -> None:
        # Entries built in code skip the parser; they are refused locally all the same, before
        # any call (a ',' or ':' in a stored name would make the key's ACL unreadable).
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            arguments_mod.normalize_acl([entry])
        c = Client("h:1", user="alice", transport=cluster)
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            c.create("k", b"x", acl=[entry])
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            c.set_acl("k", [entry])
        assert cluster.calls == []


    @pytest.mark.parametrize(("factor", "problem"), [
        (0, "whole number from 1 to 4294967295, not 0"),
        (-3, "whole number from 1 to 4294967295, not -3"),
        (2.5, "whole number from 1 to 4294967295, not 2.5"),
        (2**32, "whole number from 1 to 4294967295, not 4294967296"),
    ])
    def test_a_replication_factor_the_wire_cannot_carry_is_refused_before_any_call(
        self, factor: Any, problem: str, cluster: FakeCluster
    ) -> None:
        c = Client("h:1", user="alice", transport=cluster)
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            c.set_replication_factor("k", factor)
        assert cluster.calls == []


class TestConversions:
    def test_meta(self) -> None:
        m = pb.BlobMeta(
            key="k",
            version=3,
            size=10,
            digest="d" * 32,
            acl=[pb.AccessControl(type="u", name="alice", access=7), pb.AccessControl(type="o")],
            replication_factor=2,
            meta_version=5,
            created_at=1.5,
            updated_at=2.5,
            creator="alice",
            replication=2,
            acknowledged=True,
            access=3,
        )
        meta = convert.meta_from_pb(m)
        assert meta == BlobMeta(
            key="k",
            version=3,
            size=10,
            digest="d" * 32,
            acl=(AccessControl("u", "alice", 7), AccessControl("o", "", 0)),
            replication_factor=2,
            meta_version=5,
            created_at=1.5,
            updated_at=2.5,
            creator="alice",
            replication=2,
            access=3,
        )
        assert meta.readable
        with pytest.raises(AttributeError):
            meta.version = 4  # type: ignore[misc]
        # Without READ, the metadata only; a master that does not say answered readers alone.
        assert not convert.meta_from_pb(pb.BlobMeta(key="k", access=6)).readable
        assert convert.meta_from_pb(pb.BlobMeta(key="k")).readable

    def test_acl_round_trip(self) -> None:
        acl = [AccessControl("u", "bob", 3), AccessControl("o", "", 1)]
        assert list(convert.acl_from_pb(convert.acl_to_pb(acl))) == acl

    def test_info_replication_wait(self) -> None:
        assert convert.info_from_pb(pb.BlobInfo(version=2, size=5, digest="x")) == BlobInfo(
            2, 5, "x"
        )
        status = pb.ReplicationStatus(
            key="k", version=2, replication=1, replication_factor=3, holders=["a:1"]
        )
        expected = ReplicationStatus("k", 2, 1, 3, ("a:1",))
        assert replication_from_pb(status) == expected
        wait = pb.WaitForReplicationResponse(reached=True, status=[status], waited_secs=1.25)
        assert convert.wait_result_from_pb(wait) == WaitResult(True, (expected,), 1.25)

    def test_cluster_summary(self) -> None:
        s = pb.ClusterSummaryResponse(
            masters=[
                pb.MasterSummary(
                    address="a:1",
                    is_leader=True,
                    uptime_secs=9.0,
                    version="0.1",
                    blob_count=4,
                    bytes_stored=100,
                    disk_free=1000,
                    lag_blobs=1,
                    reachable=True,
                    epoch=7,
                )
            ],
            leader="a:1",
            epoch=7,
            blob_count=4,
            under_replicated=1,
        )
        assert convert.summary_from_pb(s) == ClusterSummary(
            masters=(MasterSummary("a:1", True, 9.0, "0.1", 4, 100, 1000, 1, True, 7),),
            leader="a:1",
            epoch=7,
            blob_count=4,
            under_replicated=1,
        )


class TestSources:
    def test_stream_source_replays_until_acknowledged(self) -> None:
        src = sources_mod.StreamSource(io.BufferedReader(io.BytesIO(b"abcdefghij")))
        assert src.read_at(0, 4) == b"abcd"
        assert src.read_at(4, 4) == b"efgh"
        assert src.read_at(2, 4) == b"cdef"  # a resend after a broken stream
        assert src.can_restart()
        src.ack(6)
        assert not src.can_restart()
        assert src.read_at(6, 100) == b"ghij"
        assert src.read_at(10, 4) == b""
        with pytest.raises(BlobError):
            src.read_at(0, 1)

    def test_file_source_is_relative_to_start(self, tmp_path: Path) -> None:
        path = tmp_path / "f"
        path.write_bytes(b"0123456789")
        with path.open("rb") as f:
            f.seek(3)
            src = sources_mod.open_source(f)
            assert src.size == 7
            assert src.read_at(0, 3) == b"345"
            assert src.can_restart()

    def test_rejects_other_types(self) -> None:
        with pytest.raises(InvalidArgument):
            sources_mod.open_source(12)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# A fake cluster behind the Transport interface
# ------------------------------------------------------------------------------------------------

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


@pytest.fixture
def resumable_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every upload takes the resumable path (begin, append, commit), however small."""
    monkeypatch.setattr(upload_mod, "_PUT_MAX_BYTES", -1)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(retry_mod, "_monotonic", fake)
    return fake


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def client(cluster: FakeCluster, clock: FakeClock) -> Iterator[Client]:
    c = Client([M1, M2, M3], user="alice", timeout=30.0, chunk_size=256 * KiB, transport=cluster)
    c._router.sleep = clock.sleep
    with c:
        yield c
    assert cluster.closed


def payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


# ------------------------------------------------------------------------------------------------
# Writes
# ------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("resumable_only")
def test_create_discovers_the_leader_and_uploads(client: Client, cluster: FakeCluster) -> None:
    data = payload(600 * KiB)
    meta = client.create("k", data)
    assert meta.version == 1 and meta.size == len(data) and meta.digest == digest_bytes(data)
    assert cluster.blobs["k"] == (1, data)
    assert cluster.count("BeginUpload") == 1 and cluster.count("BeginUpload", M1) == 1


def test_create_empty_blob(client: Client, cluster: FakeCluster) -> None:
    assert client.create("empty", b"").size == 0
    assert cluster.count("AppendUpload") == 0
    assert client.read("empty") == b""


def _acknowledge_when_answered(cluster: FakeCluster, method: str, key: str) -> None:
    """Make the commits of ``method`` acknowledge ``key``, except one whose answer is lost
    (``commit_then_fail``): that version stays committed but unacknowledged."""
    original = getattr(cluster, method)

    def commit(address: str, r: Any) -> pb.BlobMeta:
        failing = cluster.commit_then_fail
        try:
            result: pb.BlobMeta = original(address, r)
            return result
        finally:
            if not failing:
                cluster.unacknowledged.discard(key)
    setattr(cluster, method, commit)


def test_a_small_blob_goes_in_one_put_and_a_large_one_resumably(
    client: Client, cluster: FakeCluster
) -> None:
    small = payload(client_mod.PUT_MAX_BYTES)
    meta = client.create("small", small)
    assert meta.version == 1 and cluster.blobs["small"] == (1, small)
    assert cluster.count("Put") == 1 and cluster.count("BeginUpload") == 0
    large = payload(client_mod.PUT_MAX_BYTES + 1)
    client.create("large", large)
    assert cluster.blobs["large"] == (1, large)
    assert cluster.count("Put") == 1 and cluster.count("BeginUpload") == 1


def test_a_put_follows_the_leader_and_recognises_a_lost_answer(
    client: Client, cluster: FakeCluster
) -> None:
    client.create("k", b"old")  # caches M1 as leader
    cluster.leader = M2
    cluster.commit_then_fail = True
    meta = client.update("k", b"new content")
    # M1 redirected to M2; M2 committed but its answer was lost; the re-read found v2 ours.
    assert meta.version == 2 and cluster.blobs["k"] == (2, b"new content")
    assert [a for a, m in cluster.calls if m == "Put"] == [M1, M1, M2]


def test_an_unacknowledged_put_is_sent_again(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"old")
    cluster.commit_then_fail = True
    cluster.unacknowledged.add("k")
    _acknowledge_when_answered(cluster, "_Put", "k")
    meta = client.update("k", b"new content")
    # v2 was committed but never acknowledged: not ours to report; the put was made again.
    assert meta.version == 3 and cluster.blobs["k"] == (3, b"new content")
    assert cluster.count("Put") == 3


@pytest.mark.usefixtures("resumable_only")
def test_not_leader_redirects_to_named_leader(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    client.create("a", b"1")  # caches M1 as leader
    cluster.leader = M2
    meta = client.update("a", b"2")
    assert meta.version == 2
    assert cluster.count("BeginUpload", M1) == 2 and cluster.count("BeginUpload", M2) == 1
    assert len(clock.sleeps) == 1 and clock.sleeps[0] <= BACKOFF_BASE


@pytest.mark.usefixtures("resumable_only")
def test_a_leader_that_stops_answering_is_left_for_the_new_one(
    client: Client, cluster: FakeCluster
) -> None:
    # A paused or partitioned leader neither refuses nor answers: the begin times out after the
    # control-call limit (not the whole operation's deadline) and the client finds the new one.
    client.create("a", b"1")  # caches M1 as leader
    cluster.leader = M2
    cluster.faults.append((M1, "BeginUpload", DeadlineExceeded("master m1 did not answer")))
    meta = client.update("a", b"2")
    assert meta.version == 2 and cluster.blobs["a"] == (2, b"2")
    assert cluster.count("BeginUpload", M2) == 1


@pytest.mark.usefixtures("resumable_only")
def test_broken_stream_resumes_from_upload_status(client: Client, cluster: FakeCluster) -> None:
    data = payload(1000 * KiB)
    cluster.append_break_after = 2
    client.create("k", data)
    assert cluster.blobs["k"][1] == data
    assert cluster.count("BeginUpload") == 1  # resumed, not restarted
    assert cluster.count("GetUploadStatus") == 1


@pytest.mark.usefixtures("resumable_only")
def test_leader_change_restarts_a_seekable_upload(
    client: Client, cluster: FakeCluster, tmp_path: Path
) -> None:
    path = tmp_path / "blob"
    data = payload(700 * KiB)
    path.write_bytes(data)
    cluster.append_break_after = 1
    cluster.failover_on_break = M3
    client.create("k", path)
    assert cluster.blobs["k"][1] == data
    assert cluster.count("BeginUpload", M1) == 1 and cluster.count("BeginUpload", M3) == 1


class _Pipe(io.RawIOBase):
    """A non-seekable stream, like stdin or a pipe."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, b: Any) -> int:
        data = self._data.read(len(b))
        b[: len(data)] = data
        return len(data)


def test_leader_change_with_consumed_stream_fails_clearly(
    client: Client, cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload_mod, "_UPLOAD_SEGMENT_BYTES", 256 * KiB)
    original = cluster._append

    def fail_over_after_first_segment(address: str, chunks: Iterator[Any]) -> Any:
        status = original(address, chunks)
        cluster.fail_over(M2)  # the acknowledged segment is gone with the old leader
        return status

    monkeypatch.setattr(cluster, "_append", fail_over_after_first_segment)
    with pytest.raises(UploadNotFound, match="cannot be read again"):
        client.create("k", cast(BinaryIO, _Pipe(payload(600 * KiB))))
    assert "k" not in cluster.blobs


def test_small_stream_restarts_after_leader_change(client: Client, cluster: FakeCluster) -> None:
    data = payload(300 * KiB)
    cluster.append_break_after = 1
    cluster.failover_on_break = M2
    client.create("k", cast(BinaryIO, _Pipe(data)))
    assert cluster.blobs["k"][1] == data
    assert cluster.count("BeginUpload", M2) == 1


@pytest.mark.usefixtures("resumable_only")
def test_commit_with_lost_answer_is_recognised(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"old")
    cluster.commit_then_fail = True
    meta = client.update("k", b"new content")
    assert meta.version == 2 and cluster.blobs["k"] == (2, b"new content")
    assert cluster.count("CommitUpload") == 2 and cluster.count("BeginUpload") == 2


@pytest.mark.usefixtures("resumable_only")
def test_a_committed_but_unacknowledged_version_is_not_taken_as_ours(
    client: Client, cluster: FakeCluster
) -> None:
    # The leader committed v2 and died before its write quorum: the next leader may roll v2
    # back, so the client must not report it written. It uploads again and gets an
    # acknowledged version.
    client.create("k", b"old")
    cluster.commit_then_fail = True
    cluster.unacknowledged.add("k")
    _acknowledge_when_answered(cluster, "_CommitUpload", "k")
    meta = client.update("k", b"new content")
    assert meta.version == 3 and cluster.blobs["k"] == (3, b"new content")
    # One create, then the update's lost commit and its re-upload: v2 was never reported.
    assert cluster.count("BeginUpload") == 3 and cluster.count("CommitUpload") == 3


@pytest.mark.usefixtures("resumable_only")
def test_create_commit_lost_then_exists_is_success(client: Client, cluster: FakeCluster) -> None:
    cluster.commit_then_fail = True
    # The meta checks see a lagging view twice, so the client begins again and is told the key
    # exists: with the digest matching, that is our own commit.
    cluster.faults.append(("*", "GetMeta", KeyNotFound("lagging")))
    cluster.faults.append(("*", "GetMeta", KeyNotFound("lagging")))
    meta = client.create("k", b"data")
    assert meta.version == 1 and cluster.count("BeginUpload") == 2


@pytest.mark.usefixtures("resumable_only")
def test_not_authorized_is_not_retried(client: Client, cluster: FakeCluster) -> None:
    from blobha.core.errors import NotAuthorized

    cluster.faults.append(("*", "BeginUpload", NotAuthorized("no")))
    with pytest.raises(NotAuthorized):
        client.create("k", b"x")
    assert cluster.count("BeginUpload") == 1


def _refusing(cluster: FakeCluster, error: BlobError, who: Sequence[str]) -> None:
    """Masters in ``who`` refuse every ClusterSummary (the leader search) with ``error``."""
    real = cluster._ClusterSummary

    def summary(address: str, request: Any) -> pb.ClusterSummaryResponse:
        if address in who:
            raise error
        return real(address, request)

    cluster._ClusterSummary = summary  # type: ignore[method-assign]


@pytest.mark.parametrize("path", ["put", "resumable"])
@pytest.mark.parametrize(
    "error",
    [
        Unauthenticated("no token given; this cluster requires one"),
        Unauthenticated("the token was refused"),
        NotAuthorized("user 'mallory' may not do that"),
        InvalidArgument("bad request"),
    ],
)
def test_a_write_refused_by_every_master_fails_at_once(
    client: Client, cluster: FakeCluster, clock: FakeClock, error: BlobError, path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A missing or wrong token is refused by the leader search itself: that is about the
    # caller, not the cluster, so it is reported as it is instead of retried until the
    # deadline and reported as "unavailable".
    if path == "resumable":
        monkeypatch.setattr(upload_mod, "_PUT_MAX_BYTES", -1)
    _refusing(cluster, error, [M1, M2, M3])
    with pytest.raises(type(error)) as info:
        client.create("k", b"x")
    assert info.value is error
    if isinstance(error, Unauthenticated):
        # A token added just now may not be loaded yet: asked again for a few seconds only.
        patience = routing_mod._REFUSAL_PATIENCE
        assert patience <= clock.now - 1000.0 < 2 * patience
        assert clock.sleeps and cluster.count("ClusterSummary") > 3
    else:
        assert clock.now == 1000.0 and clock.sleeps == []
        assert cluster.count("ClusterSummary") == 3
    assert cluster.count("Put") == cluster.count("BeginUpload") == 0


def test_a_token_refused_at_first_is_accepted_once_the_masters_load_it(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # The masters re-read their token files at most once a second: a brand-new token is
    # refused by all of them for a moment, then accepted.
    refusing = [M1, M2, M3]
    _refusing(cluster, Unauthenticated("the token was refused"), refusing)
    asked = cluster._ClusterSummary

    def loaded_after_a_second(address: str, request: Any) -> pb.ClusterSummaryResponse:
        if clock.now - 1000.0 >= 1.0:
            refusing.clear()
        return asked(address, request)

    cluster._ClusterSummary = loaded_after_a_second  # type: ignore[method-assign]
    client.create("k", b"x")
    assert cluster.blobs["k"] == (1, b"x")
    # Refused, asked again after a pause, accepted well within the patience.
    assert clock.sleeps and cluster.count("ClusterSummary") > 3
    assert clock.now - 1000.0 < routing_mod._REFUSAL_PATIENCE


def test_a_refusal_is_reported_before_other_masters_unavailability(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    cluster.down = {M1, M3}
    _refusing(cluster, Unauthenticated("the token was refused"), [M2])
    with pytest.raises(Unauthenticated, match="token was refused"):
        client.delete("k")
    assert clock.now - 1000.0 < 2 * routing_mod._REFUSAL_PATIENCE


_OTHER_CA = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1:"
             " Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA"
             " routines:OPENSSL_internal:BAD_SIGNATURE: certificate signature failure: OK")
_NOT_TLS = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls"
            " handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL"
            " routines:OPENSSL_internal:WRONG_VERSION_NUMBER")
_CLOSED = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1:"
           " Socket closed")
# The same close, when the client's first bytes had arrived before it (the kernel resets).
_RESET = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1:"
          " recvmsg:Connection reset by peer (104)")


@pytest.mark.parametrize(("details", "advice"), [
    (_OTHER_CA, "did not verify against the CA given in --ca"),
    (_NOT_TLS, "it does not use TLS; drop --ca"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom"
     " verification check failed with error: UNAUTHENTICATED: Hostname Verification Check"
     " failed.", "its certificate does not name the address dialled"),
])
def test_a_failed_tls_handshake_says_which_setting_to_change(details: str, advice: str) -> None:
    failure = transport_mod.handshake_failure("m1:1", details, True)
    assert isinstance(failure, transport_mod.HandshakeFailed)
    assert failure.addresses == {"m1:1"}
    assert advice in str(failure) and "m1:1" in str(failure) and details in str(failure)


@pytest.mark.parametrize("details", [_CLOSED, _RESET])
@pytest.mark.parametrize(("tls", "hint"), [
    (False, "if the masters use TLS, pass --ca"),
    (True, "if the masters ask for client certificates, pass --cert/--tls-key"),
])
def test_a_connection_closed_at_once_only_hints_at_tls(tls: bool, hint: str,
                                                       details: str) -> None:
    # What a TLS master does to a plain-text client, but also a proxy with no master behind
    # it: retried as unavailability, with the likely fix in the message.
    failure = transport_mod.handshake_failure("m1:1", details, tls)
    assert isinstance(failure, Unavailable)
    assert not isinstance(failure, transport_mod.HandshakeFailed)
    assert hint in str(failure)


@pytest.mark.parametrize("details", [
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection"
    " refused",
    "Socket closed",  # a connection that was up and went away: the master, not the settings
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Handshake"
    " read failed (Socket closed)",  # a TLS client behind a proxy with no master behind it
    "keepalive watchdog timeout",
])
def test_other_unavailability_is_not_taken_for_a_tls_mismatch(details: str) -> None:
    for tls in (False, True):
        failure = transport_mod.handshake_failure("m1:1", details, tls)
        assert not isinstance(failure, transport_mod.HandshakeFailed)
        if "Handshake read failed" in details:
            assert failure is None  # no hint either: nothing points at the client's settings


def _without_tls_agreement(cluster: FakeCluster, who: Sequence[str],
                           agreed_after: float | None = None,
                           clock: FakeClock | None = None) -> None:
    """Every call to a master in ``who`` fails its TLS handshake (until ``agreed_after``
    seconds of ``clock`` have passed, when given)."""
    real = cluster._enter

    def enter(address: str, method: str) -> None:
        agreed = (agreed_after is not None and clock is not None
                  and clock.now - 1000.0 >= agreed_after)
        if address in who and not agreed:
            cluster.calls.append((address, method))
            raise transport_mod.handshake_failure(address, _OTHER_CA, True) or AssertionError
        real(address, method)

    cluster._enter = enter  # type: ignore[method-assign]


@pytest.mark.parametrize("operation", ["put", "resumable", "get_meta", "read", "wait"])
def test_a_tls_mismatch_with_every_master_fails_soon_as_such(
    client: Client, cluster: FakeCluster, clock: FakeClock, operation: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The client's --ca (or certificate) does not match the masters': every call would fail
    # the same way until the timeout (30 s here). It is asked again for a few seconds only,
    # as certificates being replaced could explain it, and then reported for what it is.
    cluster.blobs["k"] = (1, b"x")
    cluster.holders["k"] = [M1, M2, M3]
    if operation == "resumable":
        monkeypatch.setattr(upload_mod, "_PUT_MAX_BYTES", -1)
    _without_tls_agreement(cluster, [M1, M2, M3])
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: client.create("new", b"y"),
        "resumable": lambda: client.create("new", b"y"),
        "get_meta": lambda: client.get_meta("k"),
        "read": lambda: client.read("k"),
        "wait": lambda: client.wait_for_replication(["k"], 3, timeout=20.0),
    }
    with pytest.raises(TlsMismatch, match="did not verify against the CA given in --ca") as info:
        calls[operation]()
    # Not a NotAuthorized: that says what the user may read, and callers act on it.
    assert not isinstance(info.value, NotAuthorized)
    waited = clock.now - 1000.0
    assert routing_mod._REFUSAL_PATIENCE <= waited < 2 * routing_mod._REFUSAL_PATIENCE
    assert "new" not in cluster.blobs


def test_a_certificate_replaced_within_the_patience_is_accepted(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    _without_tls_agreement(cluster, [M1, M2, M3], agreed_after=1.0, clock=clock)
    client.create("k", b"x")
    assert cluster.blobs["k"] == (1, b"x")
    assert clock.now - 1000.0 < routing_mod._REFUSAL_PATIENCE


def test_a_tls_mismatch_is_final_only_once_every_master_has_shown_it(
    client: Client, cluster: FakeCluster, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even with no patience at all, two masters of three failing the handshake is no proof:
    # the third is asked, and serves.
    monkeypatch.setattr(routing_mod, "_REFUSAL_PATIENCE", 0.0)
    cluster.blobs["k"] = (1, b"x")
    cluster.holders["k"] = [M1, M2, M3]
    _without_tls_agreement(cluster, [M1, M2])
    client._router._preferred = M1
    assert client.get_meta("k").version == 1
    assert [a for a, m in cluster.calls if m == "GetMeta"] == [M1, M2, M3]


def test_the_patience_runs_from_the_first_tls_mismatch_not_from_the_call(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # The cluster was unreachable for 5 s (past the patience), then every master fails the
    # handshake: that is given its own few seconds before it is final.
    _without_tls_agreement(cluster, [M1, M2, M3])
    mismatched = cluster._enter

    def enter(address: str, method: str) -> None:
        if clock.now - 1000.0 < 5.0:
            cluster.calls.append((address, method))
            raise Unavailable(f"master {address} unavailable: Connection refused")
        mismatched(address, method)

    cluster._enter = enter  # type: ignore[method-assign]
    with pytest.raises(TlsMismatch):
        client.get_meta("k")
    assert clock.now - 1000.0 >= 5.0 + routing_mod._REFUSAL_PATIENCE


def test_a_tls_mismatch_with_some_masters_only_is_retried_to_the_deadline(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # One master's certificate is wrong and the others are down: the cluster may come back,
    # so this is unavailability, reported at the deadline with the mismatch as its reason.
    cluster.down = {M2, M3}
    _without_tls_agreement(cluster, [M1])
    with pytest.raises(Unavailable) as info:
        client.create("k", b"x")
    assert not isinstance(info.value, NotAuthorized)
    assert clock.now - 1000.0 >= 30.0 - 5.0
    assert "did not verify against the CA" in str(info.value)


def test_a_leader_named_by_one_master_wins_over_anothers_refusal(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # One master has not reloaded the token file yet; the others know the caller.
    _refusing(cluster, Unauthenticated("the token was refused"), [M1])
    client.create("k", b"x")
    assert cluster.blobs["k"] == (1, b"x")


@pytest.mark.usefixtures("resumable_only")
def test_upload_aborted_on_fatal_error(client: Client, cluster: FakeCluster) -> None:
    from blobha.core.errors import ResourceExhausted

    cluster.faults.append(("*", "CommitUpload", ResourceExhausted("disk full")))
    with pytest.raises(ResourceExhausted):
        client.create("k", b"x")
    assert cluster.count("AbortUpload") == 1 and not cluster.uploads


def test_unreachable_cluster_gives_up_at_the_deadline(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    cluster.down = {M1, M2, M3}
    with pytest.raises(Unavailable, match="within 30 s"):
        client.create("k", b"x")
    assert 10 < len(clock.sleeps) < 200  # backed off, never a tight loop
    assert max(clock.sleeps) <= BACKOFF_CAP
    assert sum(clock.sleeps) <= 30.0


@pytest.mark.usefixtures("resumable_only")
def test_no_leader_yet_is_retried(client: Client, cluster: FakeCluster) -> None:
    cluster.leader = ""
    cluster.faults.append(("*", "ClusterSummary", Unavailable("starting")))
    calls = 0
    original = cluster._ClusterSummary

    def elect_later(address: str, request: Any) -> pb.ClusterSummaryResponse:
        nonlocal calls
        calls += 1
        if calls > 4:
            cluster.leader = M3
        return original(address, request)

    cluster._ClusterSummary = elect_later  # type: ignore[method-assign]
    client.create("k", b"x")
    assert cluster.count("BeginUpload", M3) == 1


def test_delete_retry_after_lost_answer(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"x")
    original = cluster._Delete

    def delete_then_fail(address: str, r: pb.DeleteRequest) -> pb.DeleteResponse:
        cluster._Delete = original  # type: ignore[method-assign]
        original(address, r)
        raise Unavailable("connection reset")

    cluster._Delete = delete_then_fail  # type: ignore[method-assign]
    client.delete("k")
    assert "k" not in cluster.blobs
    with pytest.raises(KeyNotFound):
        client.delete("k")


@pytest.mark.parametrize("refusal", [
    Busy("master m1:1 is busy: too many calls of user 'alice' at once"),
    Unavailable("master m1:1 unavailable: failed to connect to all addresses"),
], ids=["busy", "no-connection"])
def test_a_delete_refused_unsent_then_missing_is_not_reported_done(
        client: Client, cluster: FakeCluster, refusal: Unavailable) -> None:
    # The first attempt never ran, so "no such key" on the retry is the truth (someone else
    # deleted it meanwhile), not the sign of an earlier attempt's success.
    cluster.blobs["k"] = (1, b"x")
    original = cluster._Delete

    def refuse_once(address: str, r: pb.DeleteRequest) -> pb.DeleteResponse:
        cluster._Delete = original  # type: ignore[method-assign]
        del cluster.blobs["k"]  # by someone else
        raise refusal

    cluster._Delete = refuse_once  # type: ignore[method-assign]
    with pytest.raises(KeyNotFound):
        client.delete("k")


# ------------------------------------------------------------------------------------------------
# Reads
# ------------------------------------------------------------------------------------------------


def test_download_fails_over_and_resumes(client: Client, cluster: FakeCluster) -> None:
    data = payload(900 * KiB)
    client.create("k", data)
    cluster.holders["k"] = [M2, M3]
    cluster.download_break_after = 2
    assert client.read("k") == data
    # One replica broke after two chunks; the other served the rest from that offset. (A first
    # guess at M1, which holds nothing, is answered "not held here" and costs one call.)
    downloads = [a for a, m in cluster.calls if m == "Download"]
    served = [a for a in downloads if a != M1]
    assert len(served) == 2 and set(served) == {M2, M3} and len(downloads) <= 3


def test_a_download_that_keeps_moving_outlives_the_timeout(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Every replica sends two chunks and then stalls for 12 s of the client's 30 s. The
    # download still ends: each attempt moved it on, and only waiting without progress counts
    # against the timeout. It used to give up once the stalls added up to 30 s.
    data = payload(4 * 1024 * KiB)  # 16 chunks of 256 KiB
    client.create("k", data)
    cluster.holders["k"] = [M1, M2, M3]
    cluster.download_stall_after = 2
    cluster.stall_clock = clock
    cluster.stall_secs = 12.0
    assert client.read("k") == data
    assert clock.now - 1000.0 >= 84.0  # seven stalls: almost three times the timeout
    assert set(cluster.stall_limits) == {client_mod.STALL_TIMEOUT}


def test_a_download_that_never_moves_still_gives_up(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    client.create("k", payload(KiB))
    cluster.holders["k"] = [M1, M2, M3]
    cluster.download_stall_after = 0
    cluster.stall_clock = clock
    cluster.stall_secs = 5.0
    with pytest.raises(Unavailable, match="sent nothing for 5 s"):
        client.read("k")
    assert 30.0 <= clock.now - 1000.0 < 40.0


def test_a_segment_whose_deadline_passed_while_bytes_came_resumes(
    client: Client, cluster: FakeCluster
) -> None:
    # A slow link: the segment's deadline ends it midway, with bytes still arriving. Before,
    # the whole download failed with DeadlineExceeded.
    data = payload(1024 * KiB)
    client.create("k", data)
    cluster.holders["k"] = [M1, M2, M3]
    cluster.download_deadline_after = 2
    assert client.read("k") == data
    assert len([m for _, m in cluster.calls if m == "Download"]) == 2


def test_a_segment_whose_deadline_passed_with_nothing_received_fails(
    client: Client, cluster: FakeCluster
) -> None:
    client.create("k", payload(KiB))
    cluster.holders["k"] = [M1, M2, M3]
    cluster.download_deadline_after = 0
    with pytest.raises(DeadlineExceeded):
        client.read("k")


def test_an_upload_never_reads_its_source_twice_at_once(client: Client) -> None:
    # gRPC reads an upload segment on its own thread; after a call is given up, that thread
    # may still be in a read (of a slow pipe) when the next attempt reads.
    inside = threading.Event()
    release = threading.Event()
    overlaps = []

    class Slow(sources_mod.Source):
        size = -1
        busy = False

        def read_at(self, offset: int, n: int) -> bytes:
            overlaps.append(self.busy)
            self.busy = True
            inside.set()
            release.wait(5)
            self.busy = False
            return b"x" * min(n, 10 - offset) if offset < 10 else b""

        def ack(self, offset: int) -> None:
            pass

        def can_restart(self) -> bool:
            return True

    job = upload_mod.UploadJob(client._router, pb.BeginUploadRequest(key="k", create=True),
                               Slow(), 0, None)
    first = threading.Thread(target=job._read, args=(0,))
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=job._read, args=(0,))
    second.start()
    release.set()
    first.join(5)
    second.join(5)
    assert overlaps == [False, False] and job.hashed == 10


def test_the_stall_timeout_has_a_floor(cluster: FakeCluster) -> None:
    with pytest.raises(InvalidArgument, match=r"stall_timeout must be at least 0\.5 s"):
        Client([M1], user="alice", transport=cluster, stall_timeout=0.1)
    with Client([M1], user="alice", transport=cluster, stall_timeout=2.5) as c:
        c.create("k", b"abc")
        cluster.holders["k"] = [M1]
        assert c.read("k") == b"abc"
    assert cluster.stall_limits[-1] == 2.5


def test_a_read_goes_straight_to_a_master_and_asks_for_replicas_only_on_a_miss(
    client: Client, cluster: FakeCluster
) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M1, M2, M3]
    cluster.calls.clear()
    assert client.read("k") == b"abc"
    assert [m for _, m in cluster.calls] == ["Download"]
    cluster.holders["k"] = [M3]
    for _ in range(10):
        cluster.calls.clear()
        assert client.read("k") == b"abc"
        methods = [m for _, m in cluster.calls]
        assert methods in (["Download"], ["Download", "GetReplication", "Download"])
        assert cluster.calls[-1] == (M3, "Download")


def test_not_held_here_tries_another_master(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M3]  # but GetReplication reports none: every master is tried
    original = cluster._GetReplication

    def no_holders(address: str, r: pb.GetReplicationRequest) -> pb.ReplicationStatus:
        status = original(address, r)
        del status.holders[:]
        return status

    cluster._GetReplication = no_holders  # type: ignore[method-assign]
    assert client.read("k") == b"abc"


def test_a_read_whose_deadline_ends_in_a_replica_lookup_says_why_it_was_retrying(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Before: the last back-off left a sliver of the deadline, the replica lookup after it ran
    # into the deadline's end, and the read failed "did not answer in time" (a master that
    # answered every call) instead of saying that no reachable master holds the key's bytes.
    client.create("k", b"abc")
    cluster.holders["k"] = []  # its one holder is down: its replica node is gone
    original = cluster._GetReplication
    start = clock.now

    def into_the_end(address: str, r: pb.GetReplicationRequest) -> pb.ReplicationStatus:
        if 30.0 - (clock.now - start) <= routing_mod._CONTROL_TIMEOUT:
            clock.now = start + 30.0  # the call takes what is left of the read's deadline
            raise DeadlineExceeded(f"master {address} did not answer in time")
        return original(address, r)

    cluster._GetReplication = into_the_end  # type: ignore[method-assign]
    with pytest.raises(Unavailable) as e:
        client.read("k")
    assert str(e.value).startswith("could not download 'k' within 30 s: no reachable master")
    assert clock.now - start == 30.0


@pytest.mark.parametrize("failure", [
    ChecksumMismatch("chunk 0 corrupt on disk"),
    # INTERNAL (a disk error there) failed the whole read, two others holding the version.
    InternalError("internal error on that master"),
], ids=["corrupt", "internal"])
def test_a_failing_replica_is_skipped(client: Client, cluster: FakeCluster,
                                      failure: BlobError) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M1, M2, M3]
    cluster.faults.append((M1, "Download", failure))
    cluster.faults.append((M2, "Download", failure))
    assert client.read("k") == b"abc"


def test_digest_mismatch_keeps_no_file(
    client: Client, cluster: FakeCluster, tmp_path: Path
) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M2]
    cluster.corrupt = {M2}
    dest = tmp_path / "out"
    dest.write_bytes(b"previous")
    with pytest.raises(ChecksumMismatch):
        client.download("k", dest)
    assert dest.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_download_to_path_and_range(client: Client, cluster: FakeCluster, tmp_path: Path) -> None:
    data = payload(300 * KiB)
    client.create("k", data)
    dest = tmp_path / "out"
    seen: list[tuple[int, int]] = []
    info = client.download("k", dest, progress=lambda d, t: seen.append((d, t)))
    assert dest.read_bytes() == data and info == BlobInfo(1, len(data), digest_bytes(data))
    assert seen[-1] == (len(data), len(data))
    buf = io.BytesIO()
    client.download("k", buf, offset=10, length=5)
    assert buf.getvalue() == data[10:15]


def test_list_follows_pages(client: Client, cluster: FakeCluster) -> None:
    for k in ["a1", "a2", "a3", "b1", "a4"]:
        cluster.blobs[k] = (1, b"")
    assert list(client.list("a")) == ["a1", "a2", "a3", "a4"]
    assert list(client.list()) == ["a1", "a2", "a3", "a4", "b1"]
    # A caller wanting the first key only asks for one (`blobha list KEY`).
    assert list(client.list("a", page_size=1)) == ["a1", "a2", "a3", "a4"]
    with pytest.raises(InvalidArgument, match="page_size"):
        list(client.list(page_size=0))


def test_reads_move_to_another_master(client: Client, cluster: FakeCluster) -> None:
    cluster.blobs["k"] = (4, b"zz")
    cluster.down = {M1, M2}
    assert client.get_meta("k").version == 4


def test_wait_for_replication(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"x")
    assert client.wait_for_replication(["k"], 1, 5).reached
    result = client.wait_for_replication("k", 2, 5)
    assert not result.reached and result.statuses[0].replication == 1
    with pytest.raises(InvalidArgument):
        client.wait_for_replication([], 1, 5)


@pytest.mark.parametrize("secs", [0.0, 5.0, 45.0])
def test_a_wait_on_unreachable_masters_gives_up_at_its_own_timeout(
    client: Client, cluster: FakeCluster, clock: FakeClock, secs: float
) -> None:
    # "Give up after this long": not after the wait plus the client's own 30 s.
    cluster.down = {M1, M2, M3}
    with pytest.raises(Unavailable, match="unavailable"):
        client.wait_for_replication(["k"], 1, secs)
    assert clock.now - 1000.0 <= secs + waiting_mod.WAIT_GRACE
    assert cluster.count("WaitForReplication") > 1  # other masters were tried


def test_a_wait_on_a_silent_master_ends_within_its_grace(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # A paused master holds each call until its deadline; the last call's deadline is the
    # wait's own end plus the grace, not the server-side wait plus a longer allowance.
    calls: list[tuple[float, float]] = []

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        assert method == "WaitForReplication" and timeout is not None
        calls.append((request.timeout_secs, timeout))
        clock.now += timeout
        raise DeadlineExceeded(f"master {address} did not answer in time")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded):
        client.wait_for_replication(["k"], 1, 5)
    assert clock.now - 1000.0 <= 5 + waiting_mod.WAIT_GRACE
    # The call outlives the server-side wait by more than the half second the server keeps
    # for its answer, so a live master still reports its counts.
    assert calls[0] == (5.0, 5.0 + waiting_mod.WAIT_GRACE) and waiting_mod.WAIT_GRACE > 0.5


def test_wait_forever_loops_bounded_calls(
    client: Client, cluster: FakeCluster, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.create("k", b"x")
    timeouts: list[float] = []
    original = cluster._WaitForReplication

    def slow(address: str, r: pb.WaitForReplicationRequest) -> pb.WaitForReplicationResponse:
        timeouts.append(r.timeout_secs)
        if len(timeouts) == 3:
            cluster.holders["k"] = [M1, M2]
        clock.now += r.timeout_secs
        return original(address, r)

    cluster._WaitForReplication = slow  # type: ignore[method-assign]
    result = client.wait_for_replication(["k"], 2, -1)
    assert result.reached and timeouts == [60.0, 60.0, 60.0]
    assert result.waited_secs == pytest.approx(180.0)


def test_invalid_key_fails_before_any_call(client: Client, cluster: FakeCluster) -> None:
    with pytest.raises(InvalidArgument):
        client.get_meta("a/b")
    assert cluster.calls == []


def test_download_in_segments_resumes_at_the_byte(
    client: Client, cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(download_mod, "_DOWNLOAD_SEGMENT_BYTES", 512 * KiB)
    data = payload(1000 * KiB)
    client.create("k", data)
    cluster.holders["k"] = [M1, M2, M3]
    cluster.download_break_after = 1  # the first segment breaks after one 256 KiB chunk
    requests: list[tuple[int, int, int]] = []
    original = cluster._download

    def record(address: str, r: pb.DownloadRequest) -> Iterator[pb.DownloadChunk]:
        requests.append((r.version, r.offset, r.length))
        return original(address, r)

    monkeypatch.setattr(cluster, "_download", record)
    assert client.read("k") == data
    assert requests == [
        (0, 0, 512 * KiB),
        (1, 256 * KiB, 512 * KiB),  # pinned to the version the first answer named
        (1, 768 * KiB, 232 * KiB),
    ]


@pytest.mark.parametrize("refusal", ["not held here", "no longer kept"])
def test_download_restarts_when_its_version_is_replaced(
    client: Client, cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    monkeypatch.setattr(download_mod, "_DOWNLOAD_SEGMENT_BYTES", 256 * KiB)
    client.create("k", payload(600 * KiB))
    original = cluster._download
    update: list[bytes] = [payload(700 * KiB)[::-1]]

    def update_mid_download(address: str, r: pb.DownloadRequest) -> Iterator[pb.DownloadChunk]:
        version = cluster.blobs["k"][0]
        if r.offset > 0 and r.version == version and update:
            # A new version is committed and the old one pruned everywhere.
            cluster.blobs["k"] = (version + 1, update.pop())
        if refusal == "no longer kept" and 0 < r.version < cluster.blobs["k"][0]:
            # What masters say of a version older than they keep (the fake's own refusal is
            # "not held here"): for the version a download began on, it too means "start over".
            raise KeyNotFound(f"'k' v{r.version} is no longer kept: the masters keep the newest 1")
        return original(address, r)

    monkeypatch.setattr(cluster, "_download", update_mid_download)
    assert client.read("k") == payload(700 * KiB)[::-1]
    # A sink that cannot start over gets a clear error instead.
    update.append(payload(500 * KiB))
    with pytest.raises(KeyNotFound, match="updated during the download"):
        client.download("k", cast(BinaryIO, _Unseekable()))
    if refusal == "no longer kept":
        with pytest.raises(KeyNotFound, match="no longer kept"):
            client.read("k", version=1)  # asked for by number: no starting over


class _Unseekable(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b: Any) -> int:
        return len(b)


def test_download_path_errors_name_the_users_path(client: Client, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        client.download("k", tmp_path / "no" / "out")
    assert missing.value.filename == str(tmp_path / "no")
    with pytest.raises(IsADirectoryError) as isdir:
        client.download("k", tmp_path)
    assert isdir.value.filename == str(tmp_path)


def test_address_map_parses_and_rejects_bad_entries() -> None:
    from blobha.client import parse_address_map

    assert parse_address_map("m1:6627=127.0.0.1:16627, m2=127.0.0.1:16628,") == {
        "m1:6627": "127.0.0.1:16627", "m2:6627": "127.0.0.1:16628",
    }
    assert parse_address_map("") == {}
    for bad in ("m1:6627", "m1:6627=", "=127.0.0.1:1", "m1:99999=h:1"):
        with pytest.raises(InvalidArgument):
            parse_address_map(bad)


def test_address_map_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from blobha.client import GrpcTransport

    monkeypatch.setenv("BLOBHA_ADDRESS_MAP", "m1:6627=127.0.0.1:1")
    c = Client("m1:6627", user="alice")
    try:
        assert isinstance(c._transport, GrpcTransport)
        assert c._transport._address_map == {"m1:6627": "127.0.0.1:1"}
    finally:
        c.close()


def test_a_retry_cut_short_by_the_deadline_reports_why_it_was_retrying(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Each master refuses (ZooKeeper is down) and each refusal takes 9 s; the try that the
    # deadline then cuts short must not hide why the client kept trying.
    refusals = []
    real = cluster.unary

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method != "GetMeta":
            return real(address, method, request, timeout)
        assert timeout is not None
        if len(refusals) < 3:
            refusals.append(address)
            clock.now += 9.0
            raise Unavailable(f"master {address} unavailable: no record of 'k' here while"
                              " ZooKeeper is unreachable")
        clock.now += timeout  # the last try runs to the end of the deadline
        raise DeadlineExceeded(f"master {address} did not answer in time (Deadline Exceeded)")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=r"within 30 s: .*no record of 'k'"):
        client.get_meta("k")
    assert len(refusals) == 3


def _zookeeper_down(cluster: FakeCluster, clock: FakeClock) -> list[float]:
    """Every master refuses ClusterSummary at once, each refusal taking 0.7 s, until the caller
    has less than 2 s left; that last probe runs into the end of the caller's deadline, as a
    gRPC call with only milliseconds left does whatever the master would have answered.
    Returns the probes' timeouts, as they are made."""
    real = cluster.unary
    timeouts: list[float] = []

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method != "ClusterSummary":
            return real(address, method, request, timeout)
        assert timeout is not None
        timeouts.append(timeout)
        if timeout >= 2.0:
            clock.now += 0.7
            raise Unavailable(f"master {address} unavailable: ZooKeeper is unreachable from"
                              f" master {address}; retry shortly or ask another master")
        clock.now += timeout
        raise DeadlineExceeded(f"master {address} did not answer in time (Deadline Exceeded)")

    cluster.unary = unary  # type: ignore[method-assign]
    return timeouts


@pytest.mark.parametrize("path", ["put", "resumable"])
def test_a_leader_search_cut_short_by_the_deadline_reports_why_it_was_retrying(
    client: Client, cluster: FakeCluster, clock: FakeClock, path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ZooKeeper has lost its quorum: every master says so, until the deadline cuts the
    # client's last look for a leader short. That last look must not hide the reason.
    if path == "resumable":
        monkeypatch.setattr(upload_mod, "_PUT_MAX_BYTES", -1)
    monkeypatch.setattr(client._router.rng, "random", lambda: 0.0)  # no back-off: many rounds
    timeouts = _zookeeper_down(cluster, clock)
    with pytest.raises(Unavailable, match=r"within 30 s: .*ZooKeeper is unreachable"):
        client.create("k", b"never acknowledged")
    # Many refusals, then a last probe that ran into the deadline: the case under test.
    assert len(timeouts) > 3 and timeouts[-1] < 2.0
    assert clock.now >= 1030.0


def test_a_masters_reason_is_reported_before_another_ones_silence(
    client: Client, cluster: FakeCluster
) -> None:
    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        assert method == "ClusterSummary"
        if address == M1:  # the first to end, in silence
            raise DeadlineExceeded(f"master {address} did not answer in time")
        raise Unavailable(f"master {address} unavailable: ZooKeeper is unreachable")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=r"no master at .* named a leader \(master m2:2"
                                          r" unavailable: ZooKeeper is unreachable\)"):
        client._router.discover_leader(retry_mod.Deadline(30.0))


def test_a_deadline_with_nothing_retried_before_is_reported_as_it_is(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    client.create("k", b"x")
    real = cluster.unary

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method != "Delete":
            return real(address, method, request, timeout)
        assert timeout is not None
        clock.now += timeout
        raise DeadlineExceeded(f"master {address} did not answer in time (Deadline Exceeded)")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded, match="did not answer in time"):
        client.delete("k")


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


def test_a_deadline_the_master_reported_is_not_called_a_master_that_did_not_answer() -> None:
    from blobha.client.transport import error_from_rpc

    own = error_from_rpc(M1, _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert isinstance(own, DeadlineExceeded) and "did not answer in time" in str(own)
    told = error_from_rpc(M1, _Status(
        grpc.StatusCode.DEADLINE_EXCEEDED, "'k' v2 is committed but only 1 of the 2 required"))
    assert isinstance(told, DeadlineExceeded)
    assert "did not answer" not in str(told) and "only 1 of the 2" in str(told)


def test_a_stale_refusal_keeps_its_class_through_the_transport() -> None:
    # A read with no minimum refused as stale makes the client look for a master in touch
    # with ZooKeeper; as a plain refusal it would only try the next one.
    from blobha.client.transport import error_from_rpc
    from blobha.core.errors import REFUSED_METADATA_KEY, STALE_METADATA_KEY, Refused, Stale

    stale = error_from_rpc(M1, _Status(grpc.StatusCode.UNAVAILABLE, "cut off for 9 s",
                                       ((REFUSED_METADATA_KEY, "1"), (STALE_METADATA_KEY, "1"))))
    assert type(stale) is Stale and f"master {M1} unavailable: cut off" in str(stale)
    refused = error_from_rpc(M1, _Status(grpc.StatusCode.UNAVAILABLE, "no ZooKeeper",
                                         ((REFUSED_METADATA_KEY, "1"),)))
    assert type(refused) is Refused


def test_a_master_with_no_free_call_thread_is_busy_not_out_of_resources() -> None:
    # grpcio's own refusal when every call thread is taken: retried like any busy master, and
    # known not to have run (a retry that finds the key gone is not the first try's doing).
    from blobha.client.retry import may_have_run
    from blobha.client.transport import error_from_rpc

    full = error_from_rpc(M1, _Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       "Concurrent RPC limit exceeded!"))
    assert isinstance(full, Unavailable) and "master.rpc.threads" in str(full)
    assert not may_have_run(full)
    disk = error_from_rpc(M1, _Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       "not enough disk space on m1:1"))
    assert isinstance(disk, ResourceExhausted)


def test_giving_up_after_a_lost_commit_answer_says_the_write_may_be_made(
        client: Client, cluster: FakeCluster, clock: FakeClock) -> None:
    real_put = cluster._Put

    def committed_then_lost(address: str, r: pb.PutRequest) -> Any:
        real_put(address, r)  # the commit applies
        cluster.down.update((M1, M2, M3))  # and the cluster is gone before the answer
        raise Unavailable(f"master {address} unavailable: connection reset")

    cluster._Put = committed_then_lost  # type: ignore[method-assign]
    started = clock.now
    with pytest.raises(Unavailable, match="may have been made: check its metadata before"):
        client.create("k", b"data")
    assert clock.now - started <= 30.0 + 2.0 + 1.0  # its timeout, and the outcome check's
    assert "k" in cluster.blobs


@pytest.mark.parametrize("refusal", [
    Refused("master m1:1 unavailable: no leader is ready yet (election in progress)"),
    Unavailable("master m1:1 unavailable: failed to connect to all addresses"),
])
def test_a_commit_refused_before_it_ran_is_retried_without_asking_whether_it_was_made(
        client: Client, cluster: FakeCluster, refusal: Unavailable) -> None:
    # During a failover every extra call waits on a busy cluster: a Put the old leader refused
    # unrun (or never received) cannot have been made, so no metadata read settles it.
    client.create("k", b"v1")
    cluster.faults.append((M1, "Put", refusal))
    before = cluster.count("GetMeta")
    assert client.update("k", b"v2").version == 2
    assert cluster.count("GetMeta") - before == 1  # the update's own read of the version
    assert cluster.blobs["k"][1] == b"v2"


def test_a_commit_whose_answer_may_be_lost_is_still_settled_by_a_metadata_read(
        client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"v1")
    cluster.faults.append((M1, "Put", Unavailable("master m1:1 unavailable: connection reset")))
    before = cluster.count("GetMeta")
    assert client.update("k", b"v2").version == 2
    assert cluster.count("GetMeta") - before == 2  # and one more to learn what became of it


def test_a_refusal_keeps_its_class_across_the_wire() -> None:
    from blobha.client.retry import may_have_run
    from blobha.client.transport import error_from_rpc
    from blobha.core.errors import REFUSED_METADATA_KEY, to_status

    code, details, trailers = to_status(Refused("no leader is ready yet; retry in a moment"))
    assert code == grpc.StatusCode.UNAVAILABLE and trailers == ((REFUSED_METADATA_KEY, "1"),)
    back = error_from_rpc(M1, _Status(code, details, trailers))
    assert isinstance(back, Refused) and "no leader is ready yet" in str(back)
    assert not may_have_run(back)
    plain = error_from_rpc(M1, _Status(code, details))  # a master older than the trailer
    assert type(plain) is Unavailable and may_have_run(plain)


class _StallingCall:
    """A server stream that sends ``first`` messages and then nothing until cancelled (or,
    with ``end``, ends there)."""

    def __init__(self, first: int, end: bool = False) -> None:
        self.first = first
        self.end = end
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[pb.DownloadChunk]:
        for _ in range(self.first):
            if self.cancelled.is_set():  # as gRPC does: a cancelled call ends at the next read
                raise _Status(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
            yield pb.DownloadChunk(data=b"x")
        if self.end:
            return
        if not self.cancelled.wait(30):
            raise AssertionError("the stalled stream was never cancelled")
        raise _Status(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    def cancel(self) -> None:
        self.cancelled.set()


def _transport_with(calls: list[Any]) -> Any:
    from blobha.client import GrpcTransport

    transport = GrpcTransport("alice")

    class Stub:
        def Download(self, request: Any, timeout: float | None, metadata: Any) -> Any:
            return calls.pop(0)

    transport._stub = lambda address: Stub()  # type: ignore[method-assign]
    return transport


def test_a_stream_that_stalls_is_abandoned_after_the_stall_limit() -> None:
    # A paused master takes the call and sends nothing more: without the watch, only the
    # call's whole deadline (60 s by default) ended it.
    stalled = _StallingCall(first=2)
    transport = _transport_with([stalled])
    got = []
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"sent nothing for 0\.3 s"):
        for m in transport.server_stream(M1, "Download", pb.DownloadRequest(), 60.0, stall=0.3):
            got.append(m)
    assert len(got) == 2 and stalled.cancelled.is_set()
    assert time.monotonic() - started < 10
    transport.close()


def test_a_slow_consumer_is_not_a_stalled_master() -> None:
    # Time the caller spends on each message (a slow disk) is not the master's silence.
    transport = _transport_with([_StallingCall(first=3, end=True)])
    got = 0
    for _ in transport.server_stream(M1, "Download", pb.DownloadRequest(), 60.0, stall=0.1):
        threading.Event().wait(0.3)  # the consumer's own work, three times the stall limit
        got += 1
    assert got == 3
    transport.close()
    assert transport._stalls._thread is not None
    transport._stalls._thread.join(5)
    assert not transport._stalls._thread.is_alive()  # closing the transport ends the watch


class _Silent:
    """A status call that never answers (a paused master's), as a gRPC future."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def result(self, timeout: float | None = None) -> Any:
        if self.cancelled.wait(timeout):
            raise _Status(grpc.StatusCode.CANCELLED, "Cancelled")
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _Answered:
    def __init__(self, reply: Any) -> None:
        self.reply = reply

    def result(self, timeout: float | None = None) -> Any:
        return self.reply

    def cancel(self) -> bool:
        return False


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self, timeout: float | None = None) -> Any:
        raise self.error

    def cancel(self) -> bool:
        return False


class _StatusCall:
    """``stub.NodeStatus``: callable, with ``.future`` giving ``make()``."""

    def __init__(self, make: Callable[[], Any], calls: list[str], name: str) -> None:
        self.make, self.calls, self.name = make, calls, name

    def future(self, request: Any, timeout: float | None, metadata: Any) -> Any:
        self.calls.append(self.name)
        return self.make()


class _SlowMaster:
    """A master whose Put answers once ``checks`` status checks have been made (None: never),
    over a channel whose close ends the call as gRPC does."""

    def __init__(self, checks: int | None, status_answers: bool) -> None:
        self.answer_after = checks
        self.status_answers = status_answers
        self.checks: list[str] = []
        self.closed = threading.Event()
        #: What a status check gives instead, as a gRPC future.
        self.status_future: Callable[[], Any] | None = None

    def Put(self, request: Any, timeout: float | None, metadata: Any) -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.closed.wait(0.01):
                raise _Status(grpc.StatusCode.CANCELLED, "Channel closed!")
            if self.answer_after is not None and len(self.checks) >= self.answer_after:
                return "answer"
        raise AssertionError("the call was neither answered nor ended in 10 s")

    @property
    def NodeStatus(self) -> Any:
        def check() -> Any:
            if not self.status_answers:
                return _Failed(_Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            return _Answered(pb.MasterSummary())

        return _StatusCall(self.status_future or check, self.checks, "NodeStatus")

    def close(self) -> None:
        self.closed.set()


def _unary_transport(master: _SlowMaster) -> Any:
    from blobha.client import GrpcTransport

    transport = GrpcTransport("alice")
    transport._stubs[M1] = master
    transport._channels[M1] = master
    return transport


def test_a_long_call_to_a_master_that_answers_status_checks_is_waited_for() -> None:
    # A write waiting for its quorum takes long; its master is working on it.
    master = _SlowMaster(checks=3, status_answers=True)
    transport = _unary_transport(master)
    try:
        assert transport.unary(M1, "Put", pb.PutRequest(), 60.0, stall=0.4) == "answer"
        assert master.checks == ["NodeStatus"] * 3 and not master.closed.is_set()
    finally:
        transport.close()


def test_a_call_to_a_master_that_answers_nothing_is_given_up() -> None:
    master = _SlowMaster(checks=None, status_answers=False)
    transport = _unary_transport(master)
    try:
        with pytest.raises(Unavailable,
                           match=r"stopped answering: Put got no answer for 0\.4 s, or until"):
            transport.unary(M1, "Put", pb.PutRequest(), 60.0, stall=0.4)
        assert master.checks == ["NodeStatus"] and master.closed.is_set()
        assert M1 not in transport._channels  # the next call dials the master afresh
    finally:
        transport.close()


def test_a_write_to_a_silent_leader_ends_once_a_rival_leads() -> None:
    # The leader paused past its session: a successor is elected long before the stall limit
    # (60 s here) ends the call, and the write must go there.
    leader = _SlowMaster(checks=None, status_answers=False)
    asked: list[str] = []
    leader.status_future = _Silent

    class _Rival:
        # Elected once asked a second time: the first look finds no successor yet.
        NodeStatus = _StatusCall(
            lambda: _Answered(pb.MasterSummary(is_leader=asked.count(M2) >= 2)), asked, M2)

    transport = _unary_transport(leader)
    transport._stubs[M2] = _Rival()
    try:
        started = time.monotonic()
        with pytest.raises(transport_mod.LeaderMoved, match=f"and {M2} leads now") as moved:
            transport.unary(M1, "Put", pb.PutRequest(), 120.0, stall=60.0, rivals=[M1, M2])
        took = time.monotonic() - started
        assert moved.value.leader == M2  # where the retry goes at once
        assert took < 10, f"left the silent leader after {took:.1f} s"
        assert leader.closed.is_set() and asked.count(M2) == 2
    finally:
        transport.close()


def test_a_download_no_master_holds_gives_up_unavailable_not_key_not_found() -> None:
    # Every master answered "not held here" for a key whose replica list was read: the key
    # exists, so the read gives up with UNAVAILABLE (exit 11), never "key not found" (exit 3).
    from blobha.client.download import DownloadJob

    job: Any = DownloadJob.__new__(DownloadJob)
    job.key, job.version, job.info = "k", 0, None
    not_held = KeyNotFound("not held here: m3:6627 does not hold v1 of 'k'")
    why = job._why(not_held, None)
    assert isinstance(why, Unavailable) and not isinstance(why, KeyNotFound)
    assert "no reachable master holds the latest version of 'k'" in str(why)
    assert "GetReplication" not in str(why)
    job.version = 4
    assert "holds v4 of 'k'" in str(job._why(not_held, None))
    down = Unavailable("master m1:6627 unavailable: connection refused")
    assert job._why(not_held, down) is down  # a holder's own failure says more


def test_masters_cut_off_from_zookeeper_say_so_when_no_leader_is_found(
    client: Client, cluster: FakeCluster
) -> None:
    # They answer the leader search from what they last saw (so 'blobha cluster' has a view);
    # with no leader among them, the failure names ZooKeeper, not "no leader elected yet".
    cluster.leader = ""
    original = cluster._ClusterSummary

    def cut_off(address: str, request: Any) -> pb.ClusterSummaryResponse:
        reply = original(address, request)
        reply.zookeeper_unreachable = True
        return reply

    cluster._ClusterSummary = cut_off  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match="ZooKeeper is unreachable from master") as info:
        client.create("k", b"x")
    assert "retry when ZooKeeper is back" in str(info.value)
    # A leader one of them still sees (a live session of its own) is used as usual.
    cluster.leader = M2
    client.create("k", b"x")
    assert cluster.count("BeginUpload", M2) + cluster.count("Put", M2) >= 1


def test_a_call_retrying_for_a_while_is_told_once_and_a_short_blip_not_at_all(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    told: list[tuple[str, str, float]] = []
    client.on_retry = lambda what, why, left: told.append((what, str(why), left))
    # A blip (one refusal, then a leader): retried quietly.
    cluster.faults.append(("*", "ClusterSummary", Unavailable("starting")))
    client.create("a", b"x")
    assert told == []
    # No leader for the whole timeout: one word once it has retried for a while, then the
    # failure at the deadline as before.
    cluster.leader = ""
    started = clock.now
    with pytest.raises(Unavailable, match="could not create 'b' within 30 s"):
        client.create("b", b"x")
    assert len(told) == 1, told
    what, why, left = told[0]
    assert what == "create 'b'" and "no leader is elected yet" in why
    assert 0 < left <= 30.0 - routing_mod._RETRY_NOTICE_AFTER
    assert clock.now - started > 30.0 - left >= routing_mod._RETRY_NOTICE_AFTER


def test_a_master_that_does_not_answer_a_control_call_is_passed_over_late_in_the_deadline(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Each stalled GetReplication takes the control call's whole limit (8 s). The third one
    # starts with 14 s of the 30 left: it must still count as that master's silence (try
    # another), not as the end of the caller's deadline, which has 6 s left.
    client.create("k", b"data")
    cluster.holders["k"] = [M1, M2, M3]
    real = cluster.unary
    stalls = [3]

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method == "GetReplication" and stalls[0] > 0:
            stalls[0] -= 1
            assert timeout is not None
            clock.now += timeout
            raise DeadlineExceeded(f"master {address} did not answer in time")
        return real(address, method, request, timeout, stall)

    cluster.unary = unary  # type: ignore[method-assign]
    assert client.get_replication("k").replication == 3
    assert stalls == [0]


@pytest.mark.parametrize("write", ["create", "update", "put"])
def test_a_str_body_is_refused_before_any_call(
        client: Client, cluster: FakeCluster, tmp_path: Path, write: str) -> None:
    # Content or a file's name? Either guess writes the wrong blob without a word.
    (tmp_path / "data").write_bytes(b"in the file")
    with pytest.raises(TypeError, match=r"a str body is ambiguous: pass data.encode\(\) for"
                                        r" content or Path\(...\) for a file"):
        getattr(client, write)("k", str(tmp_path / "data"))
    assert cluster.calls == []


def test_bodies_are_bytes_file_objects_or_paths(
        client: Client, cluster: FakeCluster, tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"from a file")
    client.create("k", path)
    assert cluster.blobs["k"][1] == b"from a file"
    client.update("k", memoryview(b"from a view"))
    assert cluster.blobs["k"][1] == b"from a view"
    client.put("k", io.BytesIO(b"from a file object"))
    assert cluster.blobs["k"][1] == b"from a file object"
