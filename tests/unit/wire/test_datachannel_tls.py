"""The data channel over TLS (blobha.wire.datachannel with blobha.wire.datatls): a real store,
real certificates and a real socket on 127.0.0.1. Downloads and uploads in their TLS form, the
frames an upload over TLS is sent in, and what a caller without the right trust gets."""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

from blobha.core.digest import CHUNK_SIZE, digest_bytes
from blobha.master.edge.datachannel import DataChannelServer
from blobha.ops.certgen import CertFiles, issue, make_ca
from blobha.store.local import LocalStore
from blobha.wire.datachannel import (
    FRAME_HEAD,
    MAGIC,
    OK,
    DataChannelUnusable,
    receive,
    send_upload,
)
from blobha.wire.datatls import ReloadingServerContext, client_context

DATA = os.urandom(3 * CHUNK_SIZE + 12345)


class Certificates:
    def __init__(self, root: Path) -> None:
        self.ca = make_ca(root / "ca")
        self.master = issue(self.ca, root / "master", "master", "master", ["127.0.0.1"])
        self.alice = issue(self.ca, root / "alice", "alice", "alice")
        self.other_ca = make_ca(root / "other", "other")

    def client(self, who: CertFiles | None = None, ca: CertFiles | None = None
               ) -> ssl.SSLContext:
        return client_context(str((ca or self.ca).cert), str(who.cert) if who else None,
                              str(who.key) if who else None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates(tmp_path_factory.mktemp("certs"))


class Appends:
    def __init__(self, store: LocalStore) -> None:
        self.temp = store.new_temp("upload")

    def __call__(self, user: str, upload_id: str, offset: int, data: memoryview) -> int:
        self.temp.write_at(offset, data)
        return self.temp.size


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    s = LocalStore(tmp_path / "store")
    temp = s.new_temp("upload")
    temp.write_at(0, DATA)
    s.install("k", 1, temp, len(DATA), digest_bytes(DATA))
    yield s
    s.close()


def _plane(store: LocalStore, certs: Certificates, mtls: bool, appends: Appends
           ) -> Iterator[DataChannelServer]:
    tls = ReloadingServerContext(str(certs.master.cert), str(certs.master.key),
                                 str(certs.ca.cert), require_client_cert=mtls)
    p = DataChannelServer(store, "127.0.0.1", 0, max_connections=2, append=appends, tls=tls)
    p.start()
    yield p
    p.stop()
    appends.temp.discard()


@pytest.fixture
def plane(store: LocalStore, certs: Certificates) -> Iterator[DataChannelServer]:
    yield from _plane(store, certs, False, Appends(store))


@pytest.fixture
def mtls_plane(store: LocalStore, certs: Certificates) -> Iterator[DataChannelServer]:
    yield from _plane(store, certs, True, Appends(store))


def _offer(plane: DataChannelServer, offset: int = 0, end: int = len(DATA)) -> bytes:
    info = plane.store.info("k", 1)
    assert info is not None
    return plane.offer(info, offset, end)


def test_a_download_over_tls_brings_exactly_its_range(plane: DataChannelServer,
                                                      certs: Certificates) -> None:
    for offset, end in ((0, len(DATA)), (CHUNK_SIZE - 7, 2 * CHUNK_SIZE + 9), (5, 5)):
        got = bytearray()
        receive("127.0.0.1", plane.port, _offer(plane, offset, end), end - offset, 10.0,
                got.extend, certs.client())
        assert bytes(got) == DATA[offset:end]
    wait_until(lambda: plane.transfers == 3, what="three transfers counted")


def test_an_upload_over_tls_goes_in_frames_and_is_answered_with_the_total(
        plane: DataChannelServer, certs: Certificates) -> None:
    ticket = plane.offer_upload("alice", "up-1", 0)
    assert ticket is not None
    view = memoryview(DATA)
    # Pieces larger than a frame are split; the end is an empty frame.
    total = send_upload("127.0.0.1", plane.port, ticket, 10.0,
                        [view[:3 * CHUNK_SIZE], view[3 * CHUNK_SIZE:]], certs.client())
    assert total == len(DATA)
    append = plane._append
    assert isinstance(append, Appends)
    digest, _, size = append.temp.finish()
    assert (digest, size) == (digest_bytes(DATA), len(DATA))


def _raw_upload(plane: DataChannelServer, certs: Certificates) -> ssl.SSLSocket:
    """A TLS connection that presented an upload ticket and was told OK."""
    ticket = plane.offer_upload("alice", "up-1", 0)
    assert ticket is not None
    conn = certs.client().wrap_socket(socket.create_connection(("127.0.0.1", plane.port)),
                                      server_hostname="127.0.0.1")
    conn.settimeout(10)
    conn.sendall(MAGIC + ticket)
    assert conn.recv(len(MAGIC) + 1) == MAGIC + bytes([OK])
    return conn


def test_an_upload_cut_off_mid_frame_keeps_nothing_of_that_frame_and_gets_no_answer(
        plane: DataChannelServer, certs: Certificates) -> None:
    with _raw_upload(plane, certs) as conn:
        conn.sendall((1000).to_bytes(FRAME_HEAD, "big") + b"x" * 400)
        conn.shutdown(socket.SHUT_RDWR)
    append = plane._append
    assert isinstance(append, Appends)
    wait_until(lambda: not plane._conns, what="the master to end the connection")
    assert append.temp.size == 0  # the client resumes from GetUploadStatus


def test_a_frame_larger_than_allowed_ends_the_upload(plane: DataChannelServer,
                                                     certs: Certificates) -> None:
    with _raw_upload(plane, certs) as conn:
        conn.sendall((64 * 1024 * 1024).to_bytes(FRAME_HEAD, "big"))
        wait_until(lambda: not plane._conns, what="the master to end the connection")
        assert conn.recv(16) == b""


def test_a_caller_that_does_not_trust_the_master_gets_nothing(plane: DataChannelServer,
                                                              certs: Certificates) -> None:
    ticket = _offer(plane)
    got = bytearray()
    with pytest.raises(DataChannelUnusable, match="TLS certificate not trusted"):
        receive("127.0.0.1", plane.port, ticket, len(DATA), 5.0, got.extend,
                certs.client(ca=certs.other_ca))
    with pytest.raises(DataChannelUnusable):  # plaintext: the ticket is never read
        receive("127.0.0.1", plane.port, ticket, len(DATA), 5.0, got.extend)
    assert not got
    receive("127.0.0.1", plane.port, ticket, len(DATA), 5.0, got.extend, certs.client())
    assert bytes(got) == DATA


def test_in_mtls_mode_only_a_certificate_from_the_ca_opens_the_channel(
        mtls_plane: DataChannelServer, certs: Certificates) -> None:
    ticket = _offer(mtls_plane)
    got = bytearray()
    with pytest.raises(DataChannelUnusable):
        receive("127.0.0.1", mtls_plane.port, ticket, len(DATA), 5.0, got.extend,
                certs.client())
    assert not got
    receive("127.0.0.1", mtls_plane.port, ticket, len(DATA), 5.0, got.extend,
            certs.client(certs.alice))
    assert bytes(got) == DATA
