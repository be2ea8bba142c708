"""The piece server of a node cache: one per process, serving 1 MiB pieces of the versions it
holds whole and of the one it downloads (pieces written and verified), to requesters with a
grant made under this process's key for the version (blobha.core.grants.serve_key), for
requests from the host the connection comes from. Limited in connections and bytes per second.

A connection gets a thread only once its first bytes have come (until then it waits, with
others, in the accepting thread's selector, for a few seconds at most), threads are capped, and
a request is checked against its grant before it takes a serving slot: idle or slow connections
cannot take every thread or slot, and a request without a valid grant is refused the same
whether this process holds the version or not, so it learns nothing of what it holds."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from blobha.cache.peers import wire
from blobha.cache.peers.settings import PeerSettings
from blobha.core.grants import NOT_VERIFIED, GrantRefused, check_grant, host_key
from blobha.wire.accepting import Doorway

__all__ = ["PeerServer", "Served", "advertised_host"]

log = logging.getLogger("blobha.cache.peers")

#: Seconds a requester may take to send its next request, or stall a piece.
IO_TIMEOUT = 30.0
#: Seconds from a connection's accept to its first request (and TLS handshake) read whole.
FIRST_REQUEST_SECS = 5.0
#: The one answer to a grant that does not verify, and to a request for a version not served.
_NO_GRANT = f"grant refused: {NOT_VERIFIED}"


@dataclass
class Served:
    """One version this process serves: its file, and which pieces are in it (None: all)."""

    key: str
    version: int
    size: int
    chunk_size: int
    #: The key grants for this version are checked under: this process's, for the address it
    #: announced (blobha.core.grants.serve_key); b"" until a master gave it, refusing all.
    #: Replaced when a plan brings another (the cluster secret was rotated).
    serve_key: bytes
    path: Path
    have: set[int] | None = field(default_factory=set)
    #: Bytes this process served of it.
    served_bytes: int = 0

    @property
    def pieces(self) -> int:
        return max(1, -(-self.size // self.chunk_size))


class _Bucket:
    """A token bucket shared by every connection: the node's upload limit."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self._tokens = float(rate)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= min(n, self.rate):
                    self._tokens -= n
                    return
                wait = (min(n, self.rate) - self._tokens) / self.rate
            time.sleep(wait)  # pacing the upload, not waiting for another thread


class PeerServer:
    """A threaded TCP server (TLS when ``tls`` is given). :meth:`offer` and :meth:`update`
    say what it may serve; every request re-checks that the file is still there (an evicted
    version is no longer served)."""

    def __init__(self, settings: PeerSettings, host: str,
                 tls: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self.tls = tls
        self._versions: dict[tuple[str, int], Served] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(settings.connections)
        # Threads for connections: those served, and as many that are being refused or have
        # not shown a valid grant yet. A connection beyond is closed, not given a thread.
        self._threads = threading.BoundedSemaphore(2 * settings.connections)
        # A connection's first request, read (and its grant checked) before it took a slot,
        # for _answer to take instead of reading the next.
        self._first = threading.local()
        self._bucket = _Bucket(settings.upload_bytes_per_sec)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("0.0.0.0", settings.port))
        self._sock.listen(64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.refusals = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="blobha-peer-server",
                                        daemon=True)
        self._thread.start()

    # -- what is served --------------------------------------------------------------------

    def offer(self, served: Served) -> Served:
        with self._lock:
            old = self._versions.get((served.key, served.version))
            if old is not None:
                served.served_bytes = old.served_bytes
            self._versions[(served.key, served.version)] = served
        return served

    def withdraw(self, key: str, version: int) -> None:
        with self._lock:
            self._versions.pop((key, version), None)

    def add_piece(self, served: Served, piece: int) -> None:
        with self._lock:
            if served.have is not None:
                served.have.add(piece)

    def rekey(self, key: str, version: int, serve_key: bytes) -> None:
        """Check grants for ``key`` v``version`` under ``serve_key`` from now on (a plan brought
        it: the first for a version found installed, another after a rotated secret)."""
        with self._lock:
            served = self._versions.get((key, version))
            if served is not None and serve_key:
                served.serve_key = serve_key

    def served(self) -> list[Served]:
        with self._lock:
            return list(self._versions.values())

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    # -- serving ---------------------------------------------------------------------------

    def _accept(self) -> None:
        Doorway(self._sock, FIRST_REQUEST_SECS, log, "peer server").run(self._stopped,
                                                                         self._start)

    def _start(self, conn: socket.socket, deadline: float) -> None:
        if not self._threads.acquire(blocking=False):
            conn.close()  # a flood: no thread for each
            return
        try:
            threading.Thread(target=self._serve, args=(conn, deadline),
                             name="blobha-peer-conn", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: this peer is refused, not the rest
            log.warning("peer server: cannot start a thread (%s); a connection is closed", e)
            self._threads.release()
            conn.close()

    def _serve(self, raw: socket.socket, deadline: float) -> None:
        conn: socket.socket = raw
        slot = False
        try:
            raw.settimeout(max(0.1, deadline - time.monotonic()))
            if self.tls is not None:
                conn = self.tls.wrap_socket(raw, server_side=True)
            request = wire.read_request(conn)
            if request is None or self._granted(conn, request) is None:
                return
            # A slot only for a request with a valid grant: others cannot take them all.
            if not self._slots.acquire(blocking=False):
                wire.send_answer(conn, wire.BUSY, "", "busy: too many peers at once")
                return
            slot = True
            conn.settimeout(IO_TIMEOUT)
            self._first.request = request
            while self._answer(conn):
                pass
        except (OSError, ssl.SSLError, wire.PeerProtocolError) as e:
            log.debug("peer connection ended: %s", e)
        finally:
            if slot:
                self._slots.release()
            with contextlib.suppress(OSError):
                conn.close()
            self._threads.release()

    def _granted(self, conn: socket.socket, request: wire.Request) -> Served | None:
        """What ``request`` asks for, if its grant verifies and is for the host the connection
        comes from; else REFUSED is sent and None returned. A version not served has no key
        to check a grant under: refused too, in the same words, so that a requester without a
        grant learns nothing of what is held."""
        with self._lock:
            served = self._versions.get((request.key, request.version))
        try:
            if served is None:
                raise GrantRefused("not served")
            check_grant(served.serve_key, request.grant, request.key, request.version,
                        host_key(str(conn.getpeername()[0])))
        except GrantRefused as e:
            self.refusals += 1
            log.debug("peer request for %r v%d refused: %s", request.key, request.version, e)
            # Why is told only when the grant verified: its holder had it from a master.
            wire.send_answer(conn, wire.REFUSED, "",
                             f"grant refused: {e}" if e.told else _NO_GRANT)
            return None
        return served

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one request; False when the connection is to end."""
        request: wire.Request | None = getattr(self._first, "request", None)
        self._first.request = None
        if request is None:
            request = wire.read_request(conn)
            if request is None:
                return False
        served = self._granted(conn, request)
        if served is None:
            return False
        if not served.path.exists():
            self.withdraw(served.key, served.version)  # evicted, or moved
            wire.send_answer(conn, wire.NOT_HELD, "",
                             f"this cache does not serve {request.key!r} v{request.version}")
            return True
        with self._lock:
            have = None if served.have is None else set(served.have)
        bitmap = wire.encode_have(have, served.pieces)
        piece = request.piece
        if not 0 <= piece < served.pieces:
            wire.send_answer(conn, wire.BAD_REQUEST, bitmap,
                             f"piece {piece} of {served.pieces}")
            return False
        if have is not None and piece not in have:
            wire.send_answer(conn, wire.NOT_HELD, bitmap, f"piece {piece} not held yet")
            return True
        start = piece * served.chunk_size
        length = min(served.chunk_size, served.size - start)
        try:
            f = open(served.path, "rb")  # noqa: SIM115 - closed below, after the send
        except OSError:
            wire.send_answer(conn, wire.NOT_HELD, bitmap, "the file went meanwhile")
            return True
        with f:
            if os.fstat(f.fileno()).st_size < start + length:
                wire.send_answer(conn, wire.NOT_HELD, bitmap, "the file is short")
                return True
            self._bucket.take(length)
            wire.send_answer(conn, wire.OK, bitmap, size=length)
            # From the page cache to the socket in the kernel (os.sendfile; a TLS socket
            # sends through its own buffer): the piece never passes through Python, which at
            # fan-out scale is where the node's CPU went. A file cut short meanwhile ends the
            # connection mid-piece; the requester takes the piece elsewhere.
            if conn.sendfile(f, start, length) != length:
                raise wire.PeerProtocolError("the file went short while it was sent")
        served.served_bytes += length
        return True


def advertised_host(master: str) -> str:
    """The address this node reaches ``master`` (host:port) from: the one peers can reach it
    at too, as they share the masters' network. No packet is sent (UDP connect)."""
    host = master.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
