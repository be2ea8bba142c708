"""The master's end of the data channel: the listening socket, its tickets, and the threads that
send a version's bytes (``sendfile``; read and encrypted over TLS) or append an upload's. The
wire format and the client end are in :mod:`blobha.wire.datachannel`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

from blobha.core.errors import BlobError, ChecksumMismatch, InternalError, KeyNotFound
from blobha.store.local import LocalStore, VersionInfo
from blobha.wire.accepting import Doorway, handshake_by, recv_exact_by
from blobha.wire.datachannel import (
    _REASON_MAX,
    BUSY,
    CONNECT_TIMEOUT,
    DRAIN_SECS,
    FAILED,
    FRAME_HEAD,
    IO_TIMEOUT,
    MAGIC,
    MAX_TICKETS,
    NOT_HELD,
    OK,
    RECEIVE_BYTES,
    REFUSED,
    TICKET_BYTES,
    TICKET_TTL,
    WAKE_BYTES,
    fill,
    recv_exact,
    send_file_range,
    time_limit,
)
from blobha.wire.datatls import ReloadingServerContext
from blobha.wire.stagelink import Stage, serve_stage_link

log = logging.getLogger("blobha.dataplane")  # operators route by this name: it stays

__all__ = ["Append", "DataChannelServer"]


@dataclass(frozen=True)
class _Grant:
    info: VersionInfo
    offset: int
    end: int
    expires: float


@dataclass(frozen=True)
class _UploadGrant:
    """An upload session's bytes from ``offset`` on, for ``user`` (whose session it is)."""

    user: str
    upload_id: str
    offset: int
    expires: float


@dataclass(frozen=True)
class _LinkGrant:
    """A stage link for ``user`` (a master forwarding writes; blobha.wire.stagelink)."""

    user: str
    expires: float


#: How a master appends an upload's bytes (Master.append): (user, upload id, offset, data) ->
#: bytes received in all. Raises what AppendUpload would.
Append = Callable[[str, str, int, memoryview], int]


class _ClientGone(Exception):
    """The socket failed while sending: the client went away or stalled."""


class DataChannelServer:
    """A master's data channel: a listening socket, a thread accepting on it, and one thread per
    connection that has sent its first bytes (at most ``max_connections`` transfers at once;
    more are told BUSY and use gRPC).

    Nothing is given to a connection before it shows a valid ticket: until its first bytes
    come (within CONNECT_TIMEOUT) it waits in the accepting thread's selector, its ticket is
    read within CONNECT_TIMEOUT too, and only a valid one takes a transfer slot. Idle or slow
    connections, from anyone who can reach the port, cannot take every slot or thread."""

    def __init__(self, store: LocalStore, host: str, port: int, max_connections: int = 64,
                 ttl: float = TICKET_TTL, clock: Callable[[], float] = time.monotonic,
                 append: Append | None = None,
                 translate: Callable[[Exception], BlobError] | None = None,
                 max_tickets: int = MAX_TICKETS,
                 tls: ReloadingServerContext | None = None,
                 stage: Stage | None = None) -> None:
        self.store = store
        #: With TLS, every connection is a TLS one (the master's certificate, and in mTLS mode
        #: a client certificate from its CA), before the ticket is read.
        self.tls = tls
        self._max_tickets = max_tickets
        self._host = host
        self._want_port = port
        self._ttl = ttl
        self._clock = clock
        self._append = append
        self._stage = stage
        # An append's failure as the client should see it (service.translate_error: a full
        # disk is RESOURCE_EXHAUSTED, anything unforeseen is logged and INTERNAL).
        self._translate = translate or _as_blob_error
        self._grants: dict[bytes, _Grant | _UploadGrant | _LinkGrant] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        # Threads for connections: the transfers, and as many reading a ticket or refusing.
        self._threads = threading.BoundedSemaphore(2 * max_connections)
        # Chunk checks run here, each beside its transfer's sends (LocalStore.send_verified).
        self._checker = ThreadPoolExecutor(max_connections, thread_name_prefix="send-verify")
        # Live connections and their threads, so stop() ends them before the store closes.
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.port = 0
        # Figures for the metrics (blobha.master.edge.metrics), updated under _lock.
        self.transfers = 0
        self.bytes_sent = 0
        self.refused = 0
        self.uploads = 0
        self.bytes_received = 0
        self.links = 0

    def start(self) -> None:
        """Bind (an ephemeral port for port 0, then in ``port``) and start accepting."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        self._sock = socket.create_server((self._host, self._want_port), family=family,
                                          backlog=128)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="data-channel",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, end the transfers in progress (their clients resume elsewhere) and
        wait for their threads, so none touches the store after this returns."""
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in conns.values():
            thread.join(5)
        self._checker.shutdown(wait=True, cancel_futures=True)

    def offer(self, info: VersionInfo, offset: int, end: int) -> bytes:
        """A ticket for bytes ``[offset, end)`` of the version ``info``; the caller has checked
        that the user may read it and that this master holds it."""
        return self._issue(lambda expires: _Grant(info, offset, end, expires))

    def offer_upload(self, user: str, upload_id: str, offset: int) -> bytes | None:
        """A ticket for ``user`` to send the upload session ``upload_id`` from ``offset`` on;
        the caller has checked that the session is the user's. None: this channel takes no
        uploads (it was made without an ``append``)."""
        if self._append is None:
            return None
        return self._issue(lambda expires: _UploadGrant(user, upload_id, offset, expires))

    def offer_stage_link(self, user: str) -> bytes | None:
        """A ticket for a stage link of ``user``, a master the caller checked; None: this
        channel stages nothing (it was made without a ``stage``)."""
        if self._stage is None:
            return None
        return self._issue(lambda expires: _LinkGrant(user, expires))

    def _issue(self, grant: Callable[[float], _Grant | _UploadGrant | _LinkGrant]) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = self._clock()
        with self._lock:
            if len(self._grants) >= self._max_tickets:
                self._expire(now)
                while len(self._grants) >= self._max_tickets:  # all live: drop the oldest
                    del self._grants[next(iter(self._grants))]
            self._grants[ticket] = grant(now + self._ttl)
        return ticket

    def outstanding(self) -> int:
        """Tickets issued and neither used nor expired."""
        with self._lock:
            self._expire(self._clock())
            return len(self._grants)

    def _expire(self, now: float) -> None:
        # Lock held. Grants are in issue order, and every one has the same lifetime.
        while self._grants:
            ticket, grant = next(iter(self._grants.items()))
            if grant.expires > now:
                return
            del self._grants[ticket]

    def _take(self, ticket: bytes) -> _Grant | _UploadGrant | _LinkGrant | None:
        with self._lock:
            grant = self._grants.pop(ticket, None)
            if grant is None or grant.expires <= self._clock():
                self.refused += 1
                return None
            return grant

    def _accept_loop(self) -> None:
        assert self._sock is not None
        Doorway(self._sock, CONNECT_TIMEOUT, log, "data channel").run(self._stopping,
                                                                       self._spawn)

    def _spawn(self, conn: socket.socket, first: float) -> None:
        """Serve ``conn``, whose first bytes came before ``first`` (monotonic): its TLS
        handshake and ticket must come within CONNECT_TIMEOUT of that, however paced."""
        deadline = first + CONNECT_TIMEOUT
        if not self._threads.acquire(blocking=False):
            conn.close()  # a flood: no thread for each (the client sees a reset and streams)
            return

        def run() -> None:
            try:
                with conn:
                    conn.setblocking(True)
                    secure = self._secure(conn, deadline)
                    if secure is not None:
                        with secure:
                            self._handle(secure, deadline)
            except BlobError:  # an OSError too (KeyNotFound, Unavailable...), not the socket's
                log.exception("data channel: transfer failed")
            except OSError as e:
                log.debug("data channel: connection ended early: %s", e)
            except Exception:
                log.exception("data channel: transfer failed")
            finally:
                with self._lock:
                    for end in [c for c, t in self._conns.items()
                                if t is threading.current_thread()]:
                        del self._conns[end]
                self._threads.release()

        thread = threading.Thread(target=run, name="data-transfer", daemon=True)
        with self._lock:
            self._conns[conn] = thread
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had: this client streams, the rest go on
            log.warning("data channel: cannot start a thread (%s); a connection is closed", e)
            with self._lock:
                self._conns.pop(conn, None)
            self._threads.release()
            conn.close()

    def _secure(self, conn: socket.socket, deadline: float) -> socket.socket | None:
        """``conn``, over TLS when the channel has it; None when its handshake fails (a client
        without the CA's trust or certificate, or one speaking plaintext: nothing it sent, a
        ticket included, is read)."""
        if self.tls is None:
            return conn
        try:
            secure = handshake_by(self.tls.current(), conn, deadline)
        except (ssl.SSLError, OSError) as e:
            log.info("data channel: TLS handshake failed: %s", e)
            return None
        with self._lock:
            # stop() ends connections through the socket that now owns the descriptor.
            thread = self._conns.pop(conn, None)
            if thread is not None:
                self._conns[secure] = thread
        return secure

    def _handle(self, conn: socket.socket, deadline: float) -> None:
        # The ticket by the deadline: a client sends it at once; a slow sender holds this
        # thread no longer, and no slot at all.
        hello = recv_exact_by(conn, len(MAGIC) + TICKET_BYTES, deadline)
        if hello is None or hello[:len(MAGIC)] != MAGIC:
            return  # not a blobha client: nothing to say to it
        if not self._slots.acquire(blocking=False):
            # The ticket stays unused: the client asks the gRPC stream for the same range.
            _answer(conn, BUSY, "too many transfers at once; use the gRPC stream")
            return
        try:
            self._serve(conn, hello[len(MAGIC):])
        finally:
            self._slots.release()

    def _serve(self, conn: socket.socket, ticket: bytes) -> None:
        conn.settimeout(IO_TIMEOUT)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        grant = self._take(ticket)
        if grant is None:
            _answer(conn, REFUSED, "unknown or expired ticket: ask for another (Download, or"
                    " GetUploadStatus for an upload)")
            return
        if isinstance(grant, _UploadGrant):
            self._receive(conn, grant)
        elif isinstance(grant, _LinkGrant):
            assert self._stage is not None  # no link ticket is issued without it
            conn.sendall(MAGIC + bytes([OK]))
            conn.settimeout(None)  # the link's own time limits (blobha.wire.stagelink)
            with self._lock:
                self.links += 1
            serve_stage_link(conn, grant.user, self._stage, self._translate)
        else:
            self._send(conn, grant)

    def _receive(self, conn: socket.socket, grant: _UploadGrant) -> None:
        """Append what the client sends to its upload session until it ends its side."""
        append = self._append
        assert append is not None  # no upload ticket is issued without it
        # Blocking, with the kernel's time limits, so MSG_WAITALL fills the buffer in one call.
        conn.settimeout(None)
        time_limit(conn, IO_TIMEOUT)
        conn.sendall(MAGIC + bytes([OK]))
        framed = isinstance(conn, ssl.SSLSocket)
        if not framed:  # TLS reads records of a few KiB: each would wait for the mark
            with contextlib.suppress(OSError):  # a wake-up hint, as for a receiving client
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, WAKE_BYTES)
        buf = bytearray(RECEIVE_BYTES)
        view = memoryview(buf)
        offset = received = grant.offset
        ended = False
        frame = 0  # bytes of the current frame still to come (over TLS)
        try:
            while not ended:
                filled = 0
                while filled < len(buf):
                    # 0 is the client's end; a stall past IO_TIMEOUT raises (the client
                    # resumes from GetUploadStatus, with what arrived before it appended).
                    if framed and frame == 0:
                        frame = _frame(conn)
                        if frame == 0:
                            ended = True
                            break
                    want = min(len(buf) - filled, frame) if framed else len(buf) - filled
                    n = fill(conn, view[filled:filled + want])
                    if n < want and framed:
                        return  # cut off mid-frame: no end, no answer (the client resumes)
                    if n == 0:
                        ended = True
                        break
                    filled += n
                    frame -= n if framed else 0
                if not filled:
                    break
                try:
                    received = append(grant.user, grant.upload_id, offset, view[:filled])
                except Exception as e:  # every failure is answered to the client, not raised
                    self._refuse_upload(conn, e, received)
                    return
                offset += filled
                with self._lock:
                    self.bytes_received += filled
            conn.sendall(bytes([OK]) + received.to_bytes(8, "big"))
        finally:
            view.release()
        with self._lock:
            self.uploads += 1

    def _refuse_upload(self, conn: socket.socket, e: Exception, received: int) -> None:
        error = self._translate(e)
        code = error.code.value[0]
        conn.sendall(bytes([FAILED]) + received.to_bytes(8, "big") + bytes([code])
                     + str(error).encode("utf-8")[:_REASON_MAX])
        conn.shutdown(socket.SHUT_WR)
        # Read what is still on its way, so closing does not reset the connection (and drop
        # the answer) before the client has read it.
        time_limit(conn, DRAIN_SECS)
        deadline = time.monotonic() + DRAIN_SECS
        sink = bytearray(RECEIVE_BYTES)
        while time.monotonic() < deadline and conn.recv_into(sink):
            pass

    def _send(self, conn: socket.socket, grant: _Grant) -> None:
        info = grant.info
        started = False
        sent = 0
        # Blocking, with the kernel's time limits: socket.sendfile on a socket with a Python
        # timeout stats the file, builds a selector and polls before every system call.
        conn.settimeout(None)
        time_limit(conn, IO_TIMEOUT)

        def opened() -> None:
            nonlocal started
            with _client_errors():
                conn.sendall(MAGIC + bytes([OK]))
            started = True

        secure = isinstance(conn, ssl.SSLSocket)
        buf = memoryview(bytearray(RECEIVE_BYTES)) if secure else None

        def send(f: BinaryIO, position: int, count: int) -> None:
            nonlocal sent
            for done in send_file_range(conn, f.fileno(), position, count, buf, conn.sendall,
                                        _client_errors):
                sent += done

        def not_held() -> None:
            if not started:
                _answer(conn, NOT_HELD, f"not held here: v{info.seq} of {info.key!r} cannot be"
                        " served from this master; read from another replica")
            # Else close early: the client sees a short transfer and resumes elsewhere.

        try:
            self.store.send_verified(info, grant.offset, grant.end, opened, send, self._checker)
        except _ClientGone as e:
            log.debug("data channel: the client went away: %s", e)  # it resumes elsewhere
        except KeyNotFound:
            not_held()  # removed since the offer (pruned, found corrupt)
        except ChecksumMismatch as e:
            log.warning("data channel: %s", e)  # the store removed the copy
            not_held()
        except OSError as e:
            log.error("data channel: cannot read v%d of %r: %s", info.seq, info.key, e)
            not_held()
        else:
            with self._lock:
                self.transfers += 1
        finally:
            with self._lock:
                self.bytes_sent += sent


def _as_blob_error(e: Exception) -> BlobError:
    return e if isinstance(e, BlobError) else InternalError(str(e))


@contextlib.contextmanager
def _client_errors() -> Iterator[None]:
    """A socket error while sending is the client gone (it resumes elsewhere), not a copy
    this master cannot read."""
    try:
        yield
    except OSError as e:
        raise _ClientGone(str(e)) from e


def _frame(conn: socket.socket) -> int:
    """The length of the next frame of an upload over TLS (0: its end; also when the client
    went away before one). A length past a frame's most is the client's error: refused."""
    head = recv_exact(conn, FRAME_HEAD)
    if head is None:
        raise OSError(errno.ECONNRESET, "the client ended the upload without its end frame")
    n = int.from_bytes(head, "big")
    if n > RECEIVE_BYTES:
        raise OSError(errno.EPROTO, f"a frame of {n} bytes; at most {RECEIVE_BYTES}")
    return n


def _answer(conn: socket.socket, status: int, reason: str) -> None:
    conn.sendall(MAGIC + bytes([status]) + reason.encode("utf-8")[:_REASON_MAX])
