"""The masters' kazoo handler: select() through one poll(2), with select()'s contract."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from blobha.zk.connection import PollHandler, poll_select


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_nothing_to_read_times_out_with_empty_lists(pair: tuple[socket.socket, socket.socket]
                                                    ) -> None:
    a, _ = pair
    assert poll_select([a], [], [], 0) == ([], [], [])


def test_waiting_bytes_make_exactly_that_socket_readable(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    c, d = socket.socketpair()
    try:
        b.send(b"x")
        readable, writable, exceptional = poll_select([c, a], [], [], 1.0)
        assert readable == [a] and writable == [] and exceptional == []
    finally:
        c.close()
        d.close()


def test_a_socket_with_room_is_writable_and_not_readable(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    assert poll_select([a], [a], [], 1.0) == ([], [a], [])


def test_a_closed_peer_counts_as_readable_so_recv_reports_it(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.close()
    assert poll_select([a], [], [], 1.0)[0] == [a]
    assert a.recv(1) == b""


def test_plain_descriptors_work_too(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.send(b"x")
    assert poll_select([a.fileno()], [], [], 1.0)[0] == [a.fileno()]


def test_descriptors_beyond_select_s_limit_work(pair: tuple[socket.socket, socket.socket]
                                                ) -> None:
    # select(2) cannot take a descriptor of 1,024 or more; a busy master has that many open.
    a, b = pair
    high = 1500
    os.dup2(a.fileno(), high)
    try:
        b.send(b"x")
        assert poll_select([high], [], [], 1.0)[0] == [high]
    finally:
        os.close(high)


def test_a_negative_timeout_and_a_closed_socket_are_refused_like_kazoo_s(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with pytest.raises(ValueError):
        poll_select([a], [], [], -1)
    b.close()
    with pytest.raises(ValueError):
        poll_select([b], [], [], 0)


def test_the_handler_selects_through_poll(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.send(b"x")
    assert PollHandler().select([a], [], [], 1.0) == ([a], [], [])


def test_a_recursive_watch_the_server_did_not_take_leaves_no_callback() -> None:
    from kazoo.client import KazooClient
    from kazoo.exceptions import ConnectionClosedError

    from blobha.zk.connection import add_recursive_watch

    zk = KazooClient(hosts="127.0.0.1:1")  # never started: every request fails
    with pytest.raises(ConnectionClosedError):
        add_recursive_watch(zk, "/blobstore", lambda e: None, timeout=5)
    # Else the callback would also take the events of one-shot watches below the path (what
    # the synchroniser falls back to when the server refuses the watch): each change twice.
    assert zk._blobha_recursive.watches == {}


def test_a_failed_re_add_keeps_the_watch_that_was_there() -> None:
    from kazoo.client import KazooClient
    from kazoo.exceptions import ConnectionClosedError

    from blobha.zk.connection import add_recursive_watch

    zk = KazooClient(hosts="127.0.0.1:1")  # never started: every request fails

    def earlier(event: object) -> None:
        pass

    with pytest.raises(ConnectionClosedError):
        add_recursive_watch(zk, "/blobstore", earlier, timeout=5)
    # As if that first add had been taken: a later re-add that fails must leave it in place.
    zk._blobha_recursive.watches["/blobstore"] = ("/blobstore/", earlier, True)
    with pytest.raises(ConnectionClosedError):
        add_recursive_watch(zk, "/blobstore", lambda e: None, timeout=5)
    assert zk._blobha_recursive.watches == {"/blobstore": ("/blobstore/", earlier, True)}
