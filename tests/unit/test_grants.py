"""Peer grants: made by a master, checked by a peer with only the version key."""

from __future__ import annotations

import dataclasses

import pytest

from blobha.core.grants import GrantRefused, check_grant, make_grant, peer_root, version_key

ROOT = peer_root("cluster-secret")
VK = version_key(ROOT, "model", 3, "ab" * 16)


def test_a_fresh_grant_verifies() -> None:
    g = make_grant(VK, "alice", "model", 3, 1000)
    check_grant(VK, g, "model", 3, now=999)


def test_expired_grant_is_refused() -> None:
    g = make_grant(VK, "alice", "model", 3, 1000)
    with pytest.raises(GrantRefused, match="expired"):
        check_grant(VK, g, "model", 3, now=1000)


@pytest.mark.parametrize("change", [
    {"user": "mallory"}, {"expires": 99999.0}, {"mac": "00" * 32},
])
def test_a_changed_grant_does_not_verify(change: dict[str, object]) -> None:
    g = dataclasses.replace(make_grant(VK, "alice", "model", 3, 1000), **change)  # type: ignore[arg-type]
    with pytest.raises(GrantRefused, match="does not verify"):
        check_grant(VK, g, "model", 3, now=0)


def test_a_grant_is_for_one_version_only() -> None:
    g = make_grant(VK, "alice", "model", 3, 1000)
    with pytest.raises(GrantRefused, match="is for"):
        check_grant(VK, g, "model", 4, now=0)
    # Another version's key (a new digest, another secret) does not verify it either.
    for other in (version_key(ROOT, "model", 3, "cd" * 16),
                  version_key(peer_root("other"), "model", 3, "ab" * 16)):
        with pytest.raises(GrantRefused):
            check_grant(other, g, "model", 3, now=0)


def test_the_root_is_not_the_cluster_secret() -> None:
    assert ROOT != b"cluster-secret" and len(ROOT) == 32
