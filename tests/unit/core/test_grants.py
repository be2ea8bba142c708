"""Peer grants: made by a master under the serving cache's own key, bound to the requesting
host, and checked by that cache with its key alone."""

from __future__ import annotations

import dataclasses
import math

import pytest

from blobha.core.grants import (
    MAX_GRANT_SECS,
    Grant,
    GrantRefused,
    check_grant,
    host_key,
    make_grant,
    peer_root,
    serve_key,
)

ROOT = peer_root("cluster-secret")
ALICE_CACHE = "10.0.0.1:7000"
SK = serve_key(ROOT, "model", 3, "ab" * 16, ALICE_CACHE, "alice")
BOB = "10.0.0.2"
NOW = 1000.0


def _grant(expires: float = NOW + 60, requester: str = BOB, skey: bytes = SK) -> Grant:
    return make_grant(skey, "bob", "model", 3, expires, requester)


def test_a_fresh_grant_verifies() -> None:
    check_grant(SK, _grant(), "model", 3, BOB, now=NOW)


def test_expired_grant_is_refused() -> None:
    with pytest.raises(GrantRefused, match="expired"):
        check_grant(SK, _grant(), "model", 3, BOB, now=NOW + 60)


def test_a_grant_is_for_the_requesting_host_only() -> None:
    with pytest.raises(GrantRefused, match=r"for requests from 10\.0\.0\.2, not from 10\.0\.0\.3"):
        check_grant(SK, _grant(), "model", 3, "10.0.0.3", now=NOW)


@pytest.mark.parametrize("change", [
    {"user": "mallory"}, {"expires": NOW + 99}, {"mac": "00" * 32},
    {"requester": "10.0.0.3"},
])
def test_a_changed_grant_does_not_verify(change: dict[str, object]) -> None:
    g = dataclasses.replace(_grant(), **change)  # type: ignore[arg-type]
    with pytest.raises(GrantRefused, match="does not verify"):
        check_grant(SK, g, "model", 3, str(change.get("requester", BOB)), now=NOW)


def test_a_grant_is_for_one_version_only() -> None:
    g = _grant()
    with pytest.raises(GrantRefused, match="is for"):
        check_grant(SK, g, "model", 4, BOB, now=NOW)
    # Another version's key (a new digest, another secret) does not verify it either.
    for other in (serve_key(ROOT, "model", 3, "cd" * 16, ALICE_CACHE, "alice"),
                  serve_key(peer_root("other"), "model", 3, "ab" * 16, ALICE_CACHE, "alice")):
        with pytest.raises(GrantRefused, match="does not verify"):
            check_grant(other, g, "model", 3, BOB, now=NOW)


def test_a_cache_key_opens_no_other_cache() -> None:
    """bob's cache holds the key it serves under: a grant it makes with it is refused by
    alice's cache, whatever it says."""
    bob_key = serve_key(ROOT, "model", 3, "ab" * 16, "10.0.0.2:7000", "bob")
    # Nor does the key bob is given when he announces alice's cache's address as his own.
    claimed = serve_key(ROOT, "model", 3, "ab" * 16, ALICE_CACHE, "bob")
    for key in (bob_key, claimed):
        assert key != SK
        with pytest.raises(GrantRefused, match="does not verify"):
            check_grant(SK, _grant(skey=key), "model", 3, BOB, now=NOW)


@pytest.mark.parametrize("expires", [math.nan, math.inf, -math.inf, NOW + 10.5])
def test_an_expiry_without_one_text_is_refused(expires: float) -> None:
    # Even with a MAC made over its text by whoever holds the key.
    g = dataclasses.replace(_grant(), expires=expires)
    forged = make_grant(SK, "bob", "model", 3, NOW + 10, BOB)
    g = dataclasses.replace(g, mac=forged.mac)
    with pytest.raises(GrantRefused, match="does not verify"):
        check_grant(SK, g, "model", 3, BOB, now=NOW)


def test_a_far_future_grant_is_refused_even_under_the_right_key() -> None:
    check_grant(SK, _grant(NOW + MAX_GRANT_SECS), "model", 3, BOB, now=NOW)
    with pytest.raises(GrantRefused, match="ahead"):
        check_grant(SK, _grant(NOW + MAX_GRANT_SECS + 1), "model", 3, BOB, now=NOW)
    with pytest.raises(GrantRefused, match="ahead"):
        check_grant(SK, _grant(4e12), "model", 3, BOB, now=NOW)


def test_no_key_verifies_nothing() -> None:
    # An HMAC under an empty key is one anybody can make.
    with pytest.raises(GrantRefused, match="does not verify"):
        check_grant(b"", _grant(skey=b""), "model", 3, BOB, now=NOW)


def test_hosts_have_one_text() -> None:
    assert host_key("127.0.0.1") == "127.0.0.1"
    assert host_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert host_key("[::1]") == "::1"
    assert host_key("[2001:DB8::1]") == "2001:db8::1"
    assert host_key("node-1.example") == ""
    assert host_key("") == ""


def test_the_root_is_not_the_cluster_secret() -> None:
    assert ROOT != b"cluster-secret" and len(ROOT) == 32


def test_the_host_a_master_binds_grants_to_is_the_callers() -> None:
    from blobha.master.peerplans import caller_host

    assert caller_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert caller_host("ipv6:%5B::1%5D:51234") == "::1"  # gRPC percent-encodes the brackets
    assert caller_host("ipv6:[::ffff:10.0.0.7]:51234") == "10.0.0.7"
    assert caller_host("unix:/run/blobha.sock") == ""
    assert caller_host("") == ""
