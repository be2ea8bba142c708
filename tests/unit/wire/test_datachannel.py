"""The data channel (blobha.wire.datachannel): a real store and a real socket on 127.0.0.1."""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

from blobha.client.sources import BufferSink
from blobha.core.digest import CHUNK_SIZE, digest_bytes
from blobha.core.errors import (
    BlobError,
    InvalidArgument,
    KeyNotFound,
    ResourceExhausted,
    Unavailable,
    UploadNotFound,
    upload_not_found,
)
from blobha.core.keys import key_dirname
from blobha.master.edge.datachannel import DataChannelServer
from blobha.master.edge.service import translate_error
from blobha.store.local import BlobBuffer, LocalStore
from blobha.v1 import blobha_pb2 as pb
from blobha.wire import datachannel
from blobha.wire.chunks import Chunk
from blobha.wire.datachannel import DataChannels, DataChannelUnusable, receive, send_upload
from blobha.wire.peers import Peers

DATA = os.urandom(3 * CHUNK_SIZE + 12345)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    s = LocalStore(tmp_path / "store")
    temp = s.new_temp("upload")
    temp.write_at(0, DATA)
    s.install("k", 1, temp, len(DATA), digest_bytes(DATA))
    yield s
    s.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def plane(store: LocalStore, clock: Clock) -> Iterator[DataChannelServer]:
    p = DataChannelServer(store, "127.0.0.1", 0, max_connections=2, clock=clock)
    p.start()
    yield p
    p.stop()


def grant(plane: DataChannelServer, offset: int, end: int) -> bytes:
    info = plane.store.info("k", 1)
    assert info is not None
    return plane.offer(info, offset, end)


def fetch(plane: DataChannelServer, ticket: bytes, size: int) -> tuple[bytes, list[int]]:
    got = bytearray()
    pieces: list[int] = []

    def take(view: memoryview) -> None:
        got.extend(view)
        pieces.append(len(view))

    receive("127.0.0.1", plane.port, ticket, size, 10.0, take)
    return bytes(got), pieces


@pytest.mark.parametrize("offset,end", [
    (0, len(DATA)),  # whole
    (CHUNK_SIZE - 7, 2 * CHUNK_SIZE + 9),  # across chunk boundaries
    (3 * CHUNK_SIZE + 5, len(DATA)),  # the short last chunk
    (100, 100),  # empty
])
def test_a_ticket_brings_exactly_its_range(plane: DataChannelServer, offset: int, end: int) -> None:
    data, pieces = fetch(plane, grant(plane, offset, end), end - offset)
    assert data == DATA[offset:end]
    assert all(n <= datachannel.RECEIVE_BYTES for n in pieces)
    # The master counts once its send returns, which may be after the client has everything.
    wait_until(lambda: plane.transfers == 1, what="the transfer counted")
    assert plane.bytes_sent == end - offset


def test_a_sink_that_keeps_the_pieces_keeps_copies(plane: DataChannelServer) -> None:
    # The pieces are views of one reused buffer: kept as they are, they would all end up
    # holding the last MiB (the digest, taken on the fly, would not notice).
    kept = BufferSink()
    receive("127.0.0.1", plane.port, grant(plane, 0, len(DATA)), len(DATA), 10.0, kept.write)
    assert len(kept.parts) > 1 and b"".join(kept.parts) == DATA


def test_a_ticket_is_good_for_one_transfer(plane: DataChannelServer) -> None:
    ticket = grant(plane, 0, 10)
    assert fetch(plane, ticket, 10)[0] == DATA[:10]
    with pytest.raises(Unavailable, match="unknown or expired ticket") as e:
        fetch(plane, ticket, 10)
    assert not isinstance(e.value, DataChannelUnusable)  # the master is there: retry elsewhere
    assert plane.refused == 1


def test_an_expired_ticket_is_refused(plane: DataChannelServer, clock: Clock) -> None:
    ticket = grant(plane, 0, 10)
    clock.now += datachannel.TICKET_TTL
    with pytest.raises(Unavailable, match="unknown or expired ticket"):
        fetch(plane, ticket, 10)
    assert plane.outstanding() == 0


def test_a_forged_ticket_is_refused(plane: DataChannelServer) -> None:
    grant(plane, 0, 10)
    with pytest.raises(Unavailable, match="unknown or expired ticket"):
        fetch(plane, os.urandom(datachannel.TICKET_BYTES), 10)
    assert plane.outstanding() == 1  # the real one is untouched


def test_a_corrupt_chunk_is_never_sent_and_the_copy_is_removed(
        plane: DataChannelServer, store: LocalStore) -> None:
    removed: list[tuple[str, int]] = []
    store.on_corrupt = lambda key, seq: removed.append((key, seq))
    path = store.keys_dir / key_dirname("k") / "v1.blob"
    with open(path, "r+b") as f:
        f.seek(2 * CHUNK_SIZE + 3)
        f.write(bytes([DATA[2 * CHUNK_SIZE + 3] ^ 0xFF]))
    got = bytearray()
    with pytest.raises(Unavailable, match=f"stopped after {2 * CHUNK_SIZE} of"):
        receive("127.0.0.1", plane.port, grant(plane, 0, len(DATA)), len(DATA), 10.0,
                got.extend)
    # The two good chunks arrived (the client resumes after them elsewhere), nothing of the bad.
    assert bytes(got) == DATA[:2 * CHUNK_SIZE]
    assert removed == [("k", 1)] and store.info("k", 1) is None


def test_a_version_removed_after_the_offer_is_not_held_here(
        plane: DataChannelServer, store: LocalStore) -> None:
    ticket = grant(plane, 0, len(DATA))
    store.delete_version("k", 1)
    with pytest.raises(KeyNotFound, match=r"^not held here"):
        fetch(plane, ticket, len(DATA))


def test_no_listener_is_unusable_for_a_while() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(DataChannelUnusable, match="unreachable") as e:
            receive("127.0.0.1", port, b"t" * 16, 10, 5.0, lambda v: None)
    assert e.value.lasting


def test_something_else_on_the_port_is_unusable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(DataChannelUnusable, match="not a blobha data channel"):
            receive("127.0.0.1", server.getsockname()[1], b"t" * 16, 10, 5.0, lambda v: None)
        t.join(10)


def test_a_listener_that_never_answers_is_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datachannel, "CONNECT_TIMEOUT", 0.2)
    # Accepts (the backlog does) and never answers.
    with socket.create_server(("127.0.0.1", 0)) as server, pytest.raises(
            DataChannelUnusable) as e:
        receive("127.0.0.1", server.getsockname()[1], b"t" * 16, 10, 5.0, lambda v: None)
    assert e.value.lasting


def test_a_busy_master_sends_the_client_to_grpc_for_this_download_only(
        plane: DataChannelServer) -> None:
    # Both slots taken, as by two transfers under way.
    for _ in range(2):
        assert plane._slots.acquire(blocking=False)
    try:
        with pytest.raises(DataChannelUnusable, match="too many transfers") as e:
            fetch(plane, grant(plane, 0, 10), 10)
        assert not e.value.lasting
    finally:
        for _ in range(2):
            plane._slots.release()


def test_connections_that_send_nothing_take_no_slot(plane: DataChannelServer) -> None:
    # More idle connections than slots and threads: a client with a ticket is still served.
    held = [socket.create_connection(("127.0.0.1", plane.port)) for _ in range(10)]
    try:
        assert fetch(plane, grant(plane, 0, 10), 10)[0] == DATA[:10]
    finally:
        for s in held:
            s.close()


def test_unreachable_masters_are_skipped_for_the_hold_time(clock: Clock) -> None:
    u = DataChannels(hold=60.0, clock=clock)
    u.failed("m1:6627", DataChannelUnusable("busy", lasting=False))
    assert u.usable("m1:6627")
    u.failed("m1:6627", DataChannelUnusable("refused"))
    assert not u.usable("m1:6627") and u.usable("m2:6627")
    clock.now += 60.0
    assert u.usable("m1:6627")


def test_outstanding_tickets_are_bounded(store: LocalStore, clock: Clock) -> None:
    plane = DataChannelServer(store, "127.0.0.1", 0, max_connections=2, clock=clock, max_tickets=3)
    plane.start()
    try:
        tickets = [grant(plane, 0, 10) for _ in range(5)]
        assert plane.outstanding() == 3
        with pytest.raises(Unavailable, match="unknown or expired"):
            fetch(plane, tickets[0], 10)  # the oldest went first
        assert fetch(plane, tickets[-1], 10)[0] == DATA[:10]
    finally:
        plane.stop()


class _OfferingStub:
    """A peer whose Download offers a data channel at ``port`` when asked for one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.requests: list[pb.DownloadRequest] = []

    def Download(self, request: pb.DownloadRequest, **kw: object) -> _Call:
        self.requests.append(request)
        return _Call(self._chunks(request))

    def _chunks(self, request: pb.DownloadRequest) -> Iterator[Chunk]:
        info = pb.BlobInfo(version=1, size=len(DATA), digest="d")
        if request.data_channel:
            yield Chunk(info, memoryview(b""), self.port, b"t" * 16)
            return
        yield Chunk(info, memoryview(DATA[request.offset:]))


class _Call:
    """A server-streaming call as gRPC returns it: iterable, and cancellable."""

    def __init__(self, messages: Iterator[Chunk]) -> None:
        self.messages = messages
        self.cancelled = False

    def __iter__(self) -> Iterator[Chunk]:
        return self.messages

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@pytest.mark.parametrize("busy", [False, True])
def test_a_syncing_master_streams_when_the_channel_fails(busy: bool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        if not busy:
            server.close()  # refused: lasting

        def refuse_busy() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(datachannel.MAGIC + bytes([datachannel.BUSY]) + b"too many")

        t = threading.Thread(target=refuse_busy, daemon=True)
        if busy:
            t.start()
        peers = Peers("blobha-master")
        stub = _OfferingStub(port)
        peers._stub = lambda address: stub  # type: ignore[method-assign,assignment,return-value]
        dest = BlobBuffer()
        peers.fetch("127.0.0.1:1", "k", 1, "d", dest, 5.0)
    assert dest.value() == DATA
    # One offer, then one stream: never a second offer in a row.
    assert [r.data_channel for r in stub.requests] == [True, False]
    assert peers._data_channels.usable("127.0.0.1:1") is busy


def test_an_unreadable_copy_is_not_held_here_not_a_broken_channel(
        plane: DataChannelServer, store: LocalStore) -> None:
    ticket = grant(plane, 0, len(DATA))
    path = store.keys_dir / key_dirname("k") / "v1.blob"
    path.unlink()
    path.mkdir()  # opening it fails with an OSError other than "not found"
    with pytest.raises(KeyNotFound, match=r"^not held here"):
        fetch(plane, ticket, len(DATA))


def test_stop_ends_the_transfers_in_progress(store: LocalStore, clock: Clock) -> None:
    big = bytes(32 * CHUNK_SIZE)  # more than both sockets' buffers hold
    temp = store.new_temp("upload")
    temp.write_at(0, big)
    info = store.install("big", 1, temp, len(big), digest_bytes(big))
    plane = DataChannelServer(store, "127.0.0.1", 0, clock=clock)
    plane.start()
    ticket = plane.offer(info, 0, len(big))
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", plane.port))
        client.sendall(datachannel.MAGIC + ticket)
        client.settimeout(10)
        # The transfer is under way: its first bytes are here. The master goes on sending and
        # is soon blocked on this reader, who reads nothing more until the plane stops.
        got = len(client.recv(4096))
        assert got > 0
        assert plane._conns
        plane.stop()
        assert not plane._conns  # every transfer thread is done: none touches the store now
        while piece := client.recv(1 << 20):
            got += len(piece)
        assert got < len(big) + 5  # cut short, not completed


# ---- uploads ------------------------------------------------------------------------------


class Sessions:
    """Master.append's part for the channel: one upload session in a real temp file, and an
    error to raise once ``fail_after`` bytes are in."""

    def __init__(self, store: LocalStore) -> None:
        self.temp = store.new_temp("upload")
        self.users: set[str] = set()
        self.fail_after: int | None = None
        self.error: Exception = ResourceExhausted("the disk is full; free space and retry")

    def append(self, user: str, upload_id: str, offset: int, data: memoryview) -> int:
        assert upload_id == "up-1"
        self.users.add(user)
        if self.fail_after is not None and self.temp.size + len(data) > self.fail_after:
            raise self.error
        self.temp.write_at(offset, data)
        return self.temp.size


@pytest.fixture
def sessions(store: LocalStore) -> Iterator[Sessions]:
    s = Sessions(store)
    yield s
    s.temp.discard()


@pytest.fixture
def uploads(store: LocalStore, clock: Clock, sessions: Sessions) -> Iterator[DataChannelServer]:
    p = DataChannelServer(store, "127.0.0.1", 0, max_connections=2, clock=clock,
                          append=sessions.append,
                          translate=lambda e: translate_error("m1:6627", "an upload", e))
    p.start()
    yield p
    p.stop()


def pieces_of(data: bytes, size: int = CHUNK_SIZE) -> Iterator[memoryview]:
    view = memoryview(data)
    for at in range(0, len(data), size):
        yield view[at:at + size]


def send(plane: DataChannelServer, ticket: bytes, pieces: Iterable[bytes | memoryview]) -> int:
    return send_upload("127.0.0.1", plane.port, ticket, 10.0, pieces)


def test_an_upload_appends_what_arrives_and_answers_the_total(
        uploads: DataChannelServer, sessions: Sessions) -> None:
    first, rest = DATA[:2 * CHUNK_SIZE + 5], DATA[2 * CHUNK_SIZE + 5:]
    ticket = uploads.offer_upload("alice", "up-1", 0)
    assert ticket is not None
    # Pieces of any size; the master appends a MiB at a time.
    assert send(uploads, ticket, pieces_of(first, 300_000)) == len(first)
    ticket = uploads.offer_upload("alice", "up-1", len(first))
    assert ticket is not None
    assert send(uploads, ticket, pieces_of(rest)) == len(DATA)
    digest, _, size = sessions.temp.finish()
    assert (digest, size) == (digest_bytes(DATA), len(DATA))
    assert sessions.users == {"alice"}  # the grant's user, for the session's own check
    assert uploads.bytes_received == len(DATA)
    wait_until(lambda: uploads.uploads == 2, what="both segments counted")


def test_an_upload_ticket_is_good_for_one_connection(uploads: DataChannelServer,
                                                     sessions: Sessions) -> None:
    ticket = uploads.offer_upload("alice", "up-1", 0)
    assert ticket is not None
    assert send(uploads, ticket, [b"x" * 10]) == 10
    with pytest.raises(Unavailable, match="unknown or expired ticket"):
        send(uploads, ticket, [b"y" * 10])
    assert sessions.temp.size == 10


def test_a_plane_made_without_append_offers_no_upload(plane: DataChannelServer) -> None:
    assert plane.offer_upload("alice", "up-1", 0) is None


@pytest.mark.parametrize("error,expected,words", [
    (ResourceExhausted("the disk is full; free space and retry"), ResourceExhausted,
     "the disk is full"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), ResourceExhausted, "out of disk space"),
    (upload_not_found("up-1"), UploadNotFound, "begin a new upload"),
    (InvalidArgument("chunk at offset 9 leaves a gap"), InvalidArgument, "leaves a gap"),
])
def test_a_refused_append_is_answered_while_the_client_is_still_sending(
        uploads: DataChannelServer, sessions: Sessions, error: Exception, expected: type[BlobError],
        words: str) -> None:
    sessions.fail_after = 2 * CHUNK_SIZE
    sessions.error = error
    drawn = 0

    def many() -> Iterator[bytes]:
        # Far more than the sockets' buffers hold: the client must notice the answer and
        # stop, not send it all (nor fail on a reset connection without the answer).
        nonlocal drawn
        piece = bytes(CHUNK_SIZE)
        for _ in range(256):
            drawn += 1
            yield piece

    ticket = uploads.offer_upload("alice", "up-1", 0)
    assert ticket is not None
    with pytest.raises(expected, match=words) as raised:
        send(uploads, ticket, many())
    assert type(raised.value) is expected
    assert drawn < 64
    assert sessions.temp.size == 2 * CHUNK_SIZE  # what was appended before stays


def test_an_input_error_goes_through_and_what_was_sent_is_kept(uploads: DataChannelServer,
                                                               sessions: Sessions) -> None:
    def failing() -> Iterator[bytes]:
        yield DATA[:CHUNK_SIZE]
        yield DATA[CHUNK_SIZE:2 * CHUNK_SIZE]
        raise OSError(errno.EIO, "the input could not be read")

    ticket = uploads.offer_upload("alice", "up-1", 0)
    assert ticket is not None
    with pytest.raises(OSError, match="the input could not be read"):
        send(uploads, ticket, failing())
    # The master saw the connection end and appended what had arrived: the client resumes
    # from there (GetUploadStatus), or aborts.
    wait_until(lambda: sessions.temp.size == 2 * CHUNK_SIZE, what="the two pieces appended")


def test_a_ticket_sent_a_byte_at_a_time_holds_a_thread_no_longer_than_the_connect_time(
        plane: DataChannelServer) -> None:
    import time

    conn = socket.create_connection(("127.0.0.1", plane.port))
    conn.settimeout(0.1)
    start = time.monotonic()
    closed = False
    try:
        # 20 bytes, one every 0.5 s: each wait for bytes is short, the whole is not.
        for byte in (datachannel.MAGIC + b"\0" * datachannel.TICKET_BYTES):
            try:
                conn.sendall(bytes([byte]))
                if conn.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:
                closed = True
                break
            if time.monotonic() - start > 2 * datachannel.CONNECT_TIMEOUT + 1:
                break
            time.sleep(0.5)  # the attacker's pace: the sleep is the attack, not a wait
    finally:
        conn.close()
    assert closed, "the master kept reading a trickled ticket"
    assert time.monotonic() - start < 2 * datachannel.CONNECT_TIMEOUT + 1
