"""The piece server of a node cache: one per process, serving 1 MiB pieces of the versions it
holds whole and of the one it downloads (pieces written and verified), to requesters with a
grant that verifies under the version's key. Limited in connections and bytes per second."""

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
from blobha.core.grants import GrantRefused, check_grant

__all__ = ["PeerServer", "Served", "advertised_host"]

log = logging.getLogger("blobha.cache.peers")

#: Seconds a requester may take to send its next request, or stall a piece.
IO_TIMEOUT = 30.0


@dataclass
class Served:
    """One version this process serves: its file, and which pieces are in it (None: all)."""

    key: str
    version: int
    size: int
    chunk_size: int
    version_key: bytes
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
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="blobha-peer-conn",
                             daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        conn: socket.socket = raw
        try:
            raw.settimeout(IO_TIMEOUT)
            if self.tls is not None:
                conn = self.tls.wrap_socket(raw, server_side=True)
            if not self._slots.acquire(blocking=False):
                wire.read_request(conn)
                wire.send_answer(conn, wire.BUSY, "", "busy: too many peers at once")
                return
            try:
                while self._answer(conn):
                    pass
            finally:
                self._slots.release()
        except (OSError, ssl.SSLError, wire.PeerProtocolError) as e:
            log.debug("peer connection ended: %s", e)
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one request; False when the connection is to end."""
        request = wire.read_request(conn)
        if request is None:
            return False
        with self._lock:
            served = self._versions.get((request.key, request.version))
        if served is None or not served.path.exists():
            if served is not None:
                self.withdraw(served.key, served.version)  # evicted, or moved
            wire.send_answer(conn, wire.NOT_HELD, "",
                             f"this cache does not serve {request.key!r} v{request.version}")
            return True
        try:
            check_grant(served.version_key, request.grant, request.key, request.version)
        except GrantRefused as e:
            self.refusals += 1
            wire.send_answer(conn, wire.REFUSED, "", f"grant refused: {e}")
            return False
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
