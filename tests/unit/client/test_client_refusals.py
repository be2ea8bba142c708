"""Refusals by the masters: writes refused by every master, tokens the masters have not
loaded yet, and TLS mismatches (which setting to change, and when the client gives up)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from support.client_fakes import (
    M1,
    M2,
    M3,
    FakeClock,
    FakeCluster,
)

from blobha.client import Client, ClientLimits
from blobha.client import transport as transport_mod
from blobha.core.errors import (
    BlobError,
    InvalidArgument,
    NotAuthorized,
    TlsMismatch,
    Unauthenticated,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb


def _refusing(cluster: FakeCluster, error: BlobError, who: Sequence[str]) -> None:
    """Masters in ``who`` refuse every ClusterSummary (the leader search) with ``error``."""
    real = cluster._ClusterSummary

    def summary(address: str, request: Any) -> pb.ClusterSummaryResponse:
        if address in who:
            raise error
        return real(address, request)

    cluster._ClusterSummary = summary  # type: ignore[method-assign]


@pytest.mark.parametrize("path", ["put", "resumable"])
@pytest.mark.parametrize(
    "error",
    [
        Unauthenticated("no token given; this cluster requires one"),
        Unauthenticated("the token was refused"),
        NotAuthorized("user 'mallory' may not do that"),
        InvalidArgument("bad request"),
    ],
)
def test_a_write_refused_by_every_master_fails_at_once(
    client: Client, cluster: FakeCluster, clock: FakeClock, error: BlobError, path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A missing or wrong token is refused by the leader search itself: that is about the
    # caller, not the cluster, so it is reported as it is instead of retried until the
    # deadline and reported as "unavailable".
    if path == "resumable":
        client.limits = ClientLimits(put_max_bytes=-1)
    _refusing(cluster, error, [M1, M2, M3])
    with pytest.raises(type(error)) as info:
        client.create("k", b"x")
    assert info.value is error
    if isinstance(error, Unauthenticated):
        # A token added just now may not be loaded yet: asked again for a few seconds only.
        patience = client.limits.refusal_patience_secs
        assert patience <= clock.now - 1000.0 < 2 * patience
        assert clock.sleeps and cluster.count("ClusterSummary") > 3
    else:
        assert clock.now == 1000.0 and clock.sleeps == []
        assert cluster.count("ClusterSummary") == 3
    assert cluster.count("Put") == cluster.count("BeginUpload") == 0


def test_a_token_refused_at_first_is_accepted_once_the_masters_load_it(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # The masters re-read their token files at most once a second: a brand-new token is
    # refused by all of them for a moment, then accepted.
    refusing = [M1, M2, M3]
    _refusing(cluster, Unauthenticated("the token was refused"), refusing)
    asked = cluster._ClusterSummary

    def loaded_after_a_second(address: str, request: Any) -> pb.ClusterSummaryResponse:
        if clock.now - 1000.0 >= 1.0:
            refusing.clear()
        return asked(address, request)

    cluster._ClusterSummary = loaded_after_a_second  # type: ignore[method-assign]
    client.create("k", b"x")
    assert cluster.blobs["k"] == (1, b"x")
    # Refused, asked again after a pause, accepted well within the patience.
    assert clock.sleeps and cluster.count("ClusterSummary") > 3
    assert clock.now - 1000.0 < client.limits.refusal_patience_secs


def test_a_refusal_is_reported_before_other_masters_unavailability(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    cluster.down = {M1, M3}
    _refusing(cluster, Unauthenticated("the token was refused"), [M2])
    with pytest.raises(Unauthenticated, match="token was refused"):
        client.delete("k")
    assert clock.now - 1000.0 < 2 * client.limits.refusal_patience_secs


_OTHER_CA = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1:"
             " Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA"
             " routines:OPENSSL_internal:BAD_SIGNATURE: certificate signature failure: OK")


_NOT_TLS = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls"
            " handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL"
            " routines:OPENSSL_internal:WRONG_VERSION_NUMBER")


_CLOSED = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1:"
           " Socket closed")


# The same close, when the client's first bytes had arrived before it (the kernel resets).
_RESET = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1:"
          " recvmsg:Connection reset by peer (104)")


@pytest.mark.parametrize(("details", "advice"), [
    (_OTHER_CA, "did not verify against the CA given in --ca"),
    (_NOT_TLS, "it does not use TLS; drop --ca"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom"
     " verification check failed with error: UNAUTHENTICATED: Hostname Verification Check"
     " failed.", "its certificate does not name the address dialled"),
])
def test_a_failed_tls_handshake_says_which_setting_to_change(details: str, advice: str) -> None:
    failure = transport_mod.handshake_failure("m1:1", details, True)
    assert isinstance(failure, transport_mod.HandshakeFailed)
    assert failure.addresses == {"m1:1"}
    assert advice in str(failure) and "m1:1" in str(failure) and details in str(failure)


@pytest.mark.parametrize("details", [_CLOSED, _RESET])
@pytest.mark.parametrize(("tls", "hint"), [
    (False, "if the masters use TLS, pass --ca"),
    (True, "if the masters ask for client certificates, pass --cert/--tls-key"),
])
def test_a_connection_closed_at_once_only_hints_at_tls(tls: bool, hint: str,
                                                       details: str) -> None:
    # What a TLS master does to a plain-text client, but also a proxy with no master behind
    # it: retried as unavailability, with the likely fix in the message.
    failure = transport_mod.handshake_failure("m1:1", details, tls)
    assert isinstance(failure, Unavailable)
    assert not isinstance(failure, transport_mod.HandshakeFailed)
    assert hint in str(failure)


@pytest.mark.parametrize("details", [
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection"
    " refused",
    "Socket closed",  # a connection that was up and went away: the master, not the settings
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Handshake"
    " read failed (Socket closed)",  # a TLS client behind a proxy with no master behind it
    "keepalive watchdog timeout",
])
def test_other_unavailability_is_not_taken_for_a_tls_mismatch(details: str) -> None:
    for tls in (False, True):
        failure = transport_mod.handshake_failure("m1:1", details, tls)
        assert not isinstance(failure, transport_mod.HandshakeFailed)
        if "Handshake read failed" in details:
            assert failure is None  # no hint either: nothing points at the client's settings


def _without_tls_agreement(cluster: FakeCluster, who: Sequence[str],
                           agreed_after: float | None = None,
                           clock: FakeClock | None = None) -> None:
    """Every call to a master in ``who`` fails its TLS handshake (until ``agreed_after``
    seconds of ``clock`` have passed, when given)."""
    real = cluster._enter

    def enter(address: str, method: str) -> None:
        agreed = (agreed_after is not None and clock is not None
                  and clock.now - 1000.0 >= agreed_after)
        if address in who and not agreed:
            cluster.calls.append((address, method))
            raise transport_mod.handshake_failure(address, _OTHER_CA, True) or AssertionError
        real(address, method)

    cluster._enter = enter  # type: ignore[method-assign]


@pytest.mark.parametrize("operation", ["put", "resumable", "get_meta", "read", "wait"])
def test_a_tls_mismatch_with_every_master_fails_soon_as_such(
    client: Client, cluster: FakeCluster, clock: FakeClock, operation: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The client's --ca (or certificate) does not match the masters': every call would fail
    # the same way until the timeout (30 s here). It is asked again for a few seconds only,
    # as certificates being replaced could explain it, and then reported for what it is.
    cluster.blobs["k"] = (1, b"x")
    cluster.holders["k"] = [M1, M2, M3]
    if operation == "resumable":
        client.limits = ClientLimits(put_max_bytes=-1)
    _without_tls_agreement(cluster, [M1, M2, M3])
    calls: dict[str, Callable[[], object]] = {
        "put": lambda: client.create("new", b"y"),
        "resumable": lambda: client.create("new", b"y"),
        "get_meta": lambda: client.get_meta("k"),
        "read": lambda: client.read("k"),
        "wait": lambda: client.wait_for_replication(["k"], 3, timeout=20.0),
    }
    with pytest.raises(TlsMismatch, match="did not verify against the CA given in --ca") as info:
        calls[operation]()
    # Not a NotAuthorized: that says what the user may read, and callers act on it.
    assert not isinstance(info.value, NotAuthorized)
    waited = clock.now - 1000.0
    assert client.limits.refusal_patience_secs <= waited < 2 * client.limits.refusal_patience_secs
    assert "new" not in cluster.blobs


def test_a_certificate_replaced_within_the_patience_is_accepted(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    _without_tls_agreement(cluster, [M1, M2, M3], agreed_after=1.0, clock=clock)
    client.create("k", b"x")
    assert cluster.blobs["k"] == (1, b"x")
    assert clock.now - 1000.0 < client.limits.refusal_patience_secs


def test_a_tls_mismatch_is_final_only_once_every_master_has_shown_it(
    client: Client, cluster: FakeCluster, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even with no patience at all, two masters of three failing the handshake is no proof:
    # the third is asked, and serves.
    client.limits = ClientLimits(refusal_patience_secs=0.0)
    cluster.blobs["k"] = (1, b"x")
    cluster.holders["k"] = [M1, M2, M3]
    _without_tls_agreement(cluster, [M1, M2])
    client._router._preferred = M1
    assert client.get_meta("k").version == 1
    assert [a for a, m in cluster.calls if m == "GetMeta"] == [M1, M2, M3]


def test_the_patience_runs_from_the_first_tls_mismatch_not_from_the_call(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # The cluster was unreachable for 5 s (past the patience), then every master fails the
    # handshake: that is given its own few seconds before it is final.
    _without_tls_agreement(cluster, [M1, M2, M3])
    mismatched = cluster._enter

    def enter(address: str, method: str) -> None:
        if clock.now - 1000.0 < 5.0:
            cluster.calls.append((address, method))
            raise Unavailable(f"master {address} unavailable: Connection refused")
        mismatched(address, method)

    cluster._enter = enter  # type: ignore[method-assign]
    with pytest.raises(TlsMismatch):
        client.get_meta("k")
    assert clock.now - 1000.0 >= 5.0 + client.limits.refusal_patience_secs


def test_a_tls_mismatch_with_some_masters_only_is_retried_to_the_deadline(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # One master's certificate is wrong and the others are down: the cluster may come back,
    # so this is unavailability, reported at the deadline with the mismatch as its reason.
    cluster.down = {M2, M3}
    _without_tls_agreement(cluster, [M1])
    with pytest.raises(Unavailable) as info:
        client.create("k", b"x")
    assert not isinstance(info.value, NotAuthorized)
    assert clock.now - 1000.0 >= 30.0 - 5.0
    assert "did not verify against the CA" in str(info.value)


def test_a_leader_named_by_one_master_wins_over_anothers_refusal(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # One master has not reloaded the token file yet; the others know the caller.
    _refusing(cluster, Unauthenticated("the token was refused"), [M1])
    client.create("k", b"x")
    assert cluster.blobs["k"] == (1, b"x")


@pytest.mark.usefixtures("resumable_only")
def test_upload_aborted_on_fatal_error(client: Client, cluster: FakeCluster) -> None:
    from blobha.core.errors import ResourceExhausted

    cluster.faults.append(("*", "CommitUpload", ResourceExhausted("disk full")))
    with pytest.raises(ResourceExhausted):
        client.create("k", b"x")
    assert cluster.count("AbortUpload") == 1 and not cluster.uploads
