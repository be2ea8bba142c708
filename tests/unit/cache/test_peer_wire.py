"""The requester's reads of a peer's answer and piece: by a deadline for the whole, however the
bytes trickle in."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from blobha.cache.peers import wire


def test_a_trickle_ends_at_the_deadline_not_at_each_read() -> None:
    requester, peer = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.05):  # a byte far sooner than any per-read time-out
            peer.sendall(b"x")

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        started = time.monotonic()
        with pytest.raises(wire.TooSlow):
            wire.recv_by(requester, 1 << 20, started + 0.5)
        assert time.monotonic() - started < 2.0
    finally:
        stop.set()
        sender.join()
        requester.close()
        peer.close()


def test_what_comes_in_time_is_read_whole() -> None:
    requester, peer = socket.socketpair()
    with requester, peer:
        peer.sendall(b"abc")
        got = wire.recv_by(requester, 3, time.monotonic() + 5)
        assert got is not None and bytes(got) == b"abc"
        peer.shutdown(socket.SHUT_WR)
        assert wire.recv_by(requester, 1, time.monotonic() + 5) is None  # closed first


def test_an_answer_header_has_the_same_deadline() -> None:
    requester, peer = socket.socketpair()
    with requester, peer:
        peer.sendall(bytes([wire.OK]))  # then nothing
        with pytest.raises(wire.TooSlow):
            wire.read_answer(requester, time.monotonic() + 0.2)
