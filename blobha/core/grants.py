"""Peer grants: the HMACs that let one node cache serve a version to another without the
masters' secret.

A master derives, from the secret the masters share, a key per version of a key
(:func:`version_key`); anyone holding it already holds that version's bytes, so it lets them
mint nothing they could not serve anyway. A cache allowed to READ receives that key, to check
grants when it serves the version, and a grant for itself (:func:`make_grant`): an HMAC of the
user, key, version and expiry under the version key. A peer serves a piece only against a
grant that :func:`check_grant` accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass

__all__ = ["Grant", "GrantRefused", "check_grant", "make_grant", "peer_root", "version_key"]

#: Seconds a grant stays valid by default: long enough for one download, short enough that a
#: revoked READ stops working soon (a cache re-plans, and so renews its grant, while it runs).
GRANT_SECS = 300.0
_ROOT_LABEL = b"blobha peer grants v1"


class GrantRefused(ValueError):
    """A grant that does not verify, or has expired."""


@dataclass(frozen=True)
class Grant:
    user: str
    key: str
    version: int
    expires: float  # seconds since the epoch
    mac: str  # hex


def _mac(secret: bytes, *parts: str) -> bytes:
    # Each part length-prefixed: "a|b" and "a" "|b" must never sign the same message.
    msg = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def peer_root(cluster_secret: str) -> bytes:
    """The masters' grant secret, derived from their shared cluster secret under a label of
    its own, so a grant key can never stand in for anything the cluster secret proves."""
    return hmac.new(cluster_secret.encode(), _ROOT_LABEL, hashlib.sha256).digest()


def version_key(root: bytes, key: str, version: int, digest: str) -> bytes:
    """The key that grants for one version verify under (the digest binds it to those bytes:
    a key deleted and created again gets new version keys)."""
    return _mac(root, key, str(version), digest)


def make_grant(vkey: bytes, user: str, key: str, version: int, expires: float) -> Grant:
    expires = float(int(expires))  # whole seconds: the same text on every side
    return Grant(user, key, version, expires,
                 _mac(vkey, user, key, str(version), f"{expires:.0f}").hex())


def check_grant(vkey: bytes, grant: Grant, key: str, version: int,
                now: float | None = None) -> None:
    """Raise :class:`GrantRefused` unless ``grant`` is for ``key`` v``version``, made under
    ``vkey``, and not expired."""
    if grant.key != key or grant.version != version:
        raise GrantRefused(f"the grant is for {grant.key!r} v{grant.version}, not {key!r}"
                           f" v{version}")
    want = _mac(vkey, grant.user, key, str(version), f"{grant.expires:.0f}").hex()
    if not hmac.compare_digest(want, grant.mac):
        raise GrantRefused("the grant does not verify")
    if (time.time() if now is None else now) >= grant.expires:
        raise GrantRefused(f"the grant expired at {grant.expires:.0f}")
