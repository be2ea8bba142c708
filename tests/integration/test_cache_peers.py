"""Node caches fetching from each other against a real cluster: pieces from peers are checked,
a corrupt or dying peer costs only a retry, and no peer serves without a valid grant."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.harness import client_for, wait_until

from blobha.cache import BlobCache
from blobha.cache.peers import wire
from blobha.cache.peers.fetch import Totals
from blobha.cache.peers.server import PeerServer, Served
from blobha.cache.peers.settings import PeerSettings
from blobha.core.digest import digest_bytes
from blobha.core.errors import NotAuthorized
from blobha.core.grants import Grant, make_grant
from blobha.ops.localcluster import LocalCluster
from blobha.wire.status import PeerPlan

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
SIZE = 6 * MiB


def _peer(cluster: LocalCluster, key: str, path: Path, server_cls: type[PeerServer] = PeerServer
          ) -> PeerServer:
    """A peer holding ``path`` as ``key``'s current version, announced to the masters."""
    server = server_cls(PeerSettings(), "127.0.0.1")
    with client_for(cluster, "alice") as alice:
        plan = alice.peer_plan(key, 0, server.address, complete=True)
    server.offer(Served(key, plan.version, plan.size, plan.chunk_size, plan.serve_key,
                        path, None))
    return server


def _grant_for(plan: PeerPlan, peer: str) -> Grant:
    """The plan's grant for asking ``peer``."""
    macs = dict(plan.peer_grants)
    assert peer in macs, (peer, plan.peers)
    return Grant(plan.grant_user, plan.key, plan.version, plan.grant_expires,
                 plan.grant_requester, macs[peer])


def _good_peer(cluster: LocalCluster, key: str, data: bytes, tmp_path: Path) -> PeerServer:
    """A peer holding a true copy of ``data``."""
    good = tmp_path / "good"
    good.write_bytes(data)
    return _peer(cluster, key, good)


@pytest.fixture
def blob(cluster: LocalCluster, tmp_path: Path, request: pytest.FixtureRequest
         ) -> Iterator[tuple[str, bytes]]:
    key = f"peers-{request.node.name}"[:100]
    data = os.urandom(SIZE)
    with client_for(cluster, "alice") as alice:
        alice.create(key, data, acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication([key], min_replication=3, timeout=30)
    yield key, data


def _fetch(cluster: LocalCluster, root: Path, key: str, user: str = "alice") -> bytes:
    with BlobCache(root, cluster.cluster, user=user, peers=True) as cache:
        return cache.get(key).path.read_bytes()


def _from_peers(root: Path) -> int:
    """The node cache's own count of the bytes peers served it (in stats.json)."""
    with BlobCache(root, "127.0.0.1:1") as cache:
        stats = cache.stats()
    assert stats.bytes_from_peers <= stats.bytes_downloaded
    return stats.bytes_from_peers


def test_pieces_come_from_a_peer(cluster: LocalCluster, tmp_path: Path,
                                 blob: tuple[str, bytes]) -> None:
    key, data = blob
    peer = _good_peer(cluster, key, data, tmp_path)
    try:
        before = Totals.peer_bytes
        assert digest_bytes(_fetch(cluster, tmp_path / "node", key)) == digest_bytes(data)
        assert Totals.peer_bytes > before
        # Counted by the peer once its send returned, maybe after the requester had it all.
        wait_until(lambda: sum(s.served_bytes for s in peer.served())
                   == Totals.peer_bytes - before, 10)
        assert _from_peers(tmp_path / "node") == Totals.peer_bytes - before
    finally:
        peer.stop()


def test_a_corrupt_peer_is_detected_avoided_and_the_download_completes(
        cluster: LocalCluster, tmp_path: Path, blob: tuple[str, bytes]) -> None:
    key, data = blob
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(b ^ 0xFF for b in data))  # every piece wrong
    peer = _peer(cluster, key, bad)
    try:
        bad_before, peer_before = Totals.bad_pieces, Totals.peer_bytes
        assert _fetch(cluster, tmp_path / "node", key) == data
        # Dropped at its first bad piece (a second may have been under way already).
        assert 1 <= Totals.bad_pieces - bad_before <= 2
        assert Totals.peer_bytes == peer_before
        assert _from_peers(tmp_path / "node") == 0  # a bad piece is not a byte served
        assert sum(s.served_bytes for s in peer.served()) <= 2 * MiB
    finally:
        peer.stop()


#: A peer in a process of its own, paced to 1 MiB/s so that it can be killed mid-transfer: it
#: announces itself, then says "served" after each piece it sends.
_PEER_PROCESS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from blobha.cache.peers.server import PeerServer, Served
    from blobha.cache.peers.settings import PeerSettings
    from blobha.client import Client

    cluster, key, path = sys.argv[1:4]

    class Telling(PeerServer):
        def _answer(self, conn):
            before = sum(s.served_bytes for s in self.served())
            going = super()._answer(conn)
            if sum(s.served_bytes for s in self.served()) > before:
                print("served", flush=True)
            return going

    server = Telling(PeerSettings(upload_bytes_per_sec=1024 * 1024), "127.0.0.1")
    with Client(cluster, user="alice", timeout=30) as alice:
        plan = alice.peer_plan(key, 0, server.address, complete=True)
    server.offer(Served(key, plan.version, plan.size, plan.chunk_size, plan.serve_key,
                        Path(path), None))
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_a_peer_killed_mid_transfer_costs_only_a_retry(
        cluster: LocalCluster, tmp_path: Path, blob: tuple[str, bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blobha.cache.peers")
    key, data = blob
    good = tmp_path / "good"
    good.write_bytes(data)
    peer = subprocess.Popen([sys.executable, "-P", "-c", _PEER_PROCESS, cluster.cluster, key,
                             str(good)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert peer.stdout is not None
        assert peer.stdout.readline().strip() == "ready"
        got: list[bytes] = []
        before = Totals.peer_bytes
        fetch = threading.Thread(target=lambda: got.append(
            _fetch(cluster, tmp_path / "node", key)))
        fetch.start()
        # Killed once it has sent a piece, while it sends the next ones (1 MiB/s).
        assert peer.stdout.readline().strip() == "served"
        peer.kill()
        fetch.join(60)
        assert not fetch.is_alive() and got == [data]
        assert Totals.peer_bytes - before >= MiB  # the piece it sent before it died was used
        # Its next piece (paced) or the connection for it failed: fetched elsewhere.
        assert "fetching it elsewhere" in caplog.text or "unreachable" in caplog.text
    finally:
        peer.kill()
        peer.wait(10)


def _ask(peer: PeerServer, key: str, version: int, grant: Grant) -> wire.Answer:
    host, port = peer.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(wire.Request(key, version, 0, grant).encode())
        return wire.read_answer(conn)


def test_no_piece_without_read_or_a_valid_grant(cluster: LocalCluster, tmp_path: Path,
                                               blob: tuple[str, bytes]) -> None:
    key, data = blob
    peer = _good_peer(cluster, key, data, tmp_path)
    try:
        # bob may not READ: no plan, so no grant, and no download at all.
        with pytest.raises(NotAuthorized):
            _fetch(cluster, tmp_path / "bob", key, user="bob")
        with client_for(cluster, "bob") as bob, pytest.raises(NotAuthorized):
            bob.peer_plan(key, 0)
        assert sum(s.served_bytes for s in peer.served()) == 0
        with client_for(cluster, "alice") as alice:
            plan = alice.peer_plan(key, 0)
            # The key the peer checks grants under (its holder's, for its address).
            peer_key = alice.peer_plan(key, 0, peer.address, complete=True).serve_key
        real = _grant_for(plan, peer.address)
        assert real.requester == "127.0.0.1"  # the host the master saw the plan asked from
        # A grant bob made up, and alice's grant presented as bob's: refused.
        forged = Grant("bob", key, plan.version, plan.grant_expires, "127.0.0.1", "00" * 32)
        answer = _ask(peer, key, plan.version, forged)
        assert (answer.status, answer.reason) == (wire.REFUSED,
                                                  "grant refused: the grant does not verify")
        stolen = Grant("bob", key, plan.version, plan.grant_expires, real.requester, real.mac)
        assert _ask(peer, key, plan.version, stolen).status == wire.REFUSED
        # A grant past its lifetime, made under the right key: refused as expired.
        expired = make_grant(peer_key, "alice", key, plan.version, 1, "127.0.0.1")
        answer = _ask(peer, key, plan.version, expired)
        assert answer.status == wire.REFUSED and "expired" in answer.reason
        # The real grant gets the piece.
        answer = _ask(peer, key, plan.version, real)
        assert answer.status == wire.OK and answer.size == MiB
        assert peer.refusals == 3
    finally:
        peer.stop()


#: A later process of the node: a cache hit, then it serves what it found, until stdin ends.
_HIT_PROCESS = textwrap.dedent("""
    import sys
    from blobha.cache import BlobCache
    from blobha.cache.peers.node import node
    from blobha.cache.peers.settings import PeerSettings

    cluster, root, key = sys.argv[1:4]
    with BlobCache(root, cluster, user="alice", peers=True) as cache:
        cache.get(key)
        print(node(PeerSettings(), cache._cluster()).address, flush=True)
        sys.stdin.read()
""")


def test_a_later_process_serves_the_versions_it_finds_installed(
        cluster: LocalCluster, tmp_path: Path, blob: tuple[str, bytes]) -> None:
    key, data = blob
    root = tmp_path / "node"
    assert _fetch(cluster, root, key) == data  # through peers: the version key is kept
    hit = subprocess.Popen([sys.executable, "-P", "-c", _HIT_PROCESS, cluster.cluster,
                            str(root), key], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert hit.stdout is not None
        address = hit.stdout.readline().strip()
        host, port = address.rsplit(":", 1)

        def piece() -> bytes | None:
            # Named in plans, and serving, once its announcement brought its key.
            with client_for(cluster, "alice") as alice:
                plan = alice.peer_plan(key, 0)
            if address not in dict(plan.peer_grants):
                return None
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(wire.Request(key, plan.version, 2,
                                          _grant_for(plan, address)).encode())
                answer = wire.read_answer(conn)
                if answer.status != wire.OK:
                    return None
                assert answer.have == "all"
                return wire.recv_exact(conn, answer.size)

        assert wait_until(piece, 20, "the later process serving") == data[2 * MiB:3 * MiB]
    finally:
        hit.kill()
        hit.wait(10)
