"""The data channel's wire format and its client end: a download's or an upload's bytes over a
plain TCP connection, beside gRPC. The master's end is :mod:`blobha.master.edge.datachannel`.

Why it exists: through gRPC's Python server every MiB of a download is copied twice in user
space (the file read into a new buffer, then gRPC's copy of the message into its own slice)
before the kernel copies it again to the socket, and gRPC offers no way to send from a file
(the profiles are in docs/perf-log/). Here the master checks each chunk of the blob file
against its stored digest (the next one while this one is sent) and has the kernel send it
from the page cache (``sendfile``): no copy on the way out. The client receives a MiB per
system call into one reused buffer: one copy, by the kernel.

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
file's write) and handled a message per MiB on its serving threads. A
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

With TLS (a master with ``tls.cert``), the channel speaks TLS from the first byte, with the
certificates, the CA and the client verification of the master's gRPC (blobha.wire.datatls):
the ticket and the bytes cross the network encrypted. The master then cannot hand the page
cache to the socket (``sendfile`` sends plaintext), so it reads each checked chunk into a
buffer and encrypts it as it sends. An upload over TLS cannot end with a half-close (Python's
TLS socket drops its session on ``shutdown``), so its bytes go in frames, each a 4-byte
big-endian length and that many bytes, and a frame of length 0 ends the segment; the answer is
the same. Without TLS the ticket crosses the network as the caller's token already does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from blobha.core.errors import (
    KeyNotFound,
    Unavailable,
    from_status,
)

__all__ = ["DataChannelUnusable", "DataChannels", "DataOffer", "FileRange", "open_channel",
           "receive", "send_file_range", "send_upload"]

log = logging.getLogger("blobha.dataplane")  # operators route by this name: it stays

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
#: Bytes of a frame's length on an upload over TLS; a frame carries at most RECEIVE_BYTES.
FRAME_HEAD = 4
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
class FileRange:
    """``count`` bytes of the open file ``fd`` from ``offset``: a piece of an upload sent from
    the page cache (``sendfile``) instead of from a buffer."""

    fd: int
    offset: int
    count: int


@dataclass(frozen=True)
class DataOffer:
    """What a ``Download`` call answers instead of data: the channel's port and a ticket."""

    port: int
    ticket: bytes


def recv_buffer(conn: socket.socket, n: int) -> bytearray | None:
    """``n`` bytes received straight into one buffer (no copy per read, none at the end); None
    if the peer closed the connection first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            return None
        got += k
    return buf


def recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """:func:`recv_buffer`, as bytes (hashable, immutable: for headers and tickets)."""
    buf = recv_buffer(conn, n)
    return None if buf is None else bytes(buf)


def open_channel(host: str, port: int, ticket: bytes, timeout: float,
          tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to the data channel at ``host:port`` that accepted ``ticket``: blocking,
    with kernel time limits of at most :data:`IO_TIMEOUT`; over TLS with ``tls`` (see
    :func:`receive` for the errors)."""
    try:
        conn = socket.create_connection((host, port), timeout=min(CONNECT_TIMEOUT, timeout))
    except OSError as e:
        raise DataChannelUnusable(f"data channel {host}:{port} unreachable: {e}") from None
    try:
        if tls is not None:
            conn = _handshake(conn, tls, host, port)
        try:
            # Blocking, with kernel time-outs, so MSG_WAITALL fills the buffer in one call.
            conn.settimeout(None)
            time_limit(conn, min(timeout, CONNECT_TIMEOUT))  # a master answers at once
            conn.sendall(MAGIC + ticket)
            head = recv_exact(conn, len(MAGIC) + 1)
            time_limit(conn, min(timeout, IO_TIMEOUT))
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


def _handshake(conn: socket.socket, tls: ssl.SSLContext, host: str, port: int
               ) -> ssl.SSLSocket:
    """``conn`` over TLS, the master's certificate checked for ``host`` as gRPC checks it. A
    failed handshake (a certificate the caller does not trust, a channel without TLS) leaves
    the channel to the gRPC stream, which is checked the same way and says why."""
    try:
        return tls.wrap_socket(conn, server_hostname=host)
    except ssl.SSLCertVerificationError as e:
        raise DataChannelUnusable(f"data channel {host}:{port}: TLS certificate not trusted:"
                                  f" {e.verify_message}") from None
    except (ssl.SSLError, OSError) as e:
        raise DataChannelUnusable(f"data channel {host}:{port}: TLS handshake failed: {e}"
                                  ) from None


def fill(conn: socket.socket, view: memoryview) -> int:
    """Receive into all of ``view`` unless the peer ends first; the bytes received. One system
    call in plaintext (MSG_WAITALL); a TLS socket takes no flags, and fills record by record."""
    if not isinstance(conn, ssl.SSLSocket):
        return conn.recv_into(view, len(view), socket.MSG_WAITALL)
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got)
        if n == 0:
            break
        got += n
    return got


def receive(host: str, port: int, ticket: bytes, size: int, timeout: float,
            on_data: Callable[[memoryview], object], tls: ssl.SSLContext | None = None
            ) -> None:
    """Take ``size`` bytes offered with ``ticket`` from the data channel at ``host:port``,
    handing them to ``on_data`` in pieces of up to :data:`RECEIVE_BYTES`: views of one reused
    buffer, valid only during the call (a caller that keeps them copies them).

    Raises :class:`DataChannelUnusable` when the channel cannot be reached, answers as
    something else or is busy; :class:`KeyNotFound` ("not held here") when the master cannot
    serve the version after all; :class:`Unavailable` when it refuses the ticket or the
    transfer stops early (what arrived was handed on, so the caller resumes after it)."""
    with open_channel(host, port, ticket, timeout, tls) as conn:
        buf = bytearray(min(RECEIVE_BYTES, size))
        view = memoryview(buf)
        # Woken once this much is queued, not for every segment: a wake-up per segment cost
        # both ends much CPU. Lowered for a last piece smaller than it, which would otherwise
        # wait for bytes that never come. Not over TLS: its records are read a few KiB at a
        # time, and each read would wait for the mark.
        wake = 0 if tls is not None else min(WAKE_BYTES, size)
        got = 0
        try:
            if wake:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(wake, 1))
            while got < size:
                want = min(len(buf), size - got)
                try:
                    if want < wake:
                        wake = want
                        with contextlib.suppress(OSError):  # as above: only a wake-up hint
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wake)
                    n = fill(conn, view[:want])
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
                pieces: Iterable[bytes | memoryview | FileRange],
                tls: ssl.SSLContext | None = None) -> int:
    """Send ``pieces`` over the data channel at ``host:port`` for the upload offered with
    ``ticket``, and return the bytes the master has received in all (the offset to go on
    from). An error raised while drawing a piece (the input's) goes through unchanged; the
    master keeps what it was sent before. A :class:`FileRange` goes from the page cache
    without a copy in plaintext; over TLS it is read and encrypted a frame at a time.

    Raises :class:`DataChannelUnusable` as :func:`receive` does (nothing was sent: the caller
    uses ``AppendUpload``); the master's own error (a full disk: :class:`ResourceExhausted`,
    the session gone: :class:`UploadNotFound`, ...) when it refused the bytes; and
    :class:`Unavailable` when the connection broke without an answer (the caller asks
    ``GetUploadStatus`` where to resume)."""
    with open_channel(host, port, ticket, timeout, tls) as conn:
        sent = 0
        framed = isinstance(conn, ssl.SSLSocket)
        # poll, not select: a client may hold more than FD_SETSIZE descriptors.
        answer = select.poll()
        answer.register(conn, select.POLLIN)
        try:
            for piece in pieces:  # outside the socket's error handling: the input's own
                if answer.poll(0):
                    break  # only a refusal comes before the end: stop sending, read it
                try:
                    if isinstance(piece, FileRange):
                        buf = (memoryview(bytearray(min(RECEIVE_BYTES, piece.count)))
                               if framed else None)
                        sent += sum(send_file_range(conn, piece.fd, piece.offset, piece.count,
                                                    buf, lambda b: _send_frames(conn, b)))
                        continue
                    if framed:
                        _send_frames(conn, piece)
                    else:
                        conn.sendall(piece)
                except OSError as e:
                    raise _Broken(str(e)) from None
                sent += len(piece)
            try:
                if framed:
                    conn.sendall(bytes(FRAME_HEAD))  # length 0: the end
                else:
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


def _send_frames(conn: socket.socket, piece: bytes | memoryview) -> None:
    view = memoryview(piece)
    for start in range(0, len(view), RECEIVE_BYTES):
        part = view[start:start + RECEIVE_BYTES]
        conn.sendall(len(part).to_bytes(FRAME_HEAD, "big"))
        conn.sendall(part)


def send_file_range(conn: socket.socket, fd: int, position: int, count: int,
                    buf: memoryview | None, send_buffer: Callable[[memoryview], object],
                    socket_errors: Callable[[], contextlib.AbstractContextManager[object]]
                    = contextlib.nullcontext) -> Iterator[int]:
    """Send bytes ``[position, position + count)`` of the file ``fd`` on ``conn``, yielding
    the bytes each step sent: ``sendfile`` from the page cache, or, with ``buf`` (TLS, whose
    socket ``sendfile`` would bypass), read into it and handed to ``send_buffer``. Socket
    calls run inside ``socket_errors()`` (a caller may tell their errors from the file's);
    a file shorter than the range raises EIO."""
    end = position + count
    while position < end:
        if buf is not None:
            done = os.preadv(fd, [buf[:min(len(buf), end - position)]], position)
            if done:
                with socket_errors():
                    send_buffer(buf[:done])
        else:
            with socket_errors():
                done = os.sendfile(conn.fileno(), fd, position, end - position)
        if done == 0:
            raise OSError(errno.EIO, f"the file ended at byte {position} of {end}")
        position += done
        yield done


class _Broken(Exception):
    """Sending on the data channel failed."""


def _upload_answer(conn: socket.socket, host: str, port: int) -> int:
    """The master's answer to an upload: the bytes received in all, or its error raised."""
    try:
        head = recv_exact(conn, 9)
    except OSError as e:
        raise Unavailable(f"data channel {host}:{port} gave no answer to the upload: {e}"
                          ) from None
    if head is None:
        raise Unavailable(f"data channel {host}:{port} closed without answering the upload")
    if head[0] == OK:
        return int.from_bytes(head[1:], "big")
    code = recv_exact(conn, 1) if head[0] == FAILED else None
    reason = _read_reason(conn)
    if code is None:
        raise Unavailable(f"data channel {host}:{port} answered the upload with status"
                          f" {head[0]}: {reason}")
    import grpc  # here, as in blobha.core.errors: importing this module does not load grpc

    status = next((c for c in grpc.StatusCode if c.value[0] == code[0]),
                  grpc.StatusCode.INTERNAL)
    raise from_status(status, reason)


def time_limit(conn: socket.socket, secs: float) -> None:
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
                 clock: Callable[[], float] = time.monotonic,
                 tls: Callable[[], ssl.SSLContext | None] = lambda: None) -> None:
        #: The TLS to take the masters' channels with (None: plaintext), asked per transfer:
        #: renewed files bring a new one.
        self.tls = tls
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
            receive(host, offer.port, offer.ticket, size, timeout, on_data, self.tls())
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
