"""The data channel: a download's or an upload's bytes over a plain TCP connection, beside gRPC.

Why it exists: through gRPC's Python server every MiB of a download is copied twice in user
space (the file read into a new buffer, then gRPC's copy of the message into its own slice)
before the kernel copies it again to the socket. On a 2-core machine where server and client
each use a full core, that put downloads at 0.55-0.78x of a raw gRPC stream (``perf``: the
kernel's copies 21%, ``memmove`` 19%), and gRPC offers no way to send from a file. Here the
master checks each chunk of the blob file against its stored digest (the next one while this
one is sent) and has the kernel send it from the page cache (``sendfile``): no copy on the way
out. The client
receives a MiB per system call into one reused buffer: one copy, by the kernel.

Authorisation stays in gRPC. A ``Download`` call with ``data_channel`` set is checked as any
download is, and answered with an offer: this channel's port and a ticket. The ticket is 16
random bytes naming one version and one byte range, single use, expiring after
:data:`TICKET_TTL` seconds. The client connects to that port on the host it called and
presents it::

    client -> master   MAGIC, ticket (16 bytes)
    master -> client   MAGIC, status (1 byte); OK: exactly the range's bytes, then the master
                       closes; any other status: a UTF-8 reason, then the master closes

A chunk that fails its digest is never sent: the master removes its copy (as the gRPC stream
does) and closes the connection early, so the client sees a short transfer and resumes from
another replica. The client verifies the whole blob's digest end to end, as over gRPC.

Uploads take the channel for the same reason the other way round: through gRPC the leader
copied every byte twice in user space (gRPC's slices into a message, the message into the temp
file's write) and handled a message per MiB on its serving threads: 0.6-1.0 s of the leader's
CPU per GiB (0.2 s of it user time), against 0.34-0.45 s over the channel. A
``GetUploadStatus`` call with ``data_channel`` set is checked as any call on the session is
(its user, the leader's own session table) and answered with an offer for the session from the
bytes received so far. The ticket names the user and the session, single use, with the same
expiry. Then::

    client -> master   MAGIC, ticket (16 bytes)
    master -> client   MAGIC, status (1 byte); not OK: a UTF-8 reason, then the master closes
    client -> master   the upload's bytes from the offer's offset on; then it shuts down its
                       sending side (the end of this segment, not of the blob)
    master -> client   status (1 byte), bytes received in all (8 bytes, big-endian); FAILED:
                       then the error's gRPC status code (1 byte) and a UTF-8 reason

The master appends each MiB as ``AppendUpload`` would (the same checks, durability and
idempotence), so whatever arrived before a broken connection is kept and the client resumes
from ``GetUploadStatus``. An append that fails (a full disk, the session aborted) is answered at
once with FAILED; the master then reads what is still in flight until the client, which looks
for an answer between pieces, stops sending, so the answer is not lost to a reset connection.
The client commits with ``CommitUpload`` as always, and its digest covers every byte.

The channel carries no TLS: a master with TLS configured offers none, and its downloads stay in
the encrypted gRPC stream. Without TLS the ticket crosses the network as the caller's token
already does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from blobha.core.errors import (
    BlobError,
    ChecksumMismatch,
    InternalError,
    KeyNotFound,
    Unavailable,
    from_status,
)

if TYPE_CHECKING:  # clients import this module; only masters have a store
    from blobha.store.local import LocalStore, VersionInfo

__all__ = ["DataChannelUnusable", "DataChannels", "DataOffer", "DataPlane", "receive",
           "send_upload"]

log = logging.getLogger("blobha.dataplane")

MAGIC = b"BHD1"
TICKET_BYTES = 16
#: Seconds a ticket stays valid: the client connects at once, so this only bounds leftovers.
TICKET_TTL = 60.0
#: Outstanding tickets at most; beyond it the oldest are dropped (their clients fall back).
MAX_TICKETS = 10_000
#: Seconds a connection may take to present its ticket, or stall while data moves.
IO_TIMEOUT = 30.0
#: Seconds a client waits to connect, and for the master's answer to its ticket, before it uses
#: the gRPC stream instead (something else listening there may never answer).
CONNECT_TIMEOUT = 3.0
#: Bytes a client receives per system call (and hands on per callback).
RECEIVE_BYTES = 1024 * 1024
#: Bytes queued before a receiving client is woken (SO_RCVLOWAT).
WAKE_BYTES = 256 * 1024
#: Smallest range that takes the channel (a download's, or an upload's rest); smaller ones stay
#: in gRPC, since a connection of its own costs more than the copies it saves.
MIN_BYTES = 1024 * 1024
#: Seconds a client keeps to the gRPC stream for a master whose data channel it could not use.
UNREACHABLE_SECS = 300.0

OK, REFUSED, BUSY, NOT_HELD, FAILED = 0, 1, 2, 3, 4
_REASON_MAX = 4096
#: Seconds a master keeps reading an upload it answered with FAILED, so that the client, which
#: checks for an answer between pieces, reads it before the connection is reset.
DRAIN_SECS = 10.0


class DataChannelUnusable(Unavailable):
    """The data channel cannot be used: use the gRPC stream. ``lasting`` when it cannot be
    reached or answers as something else (a firewall, a published gRPC port without this one),
    so the caller stops asking that master for a while; not when the master is only busy."""

    def __init__(self, message: str, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


@dataclass(frozen=True)
class DataOffer:
    """What a ``Download`` call answers instead of data: the channel's port and a ticket."""

    port: int
    ticket: bytes


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


#: How a master appends an upload's bytes (Master.append): (user, upload id, offset, data) ->
#: bytes received in all. Raises what AppendUpload would.
Append = Callable[[str, str, int, memoryview], int]


class _ClientGone(Exception):
    """The socket failed while sending: the client went away or stalled."""


class DataPlane:
    """A master's data channel: a listening socket, a thread accepting on it, and one thread per
    connection (at most ``max_connections`` at once; more are told BUSY and use gRPC)."""

    def __init__(self, store: LocalStore, host: str, port: int, max_connections: int = 64,
                 ttl: float = TICKET_TTL, clock: Callable[[], float] = time.monotonic,
                 append: Append | None = None,
                 translate: Callable[[Exception], BlobError] | None = None) -> None:
        self.store = store
        self._host = host
        self._want_port = port
        self._ttl = ttl
        self._clock = clock
        self._append = append
        # An append's failure as the client should see it (service.translate_error: a full
        # disk is RESOURCE_EXHAUSTED, anything unforeseen is logged and INTERNAL).
        self._translate = translate or _as_blob_error
        self._grants: dict[bytes, _Grant | _UploadGrant] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refusing = threading.BoundedSemaphore(max_connections)
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

    def _issue(self, grant: Callable[[float], _Grant | _UploadGrant]) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = self._clock()
        with self._lock:
            if len(self._grants) >= MAX_TICKETS:
                self._expire(now)
                while len(self._grants) >= MAX_TICKETS:  # all live: drop the oldest
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

    def _take(self, ticket: bytes) -> _Grant | _UploadGrant | None:
        with self._lock:
            grant = self._grants.pop(ticket, None)
            if grant is None or grant.expires <= self._clock():
                self.refused += 1
                return None
            return grant

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("data channel: accept failed; still listening")
                self._stopping.wait(0.1)  # e.g. out of file descriptors: do not spin
                continue
            if self._slots.acquire(blocking=False):
                self._spawn(conn, self._serve, self._slots)
            elif self._refusing.acquire(blocking=False):
                self._spawn(conn, self._refuse, self._refusing)
            else:  # a flood: no thread for each (the client sees a reset and streams)
                conn.close()

    def _spawn(self, conn: socket.socket, handle: Callable[[socket.socket], None],
               slot: threading.BoundedSemaphore) -> None:
        def run() -> None:
            try:
                with conn:
                    handle(conn)
            except OSError as e:
                log.debug("data channel: connection ended early: %s", e)
            except Exception:
                log.exception("data channel: transfer failed")
            finally:
                with self._lock:
                    self._conns.pop(conn, None)
                slot.release()

        thread = threading.Thread(target=run, name="data-transfer", daemon=True)
        with self._lock:
            self._conns[conn] = thread
        thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        # The ticket is read first: closing with it unread would reset the connection, and
        # the client might lose the answer.
        conn.settimeout(CONNECT_TIMEOUT)
        _recv_exact(conn, len(MAGIC) + TICKET_BYTES)
        _answer(conn, BUSY, "too many transfers at once; use the gRPC stream")

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _recv_exact(conn, len(MAGIC) + TICKET_BYTES)
        if hello is None or hello[:len(MAGIC)] != MAGIC:
            return  # not a blobha client: nothing to say to it
        grant = self._take(hello[len(MAGIC):])
        if grant is None:
            _answer(conn, REFUSED, "unknown or expired ticket: ask for another (Download, or"
                    " GetUploadStatus for an upload)")
            return
        if isinstance(grant, _UploadGrant):
            self._receive(conn, grant)
        else:
            self._send(conn, grant)

    def _receive(self, conn: socket.socket, grant: _UploadGrant) -> None:
        """Append what the client sends to its upload session until it ends its side."""
        append = self._append
        assert append is not None  # no upload ticket is issued without it
        # Blocking, with the kernel's time limits, so MSG_WAITALL fills the buffer in one call.
        conn.settimeout(None)
        _time_limit(conn, IO_TIMEOUT)
        conn.sendall(MAGIC + bytes([OK]))
        with contextlib.suppress(OSError):  # only a wake-up hint, as for a receiving client
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, WAKE_BYTES)
        buf = bytearray(RECEIVE_BYTES)
        view = memoryview(buf)
        offset = received = grant.offset
        ended = False
        try:
            while not ended:
                filled = 0
                while filled < len(buf):
                    # 0 is the client's end; a stall past IO_TIMEOUT raises (the client
                    # resumes from GetUploadStatus, with what arrived before it appended).
                    n = conn.recv_into(view[filled:], len(buf) - filled, socket.MSG_WAITALL)
                    if n == 0:
                        ended = True
                        break
                    filled += n
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
        _time_limit(conn, DRAIN_SECS)
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
        _time_limit(conn, IO_TIMEOUT)
        out = conn.fileno()

        def opened() -> None:
            nonlocal started
            with _client_errors():
                conn.sendall(MAGIC + bytes([OK]))
            started = True

        def send(f: BinaryIO, position: int, count: int) -> None:
            nonlocal sent
            end = position + count
            while position < end:
                with _client_errors():
                    done = os.sendfile(out, f.fileno(), position, end - position)
                if done == 0:  # shorter than the chunk just checked: changed under us
                    raise OSError(errno.EIO, f"the file ended at byte {position}")
                position += done
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


def _answer(conn: socket.socket, status: int, reason: str) -> None:
    conn.sendall(MAGIC + bytes([status]) + reason.encode("utf-8")[:_REASON_MAX])


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        piece = conn.recv(n - len(buf))
        if not piece:
            return None
        buf += piece
    return bytes(buf)


def _open(host: str, port: int, ticket: bytes, timeout: float) -> socket.socket:
    """A connection to the data channel at ``host:port`` that accepted ``ticket``: blocking,
    with kernel time limits of at most :data:`IO_TIMEOUT` (see :func:`receive` for the
    errors)."""
    try:
        conn = socket.create_connection((host, port), timeout=min(CONNECT_TIMEOUT, timeout))
    except OSError as e:
        raise DataChannelUnusable(f"data channel {host}:{port} unreachable: {e}") from None
    try:
        try:
            # Blocking, with kernel time-outs, so MSG_WAITALL fills the buffer in one call.
            conn.settimeout(None)
            _time_limit(conn, min(timeout, CONNECT_TIMEOUT))  # a master answers at once
            conn.sendall(MAGIC + ticket)
            head = _recv_exact(conn, len(MAGIC) + 1)
            _time_limit(conn, min(timeout, IO_TIMEOUT))
        except OSError as e:
            raise DataChannelUnusable(f"data channel {host}:{port}: {e}") from None
        if head is None or head[:len(MAGIC)] != MAGIC:
            raise DataChannelUnusable(f"{host}:{port} is not a blobha data channel")
        status = head[-1]
        if status != OK:
            reason = _read_reason(conn)
            if status == BUSY:
                raise DataChannelUnusable(f"data channel {host}:{port}: {reason}", lasting=False)
            if status == NOT_HELD:
                raise KeyNotFound(reason)
            raise Unavailable(f"data channel {host}:{port} refused the transfer: {reason}")
    except BaseException:
        conn.close()
        raise
    return conn


def receive(host: str, port: int, ticket: bytes, size: int, timeout: float,
            on_data: Callable[[memoryview], object]) -> None:
    """Take ``size`` bytes offered with ``ticket`` from the data channel at ``host:port``,
    handing them to ``on_data`` in pieces of up to :data:`RECEIVE_BYTES`: views of one reused
    buffer, valid only during the call (a caller that keeps them copies them).

    Raises :class:`DataChannelUnusable` when the channel cannot be reached, answers as
    something else or is busy; :class:`KeyNotFound` ("not held here") when the master cannot
    serve the version after all; :class:`Unavailable` when it refuses the ticket or the
    transfer stops early (what arrived was handed on, so the caller resumes after it)."""
    with _open(host, port, ticket, timeout) as conn:
        buf = bytearray(min(RECEIVE_BYTES, size))
        view = memoryview(buf)
        # Woken once this much is queued, not for every segment: on loopback this halved the
        # CPU of both ends. Lowered for a last piece smaller than it, which would otherwise
        # wait for bytes that never come.
        wake = min(WAKE_BYTES, size)
        got = 0
        try:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(wake, 1))
            while got < size:
                want = min(len(buf), size - got)
                try:
                    if want < wake:
                        wake = want
                        with contextlib.suppress(OSError):  # as above: only a wake-up hint
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wake)
                    n = conn.recv_into(view[:want], want, socket.MSG_WAITALL)
                except OSError as e:
                    raise Unavailable(f"data channel {host}:{port} failed after {got} of"
                                      f" {size} bytes: {e}") from None
                if n:
                    on_data(view[:n])
                    got += n
                if n < want:
                    raise Unavailable(f"data channel {host}:{port} stopped after {got} of"
                                      f" {size} bytes")
        finally:
            view.release()


def send_upload(host: str, port: int, ticket: bytes, timeout: float,
                pieces: Iterable[bytes | memoryview]) -> int:
    """Send ``pieces`` over the data channel at ``host:port`` for the upload offered with
    ``ticket``, and return the bytes the master has received in all (the offset to go on
    from). An error raised while drawing a piece (the input's) goes through unchanged; the
    master keeps what it was sent before.

    Raises :class:`DataChannelUnusable` as :func:`receive` does (nothing was sent: the caller
    uses ``AppendUpload``); the master's own error (a full disk: :class:`ResourceExhausted`,
    the session gone: :class:`UploadNotFound`, ...) when it refused the bytes; and
    :class:`Unavailable` when the connection broke without an answer (the caller asks
    ``GetUploadStatus`` where to resume)."""
    with _open(host, port, ticket, timeout) as conn:
        sent = 0
        # poll, not select: a client may hold more than FD_SETSIZE descriptors.
        answer = select.poll()
        answer.register(conn, select.POLLIN)
        try:
            for piece in pieces:  # outside the socket's error handling: the input's own
                if answer.poll(0):
                    break  # only a refusal comes before the end: stop sending, read it
                try:
                    conn.sendall(piece)
                except OSError as e:
                    raise _Broken(str(e)) from None
                sent += len(piece)
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError as e:
                raise _Broken(str(e)) from None
            return _upload_answer(conn, host, port)
        except _Broken as e:
            # A refusal may have arrived before the reset that failed the send.
            with contextlib.suppress(Unavailable):
                _upload_answer(conn, host, port)
            raise Unavailable(f"data channel {host}:{port} failed after {sent} bytes of the"
                              f" upload: {e}") from None


class _Broken(Exception):
    """Sending on the data channel failed."""


def _upload_answer(conn: socket.socket, host: str, port: int) -> int:
    """The master's answer to an upload: the bytes received in all, or its error raised."""
    try:
        head = _recv_exact(conn, 9)
    except OSError as e:
        raise Unavailable(f"data channel {host}:{port} gave no answer to the upload: {e}"
                          ) from None
    if head is None:
        raise Unavailable(f"data channel {host}:{port} closed without answering the upload")
    if head[0] == OK:
        return int.from_bytes(head[1:], "big")
    code = _recv_exact(conn, 1) if head[0] == FAILED else None
    reason = _read_reason(conn)
    if code is None:
        raise Unavailable(f"data channel {host}:{port} answered the upload with status"
                          f" {head[0]}: {reason}")
    import grpc  # here, as in blobha.core.errors: importing this module does not load grpc

    status = next((c for c in grpc.StatusCode if c.value[0] == code[0]),
                  grpc.StatusCode.INTERNAL)
    raise from_status(status, reason)


def _time_limit(conn: socket.socket, secs: float) -> None:
    """How long a blocking send or receive on ``conn`` may wait for progress."""
    limit = struct.pack("ll", int(secs), int(secs % 1 * 1e6))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


def _read_reason(conn: socket.socket) -> str:
    data = bytearray()
    with contextlib.suppress(OSError):
        while len(data) < _REASON_MAX:
            piece = conn.recv(_REASON_MAX - len(data))
            if not piece:
                break
            data += piece
    return data.decode("utf-8", "replace") or "no reason given"


class DataChannels:
    """A caller's side of the masters' data channels (a client, or a master syncing): taking
    an offer, and which masters' channels to leave alone. One it could not use is not asked
    for :data:`UNREACHABLE_SECS`, so a firewalled port costs one failed connection every few
    minutes, not one per download."""

    def __init__(self, hold: float = UNREACHABLE_SECS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._hold = hold
        self._clock = clock
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def usable(self, address: str) -> bool:
        with self._lock:
            until = self._until.get(address)
            if until is None:
                return True
            if until <= self._clock():
                del self._until[address]
                return True
            return False

    def take(self, address: str, host: str, offer: DataOffer, size: int, timeout: float,
             on_data: Callable[[memoryview], object]) -> bool:
        """:func:`receive` the range ``address`` offered; False, with nothing received, when
        its channel cannot be used: the caller then streams it from the same master."""
        try:
            receive(host, offer.port, offer.ticket, size, timeout, on_data)
        except DataChannelUnusable as e:
            self.failed(address, e)
            return False
        return True

    def failed(self, address: str, error: DataChannelUnusable) -> None:
        if not error.lasting:
            return
        with self._lock:
            self._until[address] = self._clock() + self._hold
        log.warning("%s; transfers with %s use the gRPC stream for the next %.0f s", error,
                    address, self._hold)
