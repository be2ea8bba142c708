"""A peer that trickles: announced through a real plan, it answers OK to every request and then
sends the piece a byte at a time, each byte sooner than any per-read time-out. A piece from a
peer has a deadline for the whole of it (blobha.cache.peers.fetch.piece_deadline), so the
download ends, with the true bytes, within a bound derived from it, and the trickler is
dropped."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

from support.harness import client_for

from blobha.cache import BlobCache
from blobha.cache.peers import fetch, wire
from blobha.cache.peers.schedule import MAX_FAILURES, PER_PEER
from blobha.ops.localcluster import LocalCluster

MiB = 1024 * 1024
SIZE = 6 * MiB
#: Seconds between two bytes of the trickler: well inside the old per-read time-out of 5 s.
DRIP = 0.5


class Trickler:
    """A fake peer: every request gets OK, a bitmap saying it holds every piece, and then
    one byte per :data:`DRIP` until the connection ends."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.stopped = threading.Event()
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.conns.append(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, wire.PeerProtocolError):
            while not self.stopped.is_set():
                # The request's header, whatever its format: its length follows the magic.
                head = wire.recv_exact(conn, len(wire.MAGIC) + 4)
                if head is None:
                    return
                body = wire.recv_exact(conn, int.from_bytes(head[-4:], "big"))
                if body is None:
                    return
                with self.lock:
                    self.requests += 1
                wire.send_answer(conn, wire.OK, "all", size=MiB)
                for _ in range(MiB):
                    if self.stopped.wait(DRIP):
                        return
                    conn.sendall(b"\0")

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()
        with self.lock:
            conns, threads = list(self.conns), list(self.threads)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        for t in [self._accepting, *threads]:
            t.join(10)


def test_a_trickling_peer_cannot_stall_a_download(cluster: LocalCluster,
                                                  tmp_path: Path) -> None:
    key = f"trickle-{os.getpid()}"
    data = os.urandom(SIZE)
    with client_for(cluster, "alice") as alice:
        alice.create(key, data, acl="u:alice:rwa,u:mallory:r", replication_factor=3)
        alice.wait_for_replication([key], min_replication=3, timeout=30)
    trickler = Trickler()
    got: list[bytes] = []
    errors: list[BaseException] = []

    def get() -> None:
        try:
            with BlobCache(tmp_path / "node", cluster.cluster, user="alice",
                           peers=True) as cache:
                got.append(cache.get(key).path.read_bytes())
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)

    getter = threading.Thread(target=get, daemon=True)
    try:
        # mallory, a reader, announces the trickler as a holder of the version.
        with client_for(cluster, "mallory") as mallory:
            mallory.peer_plan(key, 0, trickler.address, complete=True)
        # The trickler holds at most PER_PEER pieces at once; each ends by its deadline,
        # and one more may be given it between its first failure and the one that drops it
        # (MAX_FAILURES), which ends within a second deadline. The rest of the 6 MiB comes
        # from the replicas meanwhile: 20 s covers that and the plans on a loaded machine.
        deadline = fetch.piece_deadline(MiB)
        bound = 2 * deadline + 20.0
        started = time.monotonic()
        getter.start()
        getter.join(bound)
        took = time.monotonic() - started
        assert not getter.is_alive(), f"the download stalled past {bound:.0f} s"
        assert not errors, errors
        assert got == [data]
        assert trickler.requests >= 1, "the trickler was never asked: the attack was not tried"
        # Dropped: asked at most its in-flight share plus one per failure before the drop.
        assert trickler.requests <= PER_PEER + MAX_FAILURES - 1, trickler.requests
        print(f"took {took:.1f} s (bound {bound:.0f} s), {trickler.requests} requests to the"
              " trickler")
    finally:
        trickler.stop()
        getter.join(120)
