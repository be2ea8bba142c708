"""The data channel over TLS, between real master processes and clients: with TLS on, uploads,
downloads and sync keep the channel, encrypted with the masters' certificates; a ticket is
never read from a connection that is not TLS, a master the caller does not trust is left for
the gRPC stream, and in mTLS mode a caller without a client certificate gets nothing."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from support.clusters import running_cluster
from support.harness import scrape, value, wait_until

from blobha.client import Client
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.datachannel import DataChannelUnusable, receive
from blobha.wire.datatls import client_context
from blobha.wire.peers import CHANNEL_OPTIONS

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
SENT = "blobha_data_channel_bytes_total"
UPLOADS = "blobha_data_channel_uploads_total"


def total(cluster: LocalCluster, name: str) -> float:
    return sum(value(scrape(m), name) for m in cluster.masters)


def reaches(cluster: LocalCluster, name: str, at_least: float) -> float:
    # A master counts a transfer once its send returns, which may be after the receiver has
    # every byte.
    return wait_until(lambda: (lambda n: n if n >= at_least else 0)(total(cluster, name)),
                      what=f"{name} to reach {at_least:.0f}")


def client(cluster: LocalCluster, user: str = "alice") -> Client:
    return Client(cluster.cluster, user=user, timeout=30.0,
                  credentials=cluster.credentials(user))


def offer(cluster: LocalCluster, address: str, key: str, size: int, user: str = "alice"
          ) -> pb.DownloadChunk:
    """The data channel's offer of ``key``'s first ``size`` bytes from one master, asked over
    the master's TLS gRPC as ``user``."""
    creds = cluster.credentials(user)
    with creds.channel(address, CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.BlobStoreStub(ch)  # type: ignore[no-untyped-call]
        answer, = stub.Download(pb.DownloadRequest(key=key, length=size, data_channel=True),
                                timeout=10, metadata=creds.metadata(user))
    assert answer.ticket and answer.data_port and not answer.data
    return answer  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("tls-channel"), tls=True) as c:
        yield c


def test_over_tls_uploads_downloads_and_sync_take_the_encrypted_channel(
        secure: LocalCluster) -> None:
    data = os.urandom(5 * MiB + 3)  # larger than a whole-version batch fetch takes
    sent, uploads = total(secure, SENT), total(secure, UPLOADS)
    with client(secure) as alice:
        alice.create("tls-model", data, replication_factor=3)
        assert total(secure, UPLOADS) > uploads
        assert alice.wait_for_replication(["tls-model"], 3, timeout=30).reached
        synced = reaches(secure, SENT, sent + 2 * len(data))  # both other masters fetched
        assert alice.read("tls-model") == data
        reaches(secure, SENT, synced + len(data))


def test_a_w2_upload_is_forwarded_to_a_holder_over_the_encrypted_channel(
        secure: LocalCluster) -> None:
    data = os.urandom(9 * MiB + 5)  # several ranges of the leader's temp file
    others = [m for m in secure.masters if m is not secure.leader()]
    logged = {m.address: m.log_path.stat().st_size for m in others}

    def forwarded_to() -> list[str]:
        # A holder dropped from the forward would sync the version after the commit instead.
        return [m.address for m in others if "installed the forwarded copy of 'tls-w2'"
                in m.log_path.read_text(errors="replace")[logged[m.address]:]]

    with client(secure) as alice:
        assert alice.create("tls-w2", data, replication_factor=3, write_quorum=2).acknowledged
        holder, = wait_until(forwarded_to, what="a holder installing the forwarded copy")
        assert alice.read("tls-w2") == data
    assert holder in logged


def test_a_ticket_is_never_read_in_plaintext_nor_by_a_caller_that_does_not_trust_the_master(
        secure: LocalCluster) -> None:
    data = os.urandom(2 * MiB)
    with client(secure) as alice:
        alice.create("tls-ticket", data)
    leader = secure.leader().address
    given = offer(secure, leader, "tls-ticket", len(data))
    got = bytearray()
    # A caller speaking plaintext: the master reads nothing it sent, its ticket included.
    with pytest.raises(DataChannelUnusable, match=r"data channel 127\.0\.0\.1:\d+"):
        receive("127.0.0.1", given.data_port, given.ticket, len(data), 5.0, got.extend)
    # A caller that does not trust the master's certificate (the system's roots only).
    with pytest.raises(DataChannelUnusable, match="TLS certificate not trusted"):
        receive("127.0.0.1", given.data_port, given.ticket, len(data), 5.0, got.extend,
                client_context(None, None, None))
    assert not got
    # The ticket is still unused: the caller with the cluster's CA takes it.
    trusted = secure.credentials("alice").data_tls()
    receive("127.0.0.1", given.data_port, given.ticket, len(data), 5.0, got.extend, trusted)
    assert bytes(got) == data


def test_a_client_whose_channel_handshake_fails_reads_through_grpc(
        secure: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(3 * MiB + 1)
    with client(secure) as alice:
        alice.create("tls-fallback", data, replication_factor=3)
        assert alice.wait_for_replication(["tls-fallback"], 3, timeout=30).reached
    with client(secure) as c:
        untrusted = client_context(None, None, None)
        c._router.data_channels.tls = lambda: untrusted
        before = total(secure, SENT)
        with caplog.at_level(logging.WARNING, logger="blobha.dataplane"):
            assert c.read("tls-fallback") == data
        assert "TLS certificate not trusted" in caplog.text
        assert "use the gRPC stream for the next" in caplog.text
        assert total(secure, SENT) == before


def test_in_mtls_mode_the_channel_wants_a_client_certificate(mtls: LocalCluster) -> None:
    c = mtls
    data = os.urandom(2 * MiB)
    uploads = total(c, UPLOADS)
    with client(c) as alice:
        alice.create("mtls-model", data)
        assert total(c, UPLOADS) > uploads  # the client's certificate opened the channel
    leader = c.leader().address
    given = offer(c, leader, "mtls-model", len(data))
    creds = c.credentials("alice")
    no_certificate = client_context(creds.ca, None, None)
    got = bytearray()
    with pytest.raises(DataChannelUnusable):
        receive("127.0.0.1", given.data_port, given.ticket, len(data), 5.0, got.extend,
                no_certificate)
    assert not got
    receive("127.0.0.1", given.data_port, given.ticket, len(data), 5.0, got.extend,
            creds.data_tls())
    assert bytes(got) == data
