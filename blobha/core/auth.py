"""Credentials and their formats: user tokens and their scrypt hashes (the token file), job
tokens, the cluster secret, the call metadata that carries them, and the user-name rules.

* a user token is ``<user>:<secret>``; the masters keep only salted scrypt hashes of it, so no
  token sits in the clear on a server (:func:`hash_token`, :func:`parse_token_file`);
* a **job token** (``bjt1.<id>.<secret>``, see :func:`new_job_token`) acts as the user who
  obtained it, limited to READ on its keys, until it expires or is revoked; its record lives in
  ZooKeeper;
* the cluster secret (:func:`new_cluster_secret`) is how masters prove they are masters.

The servers' side, the authenticators of ``auth.mode`` that check them, is blobha.wire.authn.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum

from blobha.core.acl import name_problem
from blobha.core.errors import Unauthenticated

#: Call metadata carrying the user name a client asserts (simple mode).
USER_METADATA_KEY = "x-blobha-user"
#: Call metadata carrying a bearer token (token mode): ``Bearer <user>:<secret>``.
AUTHORIZATION_METADATA_KEY = "authorization"
#: Call metadata by which a master proves it is one (the cluster secret).
MASTER_SECRET_METADATA_KEY = "x-blobha-master-secret"



class AuthMode(StrEnum):
    """``auth.mode``: how a master tells who is calling (see blobha.wire.authn)."""

    SIMPLE = "simple"
    TOKEN = "token"
    MTLS = "mtls"


MODES = tuple(m.value for m in AuthMode)

# scrypt cost: ~16 MiB and a few tens of milliseconds per check. Tokens are random (256 bits),
# so this only protects a stolen token file against offline guessing of weak tokens someone
# might add by hand; verified tokens are remembered (by their SHA-256) so calls stay cheap.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P, _SCRYPT_LEN = 2**14, 8, 1, 32
#: The length of a token hash, in bytes.
TOKEN_HASH_LEN = _SCRYPT_LEN
_SCHEME = "scrypt"


def check_user_name(user: str) -> str:
    """The rules every user name follows (they appear in ACLs, so no ``:`` or ``,``)."""
    problem = name_problem(user)
    if problem:
        raise Unauthenticated(f"the user name {user!r} {problem}")
    return user


# ---- tokens ------------------------------------------------------------------------------------


def new_token(user: str) -> str:
    """A fresh random token for ``user`` (``<user>:<secret>``; the user part tells the server
    which hashes to try)."""
    check_user_name(user)
    return f"{user}:{secrets.token_urlsafe(32)}"


def split_token(token: str) -> tuple[str, str]:
    """``alice:s3cr3t`` -> (``alice``, ``s3cr3t``); raises Unauthenticated if malformed."""
    user, sep, secret = token.strip().partition(":")
    if not sep or not user or not secret:
        raise Unauthenticated(
            "malformed token; a token looks like USER:SECRET, as printed by 'blobha token create'"
        )
    return check_user_name(user), secret


def _scrypt(secret: str, salt: bytes) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P,
                          dklen=_SCRYPT_LEN, maxmem=64 * 1024 * 1024)


def hash_token(token: str) -> str:
    """The token-file line for ``token``: ``user:scrypt$<salt>$<hash>`` (base64)."""
    user, secret = split_token(token)
    salt = os.urandom(16)
    digest = _scrypt(secret, salt)
    b64 = base64.b64encode
    return f"{user}:{_SCHEME}${b64(salt).decode()}${b64(digest).decode()}"


@dataclass(frozen=True)
class TokenHash:
    salt: bytes
    digest: bytes

    def matches(self, secret: str) -> bool:
        return hmac.compare_digest(_scrypt(secret, self.salt), self.digest)



def parse_token_file(text: str, source: str) -> dict[str, list[TokenHash]]:
    """Parse a token file: ``user:scrypt$<salt>$<hash>`` per line; ``#`` comments and blank
    lines are ignored; a user may have several lines (to rotate tokens without downtime)."""
    out: dict[str, list[TokenHash]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, rest = line.partition(":")
        parts = rest.split("$")
        if not sep or not user or len(parts) != 3 or parts[0] != _SCHEME:
            raise ValueError(
                f"{source} line {number}: expected USER:scrypt$SALT$HASH (make lines with"
                " 'blobha token create' or 'blobha token hash')"
            )
        try:
            salt = base64.b64decode(parts[1], validate=True)
            digest = base64.b64decode(parts[2], validate=True)
        except ValueError:
            raise ValueError(f"{source} line {number}: salt or hash is not base64") from None
        if len(digest) != _SCRYPT_LEN or not salt:
            raise ValueError(f"{source} line {number}: the hash must be {_SCRYPT_LEN} bytes")
        out.setdefault(user, []).append(TokenHash(salt, digest))
    return out


# ---- job tokens --------------------------------------------------------------------------------

#: What every job token starts with: told from a user token (``USER:SECRET``; a user token
#: always has a colon, a job token never) at a glance, by people and by code. "1" is the format.
JOB_TOKEN_PREFIX = "bjt1."
_JOB_ID_BYTES = 8  # 16 hex digits: public, names the record; only needs to be unique
_JOB_ID = re.compile(r"[0-9a-f]{16}")
_JOB_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")  # token_urlsafe(32): 256 random bits
_MALFORMED_JOB_TOKEN = ("malformed job token; a job token looks like bjt1.ID.SECRET, as printed by"
                        " 'blobha token job'")


def is_job_token(text: str) -> bool:
    return text.strip().startswith(JOB_TOKEN_PREFIX)


def new_job_token() -> tuple[str, str]:
    """A fresh job token and its id: ``bjt1.<16 hex id>.<43 url-safe characters>``."""
    token_id = secrets.token_hex(_JOB_ID_BYTES)
    return f"{JOB_TOKEN_PREFIX}{token_id}.{secrets.token_urlsafe(32)}", token_id


def split_job_token(token: str) -> tuple[str, str]:
    """``bjt1.<id>.<secret>`` -> (id, secret); raises Unauthenticated if malformed."""
    text = token.strip()
    if not text.startswith(JOB_TOKEN_PREFIX):
        raise Unauthenticated(_MALFORMED_JOB_TOKEN)
    token_id, sep, secret = text[len(JOB_TOKEN_PREFIX):].partition(".")
    if not sep or not _JOB_ID.fullmatch(token_id) or not _JOB_SECRET.fullmatch(secret):
        raise Unauthenticated(_MALFORMED_JOB_TOKEN)
    return token_id, secret


def job_token_id(token_or_id: str) -> str:
    """The id of a job token given whole or by its id; ValueError if it is neither."""
    text = token_or_id.strip()
    if is_job_token(text):
        try:
            return split_job_token(text)[0]
        except Unauthenticated as e:
            raise ValueError(str(e)) from None
    if not _JOB_ID.fullmatch(text):
        raise ValueError(f"{token_or_id!r} is neither a job token (bjt1.ID.SECRET) nor a job token"
                         " id (16 hex digits)")
    return text


def job_token_hash(token_id: str, secret: str) -> str:
    """What the masters store of a job token: SHA-256 of the id and secret, hex. A fast hash
    is enough here, unlike scrypt for user tokens (which a person may have chosen): the secret
    is 256 random bits, so there is nothing to guess offline, and the check stays cheap on
    every call. The id is hashed in so that a record moved to another id matches nothing."""
    return hashlib.sha256(f"{JOB_TOKEN_PREFIX}{token_id}.{secret}".encode()).hexdigest()


def new_cluster_secret() -> str:
    return secrets.token_urlsafe(32)

