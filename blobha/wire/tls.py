"""TLS for gRPC: a master's server credentials (re-read when the files change, no restart) and
the channel credentials clients and masters connect with.

A master with ``tls.cert`` and ``tls.key`` serves TLS only. ``tls.ca`` is the CA it trusts: it
verifies other masters' server certificates with it, and (in ``auth.mode = "mtls"``) requires and
verifies client certificates with it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import grpc

from blobha.core.secretfiles import file_stamps
from blobha.wire.datatls import refuse_exposed_key

log = logging.getLogger("blobha.tls")


def read_file(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {os.fspath(path)!r}: {e.strerror}") from None


class ReloadingServerCredentials:
    """Server credentials whose certificate, key and CA are re-read when their files change.

    gRPC asks the fetcher before each new TLS handshake; existing connections keep the
    certificate they negotiated. A half-written or broken set of files, or a key file other
    accounts can read, is refused with an error in the log and the previous certificates stay
    in use."""

    def __init__(self, cert: str, key: str, ca: str, require_client_cert: bool) -> None:
        if require_client_cert and not ca:
            raise ValueError("client certificates (auth.mode 'mtls') need tls.ca to verify them")
        self._paths = [cert, key] + ([ca] if ca else [])
        self._cert, self._key, self._ca = cert, key, ca
        self._lock = threading.Lock()
        self.reloads = 0
        self._config, self._stamp = self._read()
        # grpc-stubs types the fetcher as never returning None; gRPC documents None as
        # "keep the current configuration".
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._config, self._fetch,  # type: ignore[arg-type]
            require_client_authentication=require_client_cert,
        )

    def _read(self) -> tuple[grpc.ServerCertificateConfiguration,
                             tuple[tuple[int, int, int], ...]]:
        stamp = file_stamps(self._paths)
        # As at start (MasterSettings.refuse_exposed_secrets): a key file others can read is
        # not taken, here at a reload, which keeps the previous pair.
        refuse_exposed_key(self._key)
        pair = (read_file(self._key, "TLS key (tls.key)"),
                read_file(self._cert, "TLS certificate (tls.cert)"))
        ca = read_file(self._ca, "TLS CA (tls.ca)") if self._ca else None
        _check_pair(pair[1], pair[0])
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca), stamp

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            if file_stamps(self._paths) == self._stamp:
                return None
            try:
                config, stamp = self._read()
            except ValueError as e:
                log.error("TLS files changed but cannot be used (%s); keeping the previous ones", e)
                # Do not retry on every handshake until the files change again.
                self._stamp = file_stamps(self._paths)
                return None
            self._config, self._stamp = config, stamp
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self._cert)
            return config


def _check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """Fail with a clear message on unusable files (gRPC would only log a C error), including
    a key and certificate that do not belong together, e.g. halfway through a renewal."""
    # Only here: a master serving TLS needs it, a client (installed without the server extra,
    # which brings cryptography) only passes its files to gRPC.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise ValueError("the TLS certificate is not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise ValueError("the TLS key is not an unencrypted PEM private key") from None
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if cert.public_key().public_bytes(der, spki) != key.public_key().public_bytes(der, spki):
        raise ValueError("the TLS key does not match the certificate")


def channel_credentials(ca: str | None, cert: str | None, key: str | None
                        ) -> grpc.ChannelCredentials:
    """Credentials to connect over TLS: trust ``ca`` (else the system's roots) and present
    ``cert``/``key`` as client certificate if given."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both --cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca, "CA certificate") if ca else None,
        private_key=read_file(key, "client key") if key else None,
        certificate_chain=read_file(cert, "client certificate") if cert else None,
    )
