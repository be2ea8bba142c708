"""The piece protocol between node caches: a connection carries requests one after another.

::

    requester -> peer   MAGIC, header length (4 bytes, big-endian), JSON header:
                        {"key", "version", "piece",
                         "grant": {"user", "expires", "requester", "mac"}}
    peer -> requester   status (1 byte), header length (4 bytes), JSON header
                        {"have": base64 bitmap of the pieces it holds, or "all";
                         "reason": why not, when not OK; "size": bytes that follow}
                        then, when OK, exactly "size" bytes: the piece

The requester checks every piece against the version's SHA-256 from the plan, and reads each
answer and piece by a deadline (:func:`recv_by`); the peer checks the grant
(blobha.core.grants) under its own key, and that it is for the host the connection comes
from. A refusal closes the connection. MAGIC names the version of the request: BHP1 grants
(one key per version, no requester) are refused by BHP2 peers and the other way round, as a
request that is not a blobha peer's, so a mixed fleet fetches from the masters."""

from __future__ import annotations

import base64
import json
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from blobha.core.grants import Grant
from blobha.wire.datachannel import recv_buffer, recv_exact

__all__ = ["BAD_REQUEST", "BUSY", "MAGIC", "NOT_HELD", "OK", "REFUSED", "Answer", "Request",
           "TooSlow", "decode_have", "encode_have", "read_answer", "read_request", "recv_buffer",
           "recv_by", "recv_exact", "send_answer"]

MAGIC = b"BHP2"
OK, REFUSED, NOT_HELD, BUSY, BAD_REQUEST = 0, 1, 2, 3, 4
NAMES = {OK: "ok", REFUSED: "refused", NOT_HELD: "not held", BUSY: "busy",
         BAD_REQUEST: "bad request"}
#: A header is small: anything longer is not a peer of ours.
MAX_HEADER = 16 * 1024
_LEN = struct.Struct(">I")


class PeerProtocolError(Exception):
    """The other end broke the protocol (or is not a blobha peer)."""


class TooSlow(PeerProtocolError):
    """The other end did not send what was asked by its deadline."""


def recv_by(conn: socket.socket, n: int, deadline: float) -> bytearray | None:
    """``n`` bytes by ``deadline`` (time.monotonic()), however they trickle in: each read may
    wait only for what is left of the time, so a byte now and then cannot stretch it. None if
    the other end closed first; :class:`TooSlow` at the deadline."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TooSlow(f"{got} of {n} bytes by the deadline")
        conn.settimeout(left)
        try:
            k = conn.recv_into(view[got:], n - got)
        except TimeoutError:
            raise TooSlow(f"{got} of {n} bytes by the deadline") from None
        if not k:
            return None
        got += k
    return buf


@dataclass(frozen=True)
class Request:
    key: str
    version: int
    piece: int
    grant: Grant

    def encode(self) -> bytes:
        g = self.grant
        head = json.dumps({"key": self.key, "version": self.version, "piece": self.piece,
                           "grant": {"user": g.user, "expires": g.expires,
                                     "requester": g.requester, "mac": g.mac}}).encode()
        return MAGIC + _LEN.pack(len(head)) + head


@dataclass(frozen=True)
class Answer:
    status: int
    have: str  # "all", or base64 of a bitmap
    reason: str
    size: int


def read_request(conn: socket.socket) -> Request | None:
    """The next request on ``conn``; None when the requester closed it."""
    head = recv_exact(conn, len(MAGIC) + _LEN.size)
    if head is None:
        return None
    if head[:len(MAGIC)] != MAGIC:
        raise PeerProtocolError("not a blobha peer request")
    (n,) = _LEN.unpack(head[len(MAGIC):])
    if n > MAX_HEADER:
        raise PeerProtocolError(f"a request header of {n} bytes")
    raw = recv_exact(conn, n)
    if raw is None:
        return None
    try:
        d: Any = json.loads(raw)
        g = d["grant"]
        # The expiry as sent (NaN and infinities included): check_grant refuses what has no
        # one text, with the same answer as any grant that does not verify.
        grant = Grant(str(g["user"]), str(d["key"]), int(d["version"]), float(g["expires"]),
                      str(g["requester"]), str(g["mac"]))
        return Request(str(d["key"]), int(d["version"]), int(d["piece"]), grant)
    except (ValueError, KeyError, TypeError) as e:
        raise PeerProtocolError(f"a malformed request: {e}") from None


def send_answer(conn: socket.socket, status: int, have: str, reason: str = "",
                size: int = 0) -> None:
    head = json.dumps({"have": have, "reason": reason, "size": size}).encode()
    conn.sendall(bytes([status]) + _LEN.pack(len(head)) + head)


def read_answer(conn: socket.socket, deadline: float | None = None) -> Answer:
    """The peer's answer; with ``deadline`` (time.monotonic()), read by then (:func:`recv_by`)
    or :class:`TooSlow`."""
    def take(n: int) -> bytes | bytearray | None:
        return recv_exact(conn, n) if deadline is None else recv_by(conn, n, deadline)

    head = take(1 + _LEN.size)
    if head is None:
        raise PeerProtocolError("the peer closed the connection")
    (n,) = _LEN.unpack(head[1:])
    if n > MAX_HEADER:
        raise PeerProtocolError(f"an answer header of {n} bytes")
    raw = take(n)
    if raw is None:
        raise PeerProtocolError("the peer closed the connection")
    try:
        d: Any = json.loads(raw)
        return Answer(head[0], str(d.get("have", "")), str(d.get("reason", "")),
                      int(d.get("size", 0)))
    except (ValueError, TypeError, AttributeError) as e:
        raise PeerProtocolError(f"a malformed answer: {e}") from None


def encode_have(have: set[int] | None, pieces: int) -> str:
    if have is None:
        return "all"
    bits = bytearray((pieces + 7) // 8)
    for i in have:
        bits[i >> 3] |= 1 << (i & 7)
    return base64.b64encode(bytes(bits)).decode()


def decode_have(text: str, pieces: int) -> set[int]:
    if text == "all":
        return set(range(pieces))
    try:
        bits = base64.b64decode(text, validate=True)
    except ValueError:
        return set()
    return {i for i in range(min(pieces, len(bits) * 8)) if bits[i >> 3] >> (i & 7) & 1}
