"""PeerPlan against a real cluster: READ checked, peers announced and named, a grant per peer
that verifies under that peer's own key only."""

from __future__ import annotations

import pytest
from support.harness import client_for as client

from blobha.core.digest import chunk_digest
from blobha.core.errors import NotAuthorized
from blobha.core.grants import Grant, GrantRefused, check_grant
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration


def test_a_plan_names_peers_and_carries_a_grant(cluster: LocalCluster) -> None:
    data = bytes(range(256)) * 4096 * 3  # 3 MiB
    with client(cluster, "alice") as alice, client(cluster, "bob") as bob:
        alice.create("plan-key", data, acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication(["plan-key"], min_replication=3, timeout=30)
        first = alice.peer_plan("plan-key", peer_address="10.0.0.1:7000")
        assert first.size == len(data) and first.peers == ()
        assert list(first.chunk_digests) == [chunk_digest(data[i:i + (1 << 20)])
                                             for i in range(0, len(data), 1 << 20)]
        assert len(first.replicas) == 3
        second = alice.peer_plan("plan-key", peer_address="10.0.0.2:7000", complete=True)
        assert second.peers == ("10.0.0.1:7000",)
        assert alice.peer_plan("plan-key").peers != ()
        # A grant for the one peer it names, under that peer's own key, bound to the host
        # the master saw the call from.
        assert [p for p, _ in second.peer_grants] == ["10.0.0.1:7000"]
        grant = Grant(second.grant_user, "plan-key", second.version, second.grant_expires,
                      second.grant_requester, second.peer_grants[0][1])
        assert grant.user == "alice" and grant.requester == "127.0.0.1"
        check_grant(first.serve_key, grant, "plan-key", second.version, "127.0.0.1")
        # The caller's own key is for its own address: it verifies no grant for another.
        with pytest.raises(GrantRefused, match="does not verify"):
            check_grant(second.serve_key, grant, "plan-key", second.version, "127.0.0.1")
        assert alice.peer_plan("plan-key").serve_key == b""  # no address: nothing to serve
        with pytest.raises(NotAuthorized):
            bob.peer_plan("plan-key", peer_address="10.0.0.3:7000")
        # bob announced nothing: refused before it was recorded.
        assert "10.0.0.3:7000" not in alice.peer_plan("plan-key").peers
