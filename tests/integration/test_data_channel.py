"""The data channel (blobha.dataplane) between real master processes and clients: downloads and
sync take it, authorisation stays in gRPC, and whoever cannot use it streams instead."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import grpc
import pytest
from conftest import client_for, make_cluster, md, scrape, stub, value, wait_until

from blobha.client import Client
from blobha.dataplane import receive
from blobha.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb

MiB = 1024 * 1024
SENT = "blobha_data_channel_bytes_total"


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
                       if not c._data_channels.usable(m.address)]
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
    finally:
        c.stop()
