"""Writes through the fake transport: finding the leader, puts and resumable uploads,
following leader changes, lost answers, deletes, and what a body may be."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest
from support.client_fakes import (
    M1,
    M2,
    M3,
    FakeClock,
    FakeCluster,
    KiB,
    payload,
)

from blobha import client as client_mod
from blobha.client import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    Client,
    ClientLimits,
)
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    Busy,
    DeadlineExceeded,
    KeyNotFound,
    Unavailable,
    UploadNotFound,
)
from blobha.v1 import blobha_pb2 as pb


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
    client.limits = ClientLimits(upload_segment_bytes=256 * KiB)
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
