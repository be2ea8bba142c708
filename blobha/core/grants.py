"""Peer grants: the HMACs that let one node cache serve a version to another without the
masters' secret.

A master derives, from the secret the masters share, a key per version of a key *and per
serving address and user* (:func:`serve_key`). A cache that announces the address it serves
at is given the key for that address and its user only, to check the grants it is shown: it
cannot make a grant that any other cache accepts. A requester is given, for each peer a plan
names, a grant made under that peer's key (the one for the user who announced it;
:func:`make_grant`): an HMAC of the user, key, version, expiry and the host the requester
called the master from. A peer serves a piece only against a grant that :func:`check_grant`
accepts: made under its own key, for a connection from that host, and expiring neither in
the past nor further ahead than :data:`MAX_GRANT_SECS`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import time
from dataclasses import dataclass

__all__ = ["GRANT_SECS", "MAX_GRANT_SECS", "NOT_VERIFIED", "Grant", "GrantRefused", "check_grant",
           "host_key", "make_grant", "peer_root", "serve_key"]

#: Seconds a grant stays valid by default: long enough for one download, short enough that a
#: revoked READ stops working soon (a cache re-plans, and so renews its grants, while it runs).
GRANT_SECS = 300.0
#: Seconds ahead of now a peer accepts a grant's expiry at most: three default lifetimes,
#: room for clocks that differ; a master makes none longer. A grant's key in the wrong hands
#: (or a master's bad setting) cannot make one that holds for ever.
MAX_GRANT_SECS = 3 * GRANT_SECS
# v2: keys per serving address and grants bound to a requester; v1 keys (per version) are
# never derived again, so nothing made under them verifies.
_ROOT_LABEL = b"blobha peer grants v2"
#: Why a grant that does not verify is refused: the same words for every cause a requester
#: could learn something from (no key, a wrong MAC, a malformed expiry).
NOT_VERIFIED = "the grant does not verify"


class GrantRefused(ValueError):
    """A grant that does not verify, is for another requester, or has expired. ``told``: the
    reason may be told to the requester (the grant verified, so a master made it for them)."""

    def __init__(self, reason: str, told: bool = False) -> None:
        super().__init__(reason)
        self.told = told


@dataclass(frozen=True)
class Grant:
    user: str
    key: str
    version: int
    expires: float  # seconds since the epoch, whole
    #: The host (an IP address, as :func:`host_key` writes it) the grant's requests must
    #: come from.
    requester: str
    mac: str  # hex


def _mac(secret: bytes, *parts: str) -> bytes:
    # Each part length-prefixed: "a|b" and "a" "|b" must never sign the same message.
    msg = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def peer_root(cluster_secret: str) -> bytes:
    """The masters' grant secret, derived from their shared cluster secret under a label of
    its own, so a grant key can never stand in for anything the cluster secret proves."""
    return hmac.new(cluster_secret.encode(), _ROOT_LABEL, hashlib.sha256).digest()


def serve_key(root: bytes, key: str, version: int, digest: str, address: str,
              user: str) -> bytes:
    """The key a cache serving one version at ``address`` (host:port, as it announced it) as
    ``user`` checks grants under. The digest binds it to those bytes (a key deleted and
    created again gets new keys); the address keeps one cache's key from opening any other
    cache, and the user keeps a reader who announces another's address (which a master
    cannot verify) from getting the key that opens it."""
    return _mac(root, key, str(version), digest, address, user)


def host_key(host: str) -> str:
    """``host`` as grants name it: an IP address in its one canonical text (an IPv4 address
    mapped into IPv6 as plain IPv4, brackets dropped), so that what a master saw and what a
    peer sees compare equal; "" for what is not an IP address (nothing to bind to)."""
    try:
        ip = ipaddress.ip_address(host.strip().strip("[]").split("%", 1)[0])
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def _text(expires: float) -> str:
    return f"{expires:.0f}"


def make_grant(skey: bytes, user: str, key: str, version: int, expires: float,
               requester: str) -> Grant:
    expires = float(int(expires))  # whole seconds: the same text on every side
    return Grant(user, key, version, expires, requester,
                 _mac(skey, user, key, str(version), _text(expires), requester).hex())


def check_grant(skey: bytes, grant: Grant, key: str, version: int, requester: str,
                now: float | None = None) -> None:
    """Raise :class:`GrantRefused` unless ``grant`` is for ``key`` v``version``, made under
    ``skey`` (this server's key), for requests from ``requester`` (the connection's source,
    :func:`host_key`), and expires after ``now`` and at most :data:`MAX_GRANT_SECS` later."""
    if grant.key != key or grant.version != version:
        raise GrantRefused(f"the grant is for {grant.key!r} v{grant.version}, not {key!r}"
                           f" v{version}")
    # No key (a version announced to no master yet) verifies nothing: an HMAC under b"" is
    # one anybody can make. NaN, infinities and fractions have no one text to sign.
    if (not skey or not math.isfinite(grant.expires) or grant.expires != int(grant.expires)
            or not grant.requester):
        raise GrantRefused(NOT_VERIFIED)
    want = _mac(skey, grant.user, key, str(version), _text(grant.expires),
                grant.requester).hex()
    if not hmac.compare_digest(want, grant.mac):
        raise GrantRefused(NOT_VERIFIED)
    # The rest is told: only the holder of a grant a master made gets this far.
    if grant.requester != requester:
        raise GrantRefused(f"the grant is for requests from {grant.requester}, not from"
                           f" {requester or 'an unknown host'}", told=True)
    now = time.time() if now is None else now
    if now >= grant.expires:
        raise GrantRefused(f"the grant expired at {grant.expires:.0f}", told=True)
    if grant.expires > now + MAX_GRANT_SECS:
        raise GrantRefused(f"the grant expires at {grant.expires:.0f}, more than"
                           f" {MAX_GRANT_SECS:.0f} s ahead", told=True)
