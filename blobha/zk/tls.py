"""TLS between a master and ZooKeeper (its ``secureClientPort``): kazoo's arguments, and, when a
connection does not come up, what in the TLS set-up is wrong.

The digest password, the cluster secret and job-token records cross this link; without TLS
anyone on the path reads them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import ssl
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from blobha.core.secretfiles import exposure, file_stamps

__all__ = ["PinnedZkTls", "ZkTls", "ZooKeeperTlsError", "diagnose", "start_explained"]

log = logging.getLogger("blobha.tls")

#: How long a connection may take before :func:`start_explained` looks for a TLS mismatch:
#: a healthy one comes up in milliseconds, and a mismatched one never does (kazoo retries
#: it silently until its timeout).
FIRST_WAIT_SECS = 2.0


class ZooKeeperTlsError(Exception):
    """The masters' TLS settings do not fit the ZooKeeper they reach; the message says why."""


@dataclass(frozen=True)
class ZkTls:
    """A master's TLS settings towards ZooKeeper (``zookeeper.ssl.*``)."""

    #: PEM CA certificate(s) ZooKeeper's certificate must be signed by ('' = the system's).
    ca: str = ""
    #: Client certificate and key, for a ZooKeeper that requires one ('' = none).
    cert: str = ""
    key: str = ""
    verify_hostname: bool = True

    def kazoo_args(self) -> dict[str, Any]:
        """Keyword arguments for KazooClient."""
        return {"use_ssl": True, "ca": self.ca or None, "certfile": self.cert or None,
                "keyfile": self.key or None, "verify_certs": True,
                "check_hostname": self.verify_hostname}

    def context(self) -> ssl.SSLContext:
        """The context kazoo builds from these settings (for checks and diagnosis). Raises
        :class:`ZooKeeperTlsError` naming the setting whose file cannot be used."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = self.verify_hostname
        try:
            if self.ca:
                ctx.load_verify_locations(self.ca)
        except (OSError, ssl.SSLError) as e:
            raise ZooKeeperTlsError(f"cannot use zookeeper.ssl.ca {self.ca!r}: {_why(e)}") from None
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as e:
                raise ZooKeeperTlsError(
                    f"cannot use zookeeper.ssl.cert {self.cert!r} with zookeeper.ssl.key"
                    f" {self.key!r}: {_why(e)}") from None
        return ctx


class PinnedZkTls:
    """kazoo loads ``zookeeper.ssl.cert`` and ``zookeeper.ssl.key`` anew at every connection
    to ZooKeeper. A master gives it a private copy instead (one PEM file holding both, in
    ``directory``, mode 0700), made again before a connection (:meth:`refresh`, see
    :func:`blobha.zk.connection.before_each_connection`) when the files changed and pass the
    checks of the master's start again: a renewed certificate is taken without a restart, and
    files that fail them (a key other accounts can read, a key that does not match its
    certificate, a file half written) are refused with one log line, the copy in use staying
    until they are fixed."""

    def __init__(self, tls: ZkTls, directory: Path) -> None:
        self.source = tls
        self._directory = directory
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self._pair = directory / "client.pem"
        #: What to give kazoo: the copy as certificate and key alike.
        self.pinned = replace(tls, cert=str(self._pair), key=str(self._pair))
        self._stamp = self._stamps()
        try:
            self._copy()  # at start: what fails is refused (ZooKeeperTlsError), naming it
        except BaseException:
            self.close()
            raise

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        return file_stamps((self.source.cert, self.source.key))

    def refresh(self) -> None:
        """Copy the files again if they changed and pass the checks; else keep the copy."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._copy()
        except ZooKeeperTlsError as e:
            log.error("%s; keeping the previous zookeeper.ssl.cert and zookeeper.ssl.key", e)
            return
        log.info("ZooKeeper TLS certificate reloaded from %s", self.source.cert)

    def _copy(self) -> None:
        problem = exposure(self.source.key, "zookeeper.ssl.key")
        if problem is not None:
            raise ZooKeeperTlsError(problem)
        try:
            with open(self.source.key, "rb") as f:
                key = f.read()
            with open(self.source.cert, "rb") as f:
                cert = f.read()
            fd, tmp = tempfile.mkstemp(prefix=".client-", dir=self._directory)  # mode 0600
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(cert.rstrip(b"\n") + b"\n" + key)
                ssl.create_default_context().load_cert_chain(tmp)  # the pair belongs together
                os.replace(tmp, self._pair)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except (OSError, ssl.SSLError) as e:
            raise ZooKeeperTlsError(
                f"cannot use zookeeper.ssl.cert {self.source.cert!r} with zookeeper.ssl.key"
                f" {self.source.key!r}: {_why(e)}") from None

    def close(self) -> None:
        shutil.rmtree(self._directory, ignore_errors=True)


def _why(e: BaseException) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return str(e.verify_message)
    if isinstance(e, ssl.SSLError):
        return str(e.reason or e)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def _servers(hosts: str) -> list[tuple[str, int]]:
    out = []
    for part in hosts.split("/", 1)[0].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host:
            host, port = part.strip(), "2181"
        out.append((host.strip("[]"), int(port) if port.isdigit() else 2181))
    return out


def _handshake(host: str, port: int, ctx: ssl.SSLContext, timeout: float) -> None:
    with socket.create_connection((host, port), timeout=timeout) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as conn:
        # TLS 1.3 reports a refused client certificate only with the first read after the
        # handshake; ZooKeeper says nothing first, so a read that times out means accepted.
        conn.settimeout(min(timeout, 0.5))
        with contextlib.suppress(TimeoutError):
            conn.recv(1)


def diagnose(hosts: str, tls: ZkTls | None, timeout: float = 3.0) -> str | None:
    """Why a connection to ZooKeeper at ``hosts`` with ``tls`` (None: plaintext) cannot work,
    as one line naming the setting to change; None when no server shows a TLS mismatch (it
    may be down, or slow)."""
    for host, port in _servers(hosts):
        where = f"ZooKeeper at {host}:{port}"
        if tls is None:
            # Plaintext asked for: does the server speak TLS? Verification is beside the point.
            probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            probe.check_hostname = False
            probe.verify_mode = ssl.CERT_NONE
            try:
                _handshake(host, port, probe, timeout)
            except ssl.SSLError as e:
                if "ALERT" not in str(e.reason):
                    continue  # no TLS there either
            except OSError:
                continue
            return (f"{where} serves TLS only (a secureClientPort): set zookeeper.ssl.enabled"
                    " = true and zookeeper.ssl.ca to its CA certificate")
        try:
            _handshake(host, port, tls.context(), timeout)
        except ssl.SSLCertVerificationError as e:
            fix = ("its certificate must name that host, or set zookeeper.ssl.verify.hostname"
                   " = false" if "hostname" in str(e.verify_message).lower()
                   or "IP address mismatch" in str(e.verify_message)
                   else "check that zookeeper.ssl.ca holds the CA that signed it")
            return f"{where}: its TLS certificate failed verification ({e.verify_message}); {fix}"
        except ssl.SSLError as e:
            if "ALERT" in str(e.reason):
                fix = ("set zookeeper.ssl.cert and zookeeper.ssl.key to a client certificate its"
                       " trust store accepts" if not tls.cert else
                       "check that its trust store holds the CA of zookeeper.ssl.cert")
                return f"{where} refused the TLS handshake ({e.reason}); {fix}"
            return _plaintext(where)
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            return _plaintext(where)
        except OSError:
            continue  # unreachable: not a TLS matter
    return None


def _plaintext(where: str) -> str:
    return (f"{where} did not answer a TLS handshake: it serves plaintext there; point"
            " zookeeper.servers at its secureClientPort, or set zookeeper.ssl.enabled = false")


def start_explained(zk: KazooClient, hosts: str, tls: ZkTls | None, timeout: float) -> None:
    """``zk.start(timeout)``, except that a connection not up after :data:`FIRST_WAIT_SECS` is
    checked for a TLS mismatch (see :func:`diagnose`), which raises
    :class:`ZooKeeperTlsError` at once instead of a time-out long after."""
    deadline = time.monotonic() + timeout
    event = zk.start_async()
    event.wait(min(timeout, FIRST_WAIT_SECS))
    if not zk.connected:
        problem = diagnose(hosts, tls, timeout=max(0.5, min(3.0, deadline - time.monotonic())))
        if problem is None:
            event.wait(max(0.0, deadline - time.monotonic()))
        if not zk.connected:
            zk.stop()
            zk.close()
            if problem is not None:
                raise ZooKeeperTlsError(problem)
            raise KazooTimeoutError("Connection time-out")
