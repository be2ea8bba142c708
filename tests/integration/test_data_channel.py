"""The data channel (blobha.wire.datachannel) between real master processes and clients: downloads,
uploads and sync take it, authorisation stays in gRPC, and whoever cannot use it streams
instead."""

from __future__ import annotations

import io
import logging
import os
import threading
from pathlib import Path

import grpc
import pytest
from support.harness import client_for, make_cluster, md, scrape, stub, value, wait_until

from blobha.client import Client, ClientLimits
from blobha.core.digest import digest_bytes
from blobha.core.errors import Unavailable
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.datachannel import receive, send_upload

MiB = 1024 * 1024
SENT = "blobha_data_channel_bytes_total"
RECEIVED = "blobha_data_channel_received_bytes_total"
UPLOADS = "blobha_data_channel_uploads_total"
STREAMED = "blobha_rpc_received_bytes_total"


def sent(cluster: LocalCluster) -> float:
    return sum(value(scrape(m), SENT) for m in cluster.masters)


def sent_at_least(cluster: LocalCluster, total: float) -> float:
    # A master counts a transfer once its send returns, which may be after the receiver has
    # every byte (and has installed it, or returned it to the caller).
    return wait_until(lambda: (lambda n: n if n >= total else 0)(sent(cluster)),
                      what=f"{total:.0f} bytes counted as sent over the data channel")


def test_downloads_and_sync_take_the_data_channel(cluster: LocalCluster, alice: Client,
                                                  unique_key: str) -> None:
    data = os.urandom(5 * MiB + 3)  # larger than a whole-version batch fetch takes
    before = sent(cluster)
    alice.create(unique_key, data, replication_factor=3)
    assert alice.wait_for_replication([unique_key], 3, timeout=30).reached
    synced = sent_at_least(cluster, before + 2 * len(data))  # both other masters fetched

    assert alice.read(unique_key) == data
    whole = sent_at_least(cluster, synced + len(data))

    ranged = io.BytesIO()
    alice.download(unique_key, ranged, offset=MiB - 10, length=2 * MiB + 20)
    assert ranged.getvalue() == data[MiB - 10:3 * MiB + 10]
    sent_at_least(cluster, whole + 2 * MiB + 20)


def test_a_client_that_cannot_reach_it_streams(cluster: LocalCluster, unique_key: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(3 * MiB + 1)
    with client_for(cluster) as c:
        c.create(unique_key, data, replication_factor=3)
        assert c.wait_for_replication([unique_key], 3, timeout=30).reached
        # Masters listen on 127.0.0.1 only: 127.0.0.2 refuses, as a firewalled port would.
        c._transport.data_host = lambda address: "127.0.0.2"  # type: ignore[method-assign]
        before = sent(cluster)
        with caplog.at_level(logging.WARNING, logger="blobha.dataplane"):
            assert c.read(unique_key) == data
        assert sent(cluster) == before
        assert "use the gRPC stream for the next" in caplog.text
        unreachable = [m.address for m in cluster.masters
                       if not c._router.data_channels.usable(m.address)]
        assert len(unreachable) == 1  # only the master it tried; no second attempt there
        assert c.read(unique_key) == data
        assert sent(cluster) == before


def test_the_offer_is_authorised_and_bound_to_its_range(cluster: LocalCluster, alice: Client,
                                                        unique_key: str) -> None:
    data = os.urandom(2 * MiB)
    alice.create(unique_key, data, acl="u:alice:rwa")
    address = cluster.leader().address
    with pytest.raises(grpc.RpcError) as e:
        list(stub(address).Download(pb.DownloadRequest(key=unique_key, data_channel=True),
                                    metadata=md("mallory")))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

    size = MiB + 100
    offer, = stub(address).Download(
        pb.DownloadRequest(key=unique_key, offset=10, length=size, data_channel=True),
        metadata=md("alice"))
    assert offer.ticket and offer.data_port and not offer.data
    assert offer.info.size == len(data)
    got = bytearray()
    receive("127.0.0.1", offer.data_port, offer.ticket, size, 10.0, got.extend)
    assert bytes(got) == data[10:10 + size]

    # A small range is not worth a connection: it streams.
    small = list(stub(address).Download(
        pb.DownloadRequest(key=unique_key, offset=10, length=MiB - 1, data_channel=True),
        metadata=md("alice")))
    assert not any(m.ticket for m in small)
    assert b"".join(m.data for m in small) == data[10:10 + MiB - 1]


def test_uploads_take_the_data_channel_a_segment_at_a_time(
        cluster: LocalCluster, alice: Client, unique_key: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(alice, "limits", ClientLimits(channel_segment_bytes=2 * MiB))
    leader = cluster.leader()
    before = scrape(leader)
    data = os.urandom(5 * MiB + 3)
    alice.create(unique_key, data, replication_factor=3)
    after = scrape(leader)
    assert value(after, RECEIVED) - value(before, RECEIVED) == len(data)
    assert value(after, STREAMED, grpc_method="AppendUpload") == \
        value(before, STREAMED, grpc_method="AppendUpload")
    wait_until(lambda: value(scrape(leader), UPLOADS) - value(before, UPLOADS) == 3,
               what="three segments of 2 MiB at most")
    assert alice.read(unique_key) == data

    # From a file, as the CLI sends one: an update, read back whole.
    newer = os.urandom(3 * MiB)
    path = tmp_path / "newer"
    path.write_bytes(newer)
    assert alice.update(unique_key, path).version == 2
    assert alice.read(unique_key) == newer
    assert alice.wait_for_replication([unique_key], 3, timeout=30).reached


def test_an_upload_from_a_pipe_takes_it_in_segments_it_keeps_in_memory(
        cluster: LocalCluster, alice: Client, unique_key: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A pipe cannot be read again, so the client keeps each segment until the leader
    # acknowledges it: those segments stay at the stream's size, not the channel's.
    monkeypatch.setattr(alice, "limits", ClientLimits(upload_segment_bytes=MiB + MiB // 2))
    leader = cluster.leader()
    before = scrape(leader)
    data = os.urandom(4 * MiB + 7)
    read_end, write_end = os.pipe()

    def feed() -> None:
        with open(write_end, "wb") as w:
            w.write(data)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        with open(read_end, "rb") as r:
            alice.create(unique_key, r)
    finally:
        writer.join(30)
    assert alice.read(unique_key) == data
    assert value(scrape(leader), RECEIVED) - value(before, RECEIVED) == len(data)
    # 1.5, 1.5, then the last 1 MiB + 7 bytes (more than 1 MiB is left: still the channel).
    wait_until(lambda: value(scrape(leader), UPLOADS) - value(before, UPLOADS) == 3,
               what="three segments of 1.5 MiB at most")


def test_the_upload_offer_is_bound_to_its_session_and_user(cluster: LocalCluster,
                                                           unique_key: str) -> None:
    address = cluster.leader().address
    leader = stub(address)
    begun = leader.BeginUpload(pb.BeginUploadRequest(key=unique_key, create=True),
                               metadata=md("alice"))
    ask = pb.UploadStatusRequest(upload_id=begun.upload_id, data_channel=True)
    with pytest.raises(grpc.RpcError) as e:
        leader.GetUploadStatus(ask, metadata=md("mallory"))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

    data = os.urandom(MiB + MiB // 2)
    offer = leader.GetUploadStatus(ask, metadata=md("alice"))
    assert offer.received == 0 and offer.ticket and offer.data_port
    assert send_upload("127.0.0.1", offer.data_port, offer.ticket, 10.0, [data[:MiB]]) == MiB
    with pytest.raises(Unavailable, match="unknown or expired ticket"):
        send_upload("127.0.0.1", offer.data_port, offer.ticket, 10.0, [data[MiB:]])
    # Asked without data_channel: the status alone, as before.
    plain = leader.GetUploadStatus(pb.UploadStatusRequest(upload_id=begun.upload_id),
                                   metadata=md("alice"))
    assert plain.received == MiB and not plain.ticket
    offer = leader.GetUploadStatus(ask, metadata=md("alice"))
    assert offer.received == MiB
    assert send_upload("127.0.0.1", offer.data_port, offer.ticket, 10.0, [data[MiB:]]) == \
        len(data)
    meta = leader.CommitUpload(pb.CommitUploadRequest(upload_id=begun.upload_id, size=len(data),
                                                      digest=digest_bytes(data)),
                               metadata=md("alice"))
    assert meta.version == 1 and meta.size == len(data)
    with client_for(cluster) as alice:
        assert alice.read(unique_key) == data


def test_an_upload_that_cannot_reach_it_streams(cluster: LocalCluster, unique_key: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    leader = cluster.leader()
    data = os.urandom(3 * MiB + 1)
    with client_for(cluster) as c:
        # Masters listen on 127.0.0.1 only: 127.0.0.2 refuses, as a firewalled port would.
        c._transport.data_host = lambda address: "127.0.0.2"  # type: ignore[method-assign]
        before = scrape(leader)
        with caplog.at_level(logging.WARNING, logger="blobha.dataplane"):
            c.create(unique_key, data)
        after = scrape(leader)
        assert "use the gRPC stream for the next" in caplog.text
        assert value(after, RECEIVED) == value(before, RECEIVED)
        assert value(after, STREAMED, grpc_method="AppendUpload") - \
            value(before, STREAMED, grpc_method="AppendUpload") >= len(data)
        assert c.read(unique_key) == data


def test_a_master_without_a_data_channel_streams(tmp_path: Path) -> None:
    c = make_cluster(tmp_path, nodes=1, **{"blobstore.data.port": -1})
    try:
        c.start()
        data = os.urandom(2 * MiB + 5)
        with client_for(c) as alice:
            alice.create("plain", data)
            assert alice.read("plain") == data
        chunks = list(stub(c.masters[0].address).Download(
            pb.DownloadRequest(key="plain", data_channel=True), metadata=md("alice")))
        assert not any(ch.ticket for ch in chunks)
        assert b"".join(ch.data for ch in chunks) == data
        assert not any(name.startswith("blobha_data_channel") for name, _ in scrape(c.masters[0]))
        begun = stub(c.masters[0].address).BeginUpload(
            pb.BeginUploadRequest(key="plain-2", create=True), metadata=md("alice"))
        status = stub(c.masters[0].address).GetUploadStatus(
            pb.UploadStatusRequest(upload_id=begun.upload_id, data_channel=True),
            metadata=md("alice"))
        assert status.received == 0 and not status.ticket and not status.data_port
    finally:
        c.stop()


def _free_base() -> int:
    """A port P with P, P + 10 and P + 100 free (gRPC, data channel, status page)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 100 > 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base + 10))
                b.bind(("127.0.0.1", base + 100))
        except OSError:
            continue
        return base
    raise AssertionError("no free port P with P + 10 and P + 100 free")


def test_the_data_channel_listens_on_the_grpc_port_plus_ten(tmp_path: Path) -> None:
    base = _free_base()
    c = LocalCluster(tmp_path / "pinned", nodes=1, base_port=base,
                     overrides={"blobstore.disk.reserved.bytes": 0})
    try:
        c.start()
        with client_for(c) as alice:
            alice.create("pinned", os.urandom(2 * MiB))
        offer, = stub(c.masters[0].address).Download(
            pb.DownloadRequest(key="pinned", data_channel=True), metadata=md("alice"))
        assert offer.ticket and offer.data_port == base + 10
    finally:
        c.stop()
