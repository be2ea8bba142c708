"""TLS for the data channel (blobha.wire.datachannel): the same certificates, CA and client
verification as the masters' gRPC, with Python's ``ssl`` over the channel's socket.

Kept apart from blobha.wire.tls, which loads gRPC and cryptography: a client takes this only
when it moves bytes over TLS."""

from __future__ import annotations

import logging
import ssl
import threading
import time

from blobha.core.secretfiles import file_stamps

log = logging.getLogger("blobha.tls")

#: Seconds between looks at the certificate files of a master's data channel.
RELOAD_CHECK_SECS = 1.0


def refuse_exposed_key(key: str) -> None:
    """Raise ValueError if the key file ``key`` (``tls.key``) has become readable by other
    accounts: a reload takes no key that the start-up check would have refused."""
    from blobha.core.secretfiles import exposure

    problem = exposure(key, "tls.key")
    if problem is not None:
        raise ValueError(problem)


def server_context(cert: str, key: str, ca: str, require_client_cert: bool) -> ssl.SSLContext:
    """A master's side: its certificate; with ``require_client_cert`` (``auth.mode = "mtls"``),
    a client certificate signed by ``ca`` is required, as gRPC requires it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if require_client_cert:
        ctx.load_verify_locations(cafile=ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A caller's side: the masters' CA (else the system's roots), the host name checked as
    gRPC checks it, and the client certificate if one is given."""
    ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


class ReloadingServerContext:
    """:func:`server_context`, made again when the files change (as the gRPC side reloads
    them): new connections get the new certificate. Files that cannot be used are logged
    and the previous context stays."""

    def __init__(self, cert: str, key: str, ca: str, require_client_cert: bool) -> None:
        self._args = (cert, key, ca, require_client_cert)
        self._paths = (cert, key) + ((ca,) if ca else ())
        self._lock = threading.Lock()
        self._stamp = file_stamps(self._paths)
        self._context = server_context(*self._args)
        self._checked = time.monotonic()

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_SECS:
            return self._context
        with self._lock:
            self._checked = now
            stamp = file_stamps(self._paths)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    refuse_exposed_key(self._args[1])
                    self._context = server_context(*self._args)
                    log.info("data channel: TLS certificate reloaded from %s", self._args[0])
                except (OSError, ssl.SSLError, ValueError) as e:
                    log.error("data channel: TLS files changed but cannot be used (%s);"
                              " keeping the previous ones", e)
            return self._context
