"""Accepting connections without giving them anything before they speak: a connection waits in
the accepting thread's selector, costing a descriptor and no thread, until its first bytes come
(then it is handed on) or its time is up (then it is closed); when too many wait, the oldest is
closed. So connections that send nothing, from anyone who can reach the port, hold no thread
and no slot of a server that gives one to each connection it serves (the data channel, the node
caches' piece servers)."""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

__all__ = ["MAX_WAITING", "Doorway", "handshake_by", "recv_exact_by"]

#: Connections that have sent nothing yet, kept at once.
MAX_WAITING = 256


class Doorway:
    def __init__(self, listener: socket.socket, first_secs: float, log: logging.Logger,
                 what: str, max_waiting: int = MAX_WAITING) -> None:
        self.listener = listener
        #: Seconds from a connection's accept to its first bytes.
        self.first_secs = first_secs
        self.max_waiting = max_waiting
        self._log = log
        self._what = what

    def run(self, stopped: threading.Event,
            ready: Callable[[socket.socket, float], None]) -> None:
        """Accept until ``stopped`` (or the listener is closed); hand each connection whose
        first bytes came to ``ready(conn, deadline)``, ``deadline`` (monotonic) being its
        accept time plus ``first_secs``."""
        waiting: dict[socket.socket, float] = {}
        try:
            with selectors.DefaultSelector() as sel:
                try:
                    sel.register(self.listener, selectors.EVENT_READ)
                except (ValueError, OSError):
                    if stopped.is_set():
                        return  # stopped, and the listener closed, before this thread ran
                    raise
                while not stopped.is_set():
                    try:
                        self._round(sel, waiting, ready)
                    except OSError as e:
                        if stopped.is_set():
                            return
                        # Out of descriptors, say: keep listening, without spinning.
                        self._log.warning("%s: accept failed (%s); still listening",
                                          self._what, e)
                        stopped.wait(0.1)
        finally:
            for conn in waiting:
                conn.close()

    def _round(self, sel: selectors.BaseSelector, waiting: dict[socket.socket, float],
               ready: Callable[[socket.socket, float], None]) -> None:
        now = time.monotonic()
        for conn in [c for c, due in waiting.items() if due <= now]:
            sel.unregister(conn)
            del waiting[conn]
            conn.close()  # nothing sent in time
        soonest = min(waiting.values(), default=now + 0.5)
        for key, _ in sel.select(timeout=max(0.0, min(0.5, soonest - now))):
            if key.fileobj is self.listener:
                try:
                    conn, _ = self.listener.accept()
                except BlockingIOError:
                    continue
                if len(waiting) >= self.max_waiting:
                    oldest = next(iter(waiting))
                    sel.unregister(oldest)
                    del waiting[oldest]
                    oldest.close()
                sel.register(conn, selectors.EVENT_READ)
                waiting[conn] = time.monotonic() + self.first_secs
                continue
            conn = key.fileobj  # type: ignore[assignment]
            sel.unregister(conn)
            ready(conn, waiting.pop(conn))


def handshake_by(context: ssl.SSLContext, conn: socket.socket, deadline: float
                 ) -> ssl.SSLSocket:
    """``conn`` wrapped in server-side TLS, its handshake done by ``deadline`` (monotonic),
    whatever the pace of the other end: a socket time-out bounds each wait for bytes, so a
    client sending its hello a byte at a time would hold the thread much longer. Raises
    TimeoutError past the deadline, or what the handshake raises."""
    conn.setblocking(False)
    secure = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
    while True:
        try:
            secure.do_handshake()
            break
        except ssl.SSLWantReadError:
            events = selectors.EVENT_READ
        except ssl.SSLWantWriteError:
            events = selectors.EVENT_WRITE
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the TLS handshake did not end in time")
        with selectors.DefaultSelector() as sel:
            sel.register(secure, events)
            sel.select(left)
    secure.setblocking(True)
    return secure


def recv_exact_by(conn: socket.socket, n: int, deadline: float) -> bytes | None:
    """Exactly ``n`` bytes by ``deadline`` (monotonic), however they are paced; None if the
    other end closed first. Raises TimeoutError past the deadline."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{n} bytes did not come in time")
        conn.settimeout(left)
        data = conn.recv(n - len(buf))
        if not data:
            return None
        buf += data
    return bytes(buf)
