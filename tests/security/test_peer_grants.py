"""A reader whose READ is revoked, and who keeps everything its plans gave it (its own cache's
key, the key for another cache's address it announced as its own, grants for other caches)
and a cache of its own that lies: it cannot make a grant another cache accepts, and the
grants it holds die at their expiry, which no grant puts far off."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from pathlib import Path

import pytest
from support.harness import client_for, wait_until

from blobha.cache import BlobCache
from blobha.cache.peers import wire
from blobha.cache.peers.server import PeerServer, Served
from blobha.cache.peers.settings import PeerSettings
from blobha.core.errors import NotAuthorized
from blobha.core.grants import MAX_GRANT_SECS, Grant, make_grant
from blobha.ops.localcluster import LocalCluster
from blobha.wire.status import PeerPlan

MiB = 1024 * 1024
#: Grants this short, so that the test sees bob's run out.
GRANT_SECS = 8
#: The address bob's own cache announces (nothing listens: only its key is wanted).
BOB_CACHE = "127.0.0.1:9"


def _ask(peer: PeerServer, key: str, version: int, grant: Grant) -> wire.Answer:
    host, port = peer.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(wire.Request(key, version, 0, grant).encode())
        answer = wire.read_answer(conn)
        if answer.status == wire.OK:
            assert wire.recv_exact(conn, answer.size) is not None
        return answer


def _grant_for(plan: PeerPlan, peer: str) -> Grant:
    macs = dict(plan.peer_grants)
    assert peer in macs, (peer, plan.peers)
    return Grant(plan.grant_user, plan.key, plan.version, plan.grant_expires,
                 plan.grant_requester, macs[peer])


@pytest.mark.parametrize("fresh_cluster", [{"nodes": 1,
                                            "blobstore.peer.grant.secs": GRANT_SECS}],
                         indirect=True)
def test_a_revoked_reader_loses_peer_reads_within_a_grant_life(
        fresh_cluster: LocalCluster, tmp_path: Path) -> None:
    key = f"revoked-{os.getpid()}"
    data = os.urandom(2 * MiB)
    held = tmp_path / "alice-held"
    held.write_bytes(data)
    alice_cache = PeerServer(PeerSettings(), "127.0.0.1")
    try:
        with client_for(fresh_cluster, "alice") as alice, \
                client_for(fresh_cluster, "bob") as bob:
            alice.create(key, data, acl="u:alice:rwa,u:bob:r", replication_factor=1)
            # alice's cache holds the blob and announces it; the key it checks grants under
            # is its own, for its address.
            mine = alice.peer_plan(key, 0, alice_cache.address, complete=True)
            alice_cache.offer(Served(key, mine.version, mine.size, mine.chunk_size,
                                     mine.serve_key, held, None))

            # bob, a reader, plans with a cache of his own, and fetches a piece from alice's.
            plan = bob.peer_plan(key, 0, BOB_CACHE, False)
            assert alice_cache.address in plan.peers
            assert plan.serve_key and plan.serve_key != mine.serve_key
            real = _grant_for(plan, alice_cache.address)
            assert (real.user, real.requester) == ("bob", "127.0.0.1")
            assert real.expires <= time.time() + GRANT_SECS
            assert _ask(alice_cache, key, plan.version, real).status == wire.OK
            # bob announces alice's cache's address as his own (a master cannot tell): the
            # key he is given for it is his, not the one alice's cache checks under.
            claimed = bob.peer_plan(key, 0, alice_cache.address, complete=True).serve_key
            assert claimed and claimed != mine.serve_key
            alice.peer_plan(key, 0, alice_cache.address, complete=True)  # hers again

            alice.set_acl(key, "u:alice:rwa")
            # No new plan, so no new grants; no download either.
            with pytest.raises(NotAuthorized):
                bob.peer_plan(key, 0, BOB_CACHE, False)
            with pytest.raises(NotAuthorized), \
                    BlobCache(tmp_path / "bob-node", client=bob, peers=True) as cache:
                cache.get(key)

        # What bob can make with what he holds: refused by alice's cache, every one.
        now = time.time()
        own_key = plan.serve_key  # his cache's key: it opens his cache only
        forged = {
            "his own key": make_grant(own_key, "bob", key, plan.version, now + 60,
                                      "127.0.0.1"),
            "his own key, as alice": make_grant(own_key, "alice", key, plan.version,
                                                now + 60, "127.0.0.1"),
            "the key for alice's address": make_grant(claimed, "bob", key, plan.version,
                                                      now + 60, "127.0.0.1"),
            "his grant, far ahead": dataclasses.replace(real, expires=4e9),
            "his grant, NaN": dataclasses.replace(real, expires=math.nan),
            "his grant, infinite": dataclasses.replace(real, expires=math.inf),
            "his grant, another host": dataclasses.replace(real, requester="10.0.0.9"),
            "his grant, as alice": dataclasses.replace(real, user="alice"),
        }
        for what, grant in forged.items():
            answer = _ask(alice_cache, key, plan.version, grant)
            assert (answer.status, answer.reason) == (
                wire.REFUSED, "grant refused: the grant does not verify"), what
        # Had a master made them (the key in the wrong hands): a grant for another node, or
        # one ending far ahead, is refused still.
        for grant, why in [
                (make_grant(mine.serve_key, "bob", key, plan.version, now + 60, "10.0.0.9"),
                 "for requests from 10.0.0.9, not from 127.0.0.1"),
                (make_grant(mine.serve_key, "bob", key, plan.version,
                            now + MAX_GRANT_SECS + 60, "127.0.0.1"), "ahead")]:
            answer = _ask(alice_cache, key, plan.version, grant)
            assert answer.status == wire.REFUSED and why in answer.reason, answer

        # The grant a master made him before the revocation is his until it expires (at
        # most blobstore.peer.grant.secs; served until then): then he gets nothing.
        wait_until(lambda: _ask(alice_cache, key, plan.version, real).status == wire.REFUSED,
                   GRANT_SECS + 5, "bob's last grant to expire")
        assert time.time() >= real.expires
        served = alice_cache.served()[0].served_bytes
        answer = _ask(alice_cache, key, plan.version, real)
        assert answer.status == wire.REFUSED and "expired" in answer.reason
        for grant in forged.values():
            assert _ask(alice_cache, key, plan.version, grant).status == wire.REFUSED
        assert alice_cache.served()[0].served_bytes == served
    finally:
        alice_cache.stop()
