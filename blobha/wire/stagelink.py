"""A stage link: one data-channel connection from the leader to a holder that carries the
batches of forwarded small writes (StageVersions) for as long as the leader keeps it.

Why it exists: with a write quorum of 2, every small write waits for one forward. Through
gRPC's Python stack each call cost the holder about a millisecond of CPU and the leader half
of one, more than the holder's own work (an append and a sync); a frame on a connection kept
open costs a few system calls. Authorisation stays in gRPC: ``BeginStaging`` with ``link``
set is refused to anyone but a master, and answered with a data-channel ticket for one link.
Every batch carries the leader's epoch and is fenced as a StageVersions call is.

After the ticket is accepted (blobha.wire.datachannel: ``MAGIC``, ticket; ``MAGIC``, OK)::

    leader -> holder   header length (4 bytes, big-endian), header: JSON
                       {"epoch": E, "versions": [[key, size, digest], ...]},
                       then the versions' bytes, one after the other
    holder -> leader   OK (1 byte), length (4 bytes), JSON list of booleans, one per version
                       or FAILED (1 byte), the error's gRPC status code (1 byte),
                       length (4 bytes), a UTF-8 reason

and again, until the leader sends a header length of 0 or closes. The holder closes a link
idle for :data:`SERVER_IDLE_SECS`; the leader opens another for a link idle for
:data:`CLIENT_IDLE_SECS` rather than find out on a write. Over TLS the same bytes go through
the channel's TLS (every part is length-delimited, so no half-close is needed).
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from collections.abc import Callable, Sequence

from blobha.core.errors import BlobError, InvalidArgument, Unavailable, from_status
from blobha.wire.datachannel import FAILED, IO_TIMEOUT, OK, open_channel, recv_exact, time_limit

__all__ = ["CLIENT_IDLE_SECS", "SERVER_IDLE_SECS", "StageLink", "open_stage_link",
           "serve_stage_link"]

#: A version to stage: (key, size, digest, bytes).
Version = tuple[str, int, str, bytes]
#: The holder's staging: (user, epoch, versions) -> one bool per version, or raises.
Stage = Callable[[str, int, list[Version]], list[bool]]

HEAD = 4
#: Largest header a holder reads: the key names and digests of one call's versions.
MAX_HEADER = 1024 * 1024
#: Largest batch of bytes a holder reads: a StageVersions call's bound, with room.
MAX_BATCH_BYTES = 8 * 1024 * 1024
#: A holder closes a link that carried nothing for this long.
SERVER_IDLE_SECS = 60.0
#: A leader does not send on a link idle this long (the holder may be closing it); it opens
#: another. Well below SERVER_IDLE_SECS.
CLIENT_IDLE_SECS = 20.0


class StageLink:
    """The leader's end of one link. Not shared between threads: one batch at a time."""

    def __init__(self, conn: socket.socket, where: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._conn = conn
        self._where = where
        self._clock = clock
        self.used = clock()
        self.closed = False

    def fresh(self) -> bool:
        """Whether it may still carry a batch (not closed, not idle past CLIENT_IDLE_SECS)."""
        return not self.closed and self._clock() - self.used < CLIENT_IDLE_SECS

    def stage(self, epoch: int, versions: Sequence[Version], timeout: float) -> list[bool]:
        """Send one batch; the holder's answer. Raises the holder's own error, or
        :class:`Unavailable` (the link closed) when the link failed: it is then unusable."""
        header = json.dumps({"epoch": epoch, "versions": [[k, n, d] for k, n, d, _ in versions]},
                            ensure_ascii=False).encode()
        try:
            time_limit(self._conn, timeout)
            self._conn.sendall(len(header).to_bytes(HEAD, "big") + header
                               + b"".join(data for _, _, _, data in versions))
            status = recv_exact(self._conn, 1)
            if status is None:
                raise OSError("the holder closed the link")
            if status[0] == OK:
                answer = json.loads(_body(self._conn))
            elif status[0] == FAILED:
                code = recv_exact(self._conn, 1)
                if code is None:
                    raise OSError("the holder closed the link")
                error = _error(code[0], _body(self._conn).decode("utf-8", "replace"))
                self.used = self._clock()
                raise error
            else:
                raise OSError(f"unknown answer {status[0]}")
        except (OSError, ValueError) as e:
            self.close()
            raise Unavailable(f"stage link to {self._where} failed: {e}") from None
        if (not isinstance(answer, list) or len(answer) != len(versions)
                or not all(isinstance(a, bool) for a in answer)):
            self.close()
            raise Unavailable(f"stage link to {self._where} answered {answer!r:.100}")
        self.used = self._clock()
        return answer

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self._conn.sendall(bytes(HEAD))  # length 0: the end
        self._conn.close()


def open_stage_link(host: str, port: int, ticket: bytes, timeout: float,
                    tls: ssl.SSLContext | None = None) -> StageLink:
    """A link to the data channel at ``host:port`` that accepted ``ticket``. Raises what
    :func:`blobha.wire.datachannel.receive` raises for a channel it cannot use."""
    conn = open_channel(host, port, ticket, timeout, tls)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return StageLink(conn, f"{host}:{port}")


def _body(conn: socket.socket) -> bytes:
    head = recv_exact(conn, HEAD)
    if head is None:
        raise OSError("the link closed mid-answer")
    n = int.from_bytes(head, "big")
    if n > MAX_HEADER:
        raise OSError(f"an answer of {n} bytes")
    body = recv_exact(conn, n)
    if body is None:
        raise OSError("the link closed mid-answer")
    return body


def _error(code: int, reason: str) -> BlobError:
    import grpc  # here, as in blobha.core.errors: importing this module does not load grpc

    status = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.INTERNAL)
    return from_status(status, reason)


def serve_stage_link(conn: socket.socket, user: str, stage: Stage,
                     translate: Callable[[Exception], BlobError]) -> int:
    """The holder's end: stage each batch that arrives and answer it, until the leader ends
    the link, closes it, or leaves it idle for SERVER_IDLE_SECS; the batches served. A batch
    that breaks the format ends the link (nothing of it is staged)."""
    served = 0
    while True:
        time_limit(conn, SERVER_IDLE_SECS)
        head = recv_exact(conn, HEAD)
        if head is None:
            return served
        n = int.from_bytes(head, "big")
        if n == 0:
            return served
        if n > MAX_HEADER:
            raise OSError(f"a stage link header of {n} bytes; at most {MAX_HEADER}")
        time_limit(conn, IO_TIMEOUT)  # the rest of a batch comes at once
        raw = recv_exact(conn, n)
        if raw is None:
            return served
        epoch, wanted = _header(raw)
        total = sum(size for _, size, _ in wanted)
        if total > MAX_BATCH_BYTES:
            raise OSError(f"a stage link batch of {total} bytes; at most {MAX_BATCH_BYTES}")
        data = recv_exact(conn, total) if total else b""
        if data is None:
            return served
        versions: list[Version] = []
        at = 0
        for key, size, digest in wanted:
            versions.append((key, size, digest, data[at:at + size]))
            at += size
        try:
            staged = stage(user, epoch, versions)
        except Exception as e:  # answered to the leader, as the gRPC call's error would be
            error = translate(e)
            reason = str(error).encode("utf-8")[:4096]
            conn.sendall(bytes([FAILED, error.code.value[0]]) + len(reason).to_bytes(HEAD, "big")
                         + reason)
        else:
            body = json.dumps(staged).encode()
            conn.sendall(bytes([OK]) + len(body).to_bytes(HEAD, "big") + body)
        served += 1


def _header(raw: bytes) -> tuple[int, list[tuple[str, int, str]]]:
    """A batch header's epoch and (key, size, digest) list; a malformed one is the leader's
    error, which ends the link."""
    try:
        doc = json.loads(raw)
        epoch = doc["epoch"]
        wanted = [(str(k), int(n), str(d)) for k, n, d in doc["versions"]]
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"a malformed stage link header: {e}") from None
    if not isinstance(epoch, int) or any(n < 0 for _, n, _ in wanted):
        raise InvalidArgument("a malformed stage link header")
    return epoch, wanted
