"""Downloads through the fake transport: failing over and resuming, the stall timeout,
segments, replaced versions and the user's paths."""

from __future__ import annotations

import io
import threading
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
from blobha.client import Client, ClientLimits
from blobha.client import sources as sources_mod
from blobha.client import upload as upload_mod
from blobha.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KeyNotFound,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb


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


def test_download_in_segments_resumes_at_the_byte(
    client: Client, cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.limits = ClientLimits(download_segment_bytes=512 * KiB)
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
    client.limits = ClientLimits(download_segment_bytes=256 * KiB)
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
