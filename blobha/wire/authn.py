"""Who is calling: the pluggable authenticators of a master (``auth.mode``), on every call
before any handler runs. The credentials' formats are blobha.core.auth's.

* ``simple``: the client asserts its user name in call metadata (Hadoop's "simple" auth).
* ``token``: a bearer token, checked against a file of salted scrypt hashes, so no token sits in
  the clear on the server. The file is re-read when it changes.
* ``mtls``: the user comes from the client certificate (common name or subject alternative
  names), mapped by ``auth.mtls.rules``.

In ``token`` and ``mtls`` modes a bearer **job token** (``bjt1.<id>.<secret>``, see
:func:`blobha.core.auth.new_job_token`) is accepted too: it acts as the user who obtained
it, limited to READ on its keys (its scope, enforced by the master's gatekeeper) until it
expires or is revoked. Its record lives in ZooKeeper, so the check is the master's
(:class:`JobTokenVerifier`).

Whatever the mode, the masters' own principal (``master.principal``) is never taken on anyone's
word: a master proves it by sending the cluster secret, which only masters can read (it lives in
ZooKeeper, behind the lock-down ACLs). Without that proof, a call naming the principal is refused,
so nobody can claim it to skip ACL checks on the sync path.

Every refusal is :class:`~blobha.core.errors.Unauthenticated` with a message that says which
credential to pass; it never depends on what the call was about, so it reveals nothing about keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from blobha.core.admission import PeerCaps, costly
from blobha.core.auth import (
    AUTHORIZATION_METADATA_KEY,
    MASTER_SECRET_METADATA_KEY,
    MODES,
    TOKEN_HASH_LEN,
    USER_METADATA_KEY,
    AuthMode,
    TokenHash,
    check_user_name,
    is_job_token,
    parse_token_file,
    split_job_token,
    split_token,
)
from blobha.core.errors import Unauthenticated
from blobha.core.secretfiles import TOKEN_FILE_MODE_MASK, exposure

log = logging.getLogger("blobha.auth")

# Bounds the CPU and memory an attacker can burn with wrong tokens: checks beyond are refused at
# once as busy (a waiting check would hold a call thread), and one connection gets one at a
# time, one host all but one, so that a flood from one place leaves room for everyone else.
_SCRYPT_CHECKS = PeerCaps("checking tokens", total=4, per_connection=1, per_host=3)
_CACHE_SIZE = 4096
_RELOAD_CHECK_SECS = 1.0

class Authenticator(Protocol):
    """Maps a call's credentials to a user name, or raises :class:`Unauthenticated`.

    ``metadata`` is the call metadata (lower-case keys); ``peer`` is what the TLS layer
    verified about the client (``x509_common_name``, ``x509_subject_alternative_name``, ...)."""

    def authenticate(self, metadata: Mapping[str, str], peer: Mapping[str, Sequence[str]]
                     ) -> str: ...


class SimpleAuthenticator:
    """Trusts the user name the client sends."""

    def authenticate(self, metadata: Mapping[str, str], peer: Mapping[str, Sequence[str]]
                     ) -> str:
        user = metadata.get(USER_METADATA_KEY)
        if not user:
            raise Unauthenticated("no user given; pass --user or set BLOBHA_USER")
        return check_user_name(user)


# ---- tokens ------------------------------------------------------------------------------------

#: What a token of a user the file does not name is checked against: a hash nothing matches
#: (random, made once), so that an unknown user costs the same scrypt, under the same cap, as
#: a known one with a wrong token, and the time of a refusal does not tell who has an account.
_NOBODY = (TokenHash(os.urandom(16), os.urandom(TOKEN_HASH_LEN)),)


class TokenAuthenticator:
    """Bearer tokens checked against a file of hashes, re-read when the file changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._hashes: dict[str, list[TokenHash]] = {}
        self._stamp: tuple[int, int, int] | None = None
        # The last version of the file that could not be used (it is not read again).
        self._refused: tuple[int, int, int] | None = None
        self._checked = 0.0
        # sha256(token) -> user, for tokens verified against the current file.
        self._verified: OrderedDict[bytes, str] = OrderedDict()
        self._load(initial=True)

    def _load(self, initial: bool = False) -> None:
        stamp: tuple[int, int, int] | None = None
        try:
            st = self.path.stat()
            # The mode too: the chmod that fixes a file refused for it brings the file in.
            stamp = (st.st_mtime_ns, st.st_size, st.st_mode)
            if stamp in (self._stamp, self._refused):
                return
            # As at start (MasterSettings.refuse_exposed_secrets): whoever may change the
            # file adds a token of their own, so a reload takes no file open to that.
            problem = exposure(str(self.path), "auth.token.file", TOKEN_FILE_MODE_MASK)
            if problem is not None and not initial:
                raise ValueError(problem)
            hashes = parse_token_file(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as e:
            if initial:
                raise ValueError(f"cannot use the token file: {e}") from None
            # Keep serving with the previous tokens rather than locking everyone out; said
            # once per change of the file.
            self._refused = stamp
            log.error("token file %s not reloaded (%s); still using the previous one",
                      self.path, e)
            return
        with self._lock:
            # A token verified before stays verified while its user's lines are unchanged:
            # a reload does not send every user through scrypt again, whose places (capped,
            # see _SCRYPT_CHECKS) a flood of wrong tokens may hold at that moment.
            kept = [(fp, u) for fp, u in self._verified.items()
                    if hashes.get(u) == self._hashes.get(u)]
            self._verified = OrderedDict(kept)
            self._hashes = hashes
            self._stamp = stamp
        if not initial:
            log.info("token file %s reloaded: %d users", self.path, len(hashes))

    def _reloaded_now(self) -> bool:
        """Look at the file now (a stat; it is parsed only if it changed); True if it had."""
        before = self._stamp
        self._checked = time.monotonic()
        self._load()
        return self._stamp != before

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked >= _RELOAD_CHECK_SECS:
            self._checked = now
            self._load()

    def authenticate(self, metadata: Mapping[str, str], peer: Mapping[str, Sequence[str]]
                     ) -> str:
        header = metadata.get(AUTHORIZATION_METADATA_KEY, "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise Unauthenticated(
                "no token given; this cluster requires one: pass --token-file or set"
                " BLOBHA_TOKEN_FILE"
            )
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        user, secret = split_token(token)
        self._maybe_reload()
        fingerprint = hashlib.sha256(token.strip().encode()).digest()
        with self._lock:
            known = self._verified.get(fingerprint)
            if known is not None:
                self._verified.move_to_end(fingerprint)
                return known
            candidates = list(self._hashes.get(user, ()))
        ok = _check(candidates, secret)
        if not ok and self._reloaded_now():
            # A token appended a moment ago works on its first use, not a second later.
            with self._lock:
                candidates = list(self._hashes.get(user, ()))
            ok = _check(candidates, secret)
        if not ok:
            raise Unauthenticated(
                "the token was refused (unknown, revoked or mistyped); ask an administrator for"
                " a valid one"
            )
        with self._lock:
            self._verified[fingerprint] = user
            while len(self._verified) > _CACHE_SIZE:
                self._verified.popitem(last=False)
        return user


def _check(candidates: Sequence[TokenHash], secret: str) -> bool:
    """Whether ``secret`` matches one of a user's hashes; a user with none (unknown) is checked
    against :data:`_NOBODY`, in the same capped place, and never matches."""
    with costly(_SCRYPT_CHECKS):
        matched = any(h.matches(secret) for h in candidates or _NOBODY)
    return matched and bool(candidates)


# ---- job tokens --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Caller:
    """Who a call comes from: the user, and for a job token the keys it may read."""

    user: str
    #: The only keys the call may touch, and only to read them; None: the user's own rights.
    scope: frozenset[str] | None = None
    #: The job token's id, for logs and the audit trail ("" for a user credential).
    token_id: str = ""


class JobTokenVerifier(Protocol):
    """Checks a job token against its stored record (the master's, in ZooKeeper): the caller it
    acts for, or :class:`Unauthenticated` (unknown, revoked, expired or tampered)."""

    def verify(self, token_id: str, secret: str) -> Caller: ...


# ---- client certificates -----------------------------------------------------------------------


@dataclass(frozen=True)
class MappingRule:
    """``SOURCE REGEX REPLACEMENT``: if REGEX matches a value of SOURCE (``cn`` for the common
    name, ``san`` for a subject alternative name) as a whole, the user is REPLACEMENT with
    ``\\1``... filled in from the match."""

    source: str
    pattern: re.Pattern[str]
    replacement: str

    @classmethod
    def parse(cls, text: str) -> MappingRule:
        parts = text.split()
        if len(parts) != 3 or parts[0] not in ("cn", "san"):
            raise ValueError(
                f"bad certificate mapping rule {text!r}; expected 'cn|san REGEX REPLACEMENT',"
                r" e.g. 'cn ^(.+)$ \1'"
            )
        try:
            pattern = re.compile(parts[1])
        except re.error as e:
            raise ValueError(f"bad regular expression in rule {text!r}: {e}") from None
        return cls(parts[0], pattern, parts[2])

    def apply(self, peer: Mapping[str, Sequence[str]]) -> str | None:
        key = "x509_common_name" if self.source == "cn" else "x509_subject_alternative_name"
        for value in peer.get(key, ()):
            m = self.pattern.fullmatch(value)
            if m is not None:
                return m.expand(self.replacement)
        return None


class MtlsAuthenticator:
    """The user comes from the verified client certificate, through the first matching rule."""

    def __init__(self, rules: Sequence[str]) -> None:
        self.rules = [MappingRule.parse(r) for r in rules]
        if not self.rules:
            raise ValueError("auth.mtls.rules must hold at least one rule")

    def authenticate(self, metadata: Mapping[str, str], peer: Mapping[str, Sequence[str]]
                     ) -> str:
        if not peer.get("x509_common_name") and not peer.get("x509_subject_alternative_name"):
            raise Unauthenticated(
                "no client certificate; this cluster requires one: pass --cert and --tls-key (or"
                " set BLOBHA_CERT and BLOBHA_KEY)"
            )
        for rule in self.rules:
            user = rule.apply(peer)
            if user:
                return check_user_name(user)
        names = [*peer.get("x509_common_name", ()), *peer.get("x509_subject_alternative_name", ())]
        raise Unauthenticated(
            f"the client certificate ({', '.join(names)}) maps to no user; an administrator must"
            " add a rule to auth.mtls.rules"
        )


# ---- the masters' own principal ----------------------------------------------------------------


class ServerAuthentication:
    """The authenticator of ``auth.mode`` plus the masters' proof of identity, and job tokens
    when ``job_tokens`` is given (not in simple mode, where nobody holds a secret)."""

    def __init__(self, authenticator: Authenticator, principal: str,
                 cluster_secret: Callable[[], str],
                 job_tokens: JobTokenVerifier | None = None,
                 previous_secret: Callable[[], str] | None = None) -> None:
        self.authenticator = authenticator
        self.principal = principal
        self._cluster_secret = cluster_secret
        self.job_tokens = job_tokens
        #: The secret a rotation just replaced, while other masters may still send it ("").
        self._previous_secret = previous_secret

    def authenticate(self, metadata: Mapping[str, str], peer: Mapping[str, Sequence[str]]
                     ) -> str:
        """The caller's user, for a credential of the user's own: a job token is refused here,
        as its scope would be lost (fail closed); :meth:`identify` accepts it."""
        caller = self.identify(metadata, peer)
        if caller.scope is not None:
            raise Unauthenticated("a job token is not accepted here; use your own credential")
        return caller.user

    def identify(self, metadata: Mapping[str, str], peer: Mapping[str, Sequence[str]]
                 ) -> Caller:
        presented = metadata.get(MASTER_SECRET_METADATA_KEY)
        if presented is not None:
            secret = self._cluster_secret()
            if secret and hmac.compare_digest(presented.encode(), secret.encode()):
                return Caller(self.principal)
            old = self._previous_secret() if self._previous_secret is not None else ""
            if old and hmac.compare_digest(presented.encode(), old.encode()):
                return Caller(self.principal)
            raise Unauthenticated("the cluster secret is wrong; only masters may send one")
        header = metadata.get(AUTHORIZATION_METADATA_KEY, "")
        scheme, _, token = header.partition(" ")
        if self.job_tokens is not None and scheme.lower() == "bearer" and is_job_token(token):
            # Before the mode's authenticator: in mtls mode a job token comes with the
            # certificate of whatever runs the job, and it is the token that says who acts.
            caller = self.job_tokens.verify(*split_job_token(token))
            if caller.user == self.principal:
                raise Unauthenticated("a job token cannot act as the masters' principal")
            return caller
        user = self.authenticator.authenticate(metadata, peer)
        if user == self.principal:
            raise Unauthenticated(
                f"user {user!r} is reserved for the masters, which prove it with the cluster"
                " secret; use your own user name"
            )
        return Caller(user)


def make_authenticator(mode: AuthMode | str, token_file: str, mtls_rules: Sequence[str]
                       ) -> Authenticator:
    """The authenticator for ``auth.mode``; raises ValueError naming what is missing."""
    if mode not in MODES:
        raise ValueError(f"auth.mode {mode!r} is not supported; use one of {', '.join(MODES)}")
    mode = AuthMode(mode)
    if mode is AuthMode.SIMPLE:
        return SimpleAuthenticator()
    if mode is AuthMode.TOKEN:
        if not token_file:
            raise ValueError("auth.mode 'token' needs auth.token.file (a file of token hashes)")
        return TokenAuthenticator(token_file)
    if mode is AuthMode.MTLS:
        return MtlsAuthenticator(mtls_rules)
    raise AssertionError(mode)  # every AuthMode is handled above

