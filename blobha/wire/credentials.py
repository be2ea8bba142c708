"""What a client presents to the masters: TLS trust and client certificate, and a token.

``Credentials.from_env()`` reads ``BLOBHA_CA``, ``BLOBHA_CERT``, ``BLOBHA_KEY`` and
``BLOBHA_TOKEN_FILE``, so every tool built on :class:`blobha.client.Client` (the CLI, the node
cache, the Spark integration) picks them up without code changes. With a CA or a certificate the
connection uses TLS and verifies the master's certificate; otherwise it is plain text.

Whether TLS is required is decided here, for every client path at once (the CLI, fsspec, the
node cache, Spark's executors): unless it is given, ``require_tls`` is
``$BLOBHA_REQUIRE_TLS``, else the ``require_tls`` of the client profile in use
(:func:`tls_required`), and a client that requires TLS makes no channel without it
(:meth:`Credentials.channel`), so no token, password or job token is sent in clear.

The token, from the file or given directly (``bearer``), is a user token (``USER:SECRET``) or a
job token (``bjt1.ID.SECRET``, docs/security.md); either goes as ``authorization: Bearer ...``.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from blobha.core.auth import (
    AUTHORIZATION_METADATA_KEY,
    USER_METADATA_KEY,
    is_job_token,
    split_job_token,
    split_token,
)
from blobha.core.errors import InvalidArgument, Unauthenticated
from blobha.core.secretfiles import KEY_MODE_MASK, exposed_mode

ENV_CA = "BLOBHA_CA"
ENV_CERT = "BLOBHA_CERT"
ENV_KEY = "BLOBHA_KEY"
ENV_TOKEN_FILE = "BLOBHA_TOKEN_FILE"
#: "1" (or true, yes, on): refuse to talk to a cluster without TLS.
ENV_REQUIRE_TLS = "BLOBHA_REQUIRE_TLS"
_TRUE = frozenset({"1", "true", "yes", "on"})

# (ca, cert, key) -> (the files' stamp, the data channel's TLS made from them): a context
# loads its files once, not per transfer.
_DATA_TLS: dict[tuple[str | None, ...], tuple[tuple[float, ...], ssl.SSLContext]] = {}
_DATA_TLS_LOCK = threading.Lock()


def tls_required(env: Mapping[str, str] | None = None) -> bool:
    """Whether clients must use TLS: ``BLOBHA_REQUIRE_TLS`` of ``env`` (None: this process's
    environment) when set, whatever its value (``0`` turns a profile's requirement off, as
    every variable wins over the profile); else, for this process's environment, the
    ``require_tls`` of the client profile it names (``$BLOBHA_PROFILE``, else ``[default]``
    of ``$BLOBHA_CONFIG`` or ``~/.config/blobha/client.toml``). A profile file that cannot
    be read raises its :class:`~blobha.core.profiles.ProfileError`: a requirement it may
    hold is not dropped unseen."""
    source = os.environ if env is None else env
    value = source.get(ENV_REQUIRE_TLS, "").strip().lower()
    if value or env is not None:
        return value in _TRUE
    from blobha.core import profiles  # here: a client given its settings never reads the file

    return profiles.load(env=os.environ).values.get("require_tls") == "1"


_TLS_REQUIRED = (
    "TLS is required (--require-tls, BLOBHA_REQUIRE_TLS, the profile's require_tls or the"
    " require_tls storage option) but no CA is given, so the token would cross the network in"
    " clear: pass --ca FILE (BLOBHA_CA, the ca storage option) with the CA of the masters'"
    " certificates")


@dataclass(frozen=True)
class Credentials:
    """``ca``: CA file that signed the masters' certificates (turns TLS on); ``cert``/``key``:
    a client certificate (TLS, for ``auth.mode = "mtls"``); ``token_file``: a file holding a
    token from ``blobha token create`` or ``blobha token job`` (for ``auth.mode = "token"``);
    ``bearer``: such a token given directly instead (a job token an executor got from its
    Spark configuration), never shown by ``repr``; ``require_tls``: refuse to make a channel
    without TLS, so that a token is never sent in clear by mistake (a forgotten ``--ca``);
    not given, it is :func:`tls_required` (the environment, else the client profile)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token_file: str | None = None
    bearer: str | None = field(default=None, repr=False)
    require_tls: bool = field(default_factory=tls_required)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *,
                 require_tls: bool | None = None) -> Credentials:
        """The credentials of ``env`` (None: this process's environment); ``require_tls``
        given wins over :func:`tls_required`."""
        return cls(
            ca=_get(env, ENV_CA), cert=_get(env, ENV_CERT), key=_get(env, ENV_KEY),
            token_file=_get(env, ENV_TOKEN_FILE),
            require_tls=tls_required(env) if require_tls is None else require_tls,
        )

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def refuse_plaintext(self) -> None:
        """Raise InvalidArgument if TLS is required and these credentials have none: the one
        place every client path asks, before a channel (and so a byte) exists."""
        if self.require_tls and not self.tls:
            raise InvalidArgument(_TLS_REQUIRED)

    def check(self) -> Credentials:
        """Raise InvalidArgument naming the problem if the files cannot be used."""
        self.refuse_plaintext()  # before a token is even read: nothing is sent anywhere
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("a client certificate needs both --cert and --tls-key"
                                  " (BLOBHA_CERT and BLOBHA_KEY)")
        for what, path in (("CA", self.ca), ("certificate", self.cert), ("key", self.key),
                           ("token file", self.token_file)):
            if path and not os.access(path, os.R_OK):
                raise InvalidArgument(f"cannot read the {what} {path!r}")
        for option, path in (("--tls-key (BLOBHA_KEY)", self.key),
                             ("--token-file (BLOBHA_TOKEN_FILE)", self.token_file)):
            if path:
                refuse_exposed(path, option)
        if self.token_file or self.bearer is not None:
            self.token()
        return self

    def token(self) -> str | None:
        if self.bearer is not None:
            text, where = self.bearer.strip(), "the token given"
        elif self.token_file:
            try:
                text = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise InvalidArgument(
                    f"cannot read the token file {self.token_file!r}: {e.strerror}") from None
            where = repr(self.token_file)
        else:
            return None
        try:
            if is_job_token(text):
                split_job_token(text)
            else:
                split_token(text)
        except Unauthenticated:
            raise InvalidArgument(
                f"{where} holds no token; it must be the USER:SECRET line that 'blobha token"
                " create' printed, or the bjt1.ID.SECRET job token 'blobha token job' printed"
            ) from None
        return text

    def token_user(self) -> str | None:
        """The user a user token names; None for a job token (the masters know whose it is)."""
        token = self.token()
        if not token or is_job_token(token):
            return None
        return split_token(token)[0]

    def metadata(self, user: str) -> tuple[tuple[str, str], ...]:
        out: list[tuple[str, str]] = [(USER_METADATA_KEY, user)]
        token = self.token()
        if token:
            out.append((AUTHORIZATION_METADATA_KEY, f"Bearer {token}"))
        return tuple(out)

    def channel(self, address: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        if not self.tls:
            # Here too, not only in check(): a transport given credentials that were never
            # checked must not send their token in clear either.
            self.refuse_plaintext()
            return grpc.insecure_channel(address, options=list(options))
        # Only here: blobha.wire.tls loads cryptography (tens of milliseconds), which a client of a
        # plain-text cluster (a Spark task checking a blob's version, say) has no use for.
        from blobha.wire.tls import channel_credentials

        try:
            creds = channel_credentials(self.ca, self.cert, self.key)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        return grpc.secure_channel(address, creds, options=list(options))

    def data_tls(self) -> ssl.SSLContext | None:
        """The TLS to take the masters' data channels with (None without TLS): the same trust
        and client certificate as :meth:`channel`; made again when the files change."""
        if not self.tls:
            return None
        # Only here, as in channel(): blobha.wire.datatls is needed once bytes move over TLS.
        from blobha.wire.datatls import client_context

        key = (self.ca, self.cert, self.key, self.stamp())
        with _DATA_TLS_LOCK:
            made = _DATA_TLS.get(key[:3])
            if made is None or made[0] != key[3]:
                try:
                    made = (key[3], client_context(self.ca, self.cert, self.key))
                except (OSError, ssl.SSLError) as e:
                    raise InvalidArgument(f"cannot use the TLS files for the data channel: {e}"
                                          ) from None
                _DATA_TLS[key[:3]] = made
            return made[1]

    def stamp(self) -> tuple[float, ...]:
        """Modification times of the files, to notice a renewed certificate."""
        out = []
        for path in (self.ca, self.cert, self.key):
            try:
                out.append(os.stat(path).st_mtime if path else 0.0)
            except OSError:
                out.append(-1.0)
        return tuple(out)


def _get(env: Mapping[str, str] | None, name: str) -> str | None:
    return (os.environ if env is None else env).get(name) or None


def refuse_exposed(path: str, option: str) -> None:
    """Raise InvalidArgument if the secret file ``path`` (given as ``option``) is open to
    other accounts, as ssh refuses an unprotected private key.

    Like ssh, only a file of this account is judged: one that another account (root, a
    provisioning tool, a Kubernetes secret mounted 0440 for a group) shares with us on purpose
    is theirs to decide, and we could not chmod it anyway."""
    mode = exposed_mode(path, KEY_MODE_MASK, owner_only=True)
    if mode is not None:
        raise InvalidArgument(
            f"{option} {path} is open to other accounts (mode {mode:04o}); run"
            f" 'chmod 600 {path}' and try again")
