"""Peer serving on a TLS cluster: pieces over TLS with the caches' client certificates, and
no peers at all for a cache that has no certificate to serve with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.clusters import FAST

from blobha.cache import BlobCache
from blobha.cache.peers.fetch import Totals
from blobha.cache.peers.server import PeerServer, Served
from blobha.cache.peers.settings import PeerSettings
from blobha.client import Client
from blobha.ops.localcluster import LocalCluster
from blobha.wire.datatls import server_context

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def _holding(alice: Client, key: str, data: bytes, peer: PeerServer, tmp_path: Path) -> None:
    """``peer`` holds a copy of ``key``'s current version, announced to the masters."""
    plan = alice.peer_plan(key, 0, peer.address, complete=True)
    held = tmp_path / "held"
    held.write_bytes(data)
    peer.offer(Served(key, plan.version, plan.size, plan.chunk_size, plan.serve_key, held,
                      None))


def test_pieces_cross_tls_between_caches_with_certificates(mtls: LocalCluster,
                                                           tmp_path: Path) -> None:
    data = os.urandom(4 * MiB)
    creds = mtls.credentials("alice")
    assert creds.cert and creds.key and creds.ca
    with Client(mtls.cluster, user="alice", credentials=creds, timeout=30) as alice:
        alice.create("tls-peers", data, replication_factor=2)
        alice.wait_for_replication(["tls-peers"], min_replication=2, timeout=30)
        peer = PeerServer(PeerSettings(), "127.0.0.1",
                          server_context(creds.cert, creds.key, creds.ca, False))
        try:
            _holding(alice, "tls-peers", data, peer, tmp_path)
            before = Totals.peer_bytes
            with BlobCache(tmp_path / "node", client=alice, peers=True) as cache:
                assert cache.get("tls-peers").path.read_bytes() == data
            assert Totals.peer_bytes > before
        finally:
            peer.stop()


def test_without_a_certificate_a_cache_on_a_tls_cluster_uses_no_peers(
        tmp_path: Path) -> None:
    c = LocalCluster(tmp_path / "tls", nodes=2, base_port=0, overrides=FAST, tls=True)
    try:
        c.start()
        data = os.urandom(3 * MiB)
        creds = c.credentials("alice")  # a CA and a token: no certificate of its own
        assert creds.ca and not creds.cert
        with Client(c.cluster, user="alice", credentials=creds, timeout=30) as alice:
            alice.create("tls-no-cert", data, replication_factor=2)
            alice.wait_for_replication(["tls-no-cert"], min_replication=2, timeout=30)
            # A plaintext peer that says it holds the version.
            peer = PeerServer(PeerSettings(), "127.0.0.1")
            try:
                _holding(alice, "tls-no-cert", data, peer, tmp_path)
                before = Totals.peer_bytes
                with BlobCache(tmp_path / "node", client=alice, peers=True) as cache:
                    assert cache.get("tls-no-cert").path.read_bytes() == data
                assert Totals.peer_bytes == before  # every byte from the replicas, over TLS
                assert sum(s.served_bytes for s in peer.served()) == 0
                # ... and it announced no address of its own to serve from.
                assert alice.peer_plan("tls-no-cert", 0).peers == (peer.address,)
            finally:
                peer.stop()
    finally:
        c.stop()
