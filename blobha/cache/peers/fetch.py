"""One download of one version through peers and the replicas: pieces in parallel, each
checked before use (a peer's against the SHA-256 the masters computed, a master's against its
xxh3 chunk digest), the whole checked against the blob's digest."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from blobha.cache.peers import wire
from blobha.cache.peers.schedule import Assignment, Scheduler
from blobha.cache.peers.server import PeerServer, Served
from blobha.core.digest import chunk_digest, digest_stream
from blobha.core.errors import BlobError, ChecksumMismatch, NotAuthorized
from blobha.core.grants import Grant

if TYPE_CHECKING:
    from blobha.client import BlobInfo, Client, ProgressCallback
    from blobha.wire.status import PeerPlan

__all__ = ["FetchFailed", "PeerFetch", "Totals", "piece_deadline"]

log = logging.getLogger("blobha.cache.peers")

#: Seconds between plans during a download: new peers are learnt, the grant renewed. The
#: first come sooner: caches that start together learn of each other within a fraction of
#: a second.
REPLAN_SECS = 2.0
FIRST_REPLAN_SECS = 0.25
#: Seconds to connect to a peer.
PEER_TIMEOUT = 5.0
#: A piece from a peer must arrive whole within PIECE_BASE_SECS plus its size at
#: PIECE_MIN_BYTES_PER_SEC (:func:`piece_deadline`; 9 s for 1 MiB), else it is fetched
#: elsewhere and the peer counts a failure: a peer that sends a byte now and then cannot hold
#: a piece for longer. The base covers connecting, the TLS handshake and the peer's wait for
#: its upload limit before it answers; the rate is far below any link peers are worth using
#: over (100 Mbit/s shared by a peer's 8 connections is 1.5 MB/s each), so an honest peer
#: misses it only when a replica would serve the piece sooner anyway.
PIECE_BASE_SECS = 5.0
PIECE_MIN_BYTES_PER_SEC = 256 * 1024


def piece_deadline(size: int) -> float:
    """Seconds a piece of ``size`` bytes from a peer may take, from asking to the last byte."""
    return PIECE_BASE_SECS + size / PIECE_MIN_BYTES_PER_SEC


class Totals:
    """Bytes this process fetched from peers and from masters (for the fan-out harness)."""

    lock = threading.Lock()
    peer_bytes = 0
    master_bytes = 0
    bad_pieces = 0

    @classmethod
    def add(cls, peer: int = 0, master: int = 0, bad: int = 0) -> None:
        with cls.lock:
            cls.peer_bytes += peer
            cls.master_bytes += master
            cls.bad_pieces += bad


class FetchFailed(Exception):
    """The download through peers cannot go on: the caller downloads as before."""


class PeerFetch:
    def __init__(self, client: Client, key: str, target: Path, plan: PeerPlan,
                 server: PeerServer | None, use_peers: bool, parallel: int,
                 peer_tls: ssl.SSLContext | None, address: str,
                 check: Callable[[int, bytes | bytearray, bool], bool] | None = None,
                 progress: ProgressCallback | None = None,
                 distrust: Iterable[str] = ()) -> None:
        self.client = client
        self.key = key
        self.target = target
        self.plan = plan
        self.server = server
        self.use_peers = use_peers
        self.parallel = max(1, parallel)
        self.peer_tls = peer_tls
        self.address = address
        self.pieces = max(1, -(-plan.size // plan.chunk_size))
        #: A piece's check, ``check(piece, data, from_peer)``; replaceable by tests.
        self.check = check or self._digest_ok
        self.sched = Scheduler(self.pieces, list(plan.replicas), random.Random(),
                               ordinal=plan.ordinal if address else None)
        for liar in distrust:  # caught serving a forged piece before: never asked again
            self.sched.drop(liar)
        #: Peers that served a piece failing its SHA-256 in this download.
        self.liars: set[str] = set()
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        #: The grant for each peer, made for this node under that peer's key (re-plans bring
        #: new ones, and renew them).
        self.grants: dict[str, Grant] = {}
        self._take_grants(plan)
        self.served: Served | None = None
        self._idle: dict[str, list[socket.socket]] = {}
        self._progress = progress
        self._stored = 0
        #: Bytes of this download that peers served (checked and stored).
        self.peer_bytes = 0

    def _take_grants(self, plan: PeerPlan) -> None:
        """The plan's grants, and its peers that have one (a peer is asked only with its own
        grant: no other would verify)."""
        for peer, mac in plan.peer_grants:
            self.grants[peer] = Grant(plan.grant_user, self.key, plan.version,
                                      plan.grant_expires, plan.grant_requester, mac)
        if self.use_peers:
            self.sched.add_peers([p for p in plan.peers if p in self.grants])

    def _digest_ok(self, piece: int, data: bytes | bytearray, from_peer: bool) -> bool:
        if from_peer:
            # Another cache is not trusted: xxh3 can be forged on purpose, SHA-256 cannot.
            return hashlib.sha256(data).digest() == self.plan.chunk_sha256[piece]
        # A master's bytes, over the authenticated channel: xxh3 guards against accidents.
        return chunk_digest(data) == self.plan.chunk_digests[piece]

    # -- the download ----------------------------------------------------------------------

    def run(self) -> BlobInfo:
        from blobha.client import BlobInfo

        plan = self.plan
        with open(self.target, "wb") as f:
            f.truncate(plan.size)
        if self.server is not None:
            self.served = self.server.offer(Served(
                self.key, plan.version, plan.size, plan.chunk_size, plan.serve_key,
                self.target))
        self._fd = os.open(self.target, os.O_RDWR)
        try:
            if plan.size:
                workers = [threading.Thread(target=self._work, name=f"blobha-piece-{i}",
                                            daemon=True) for i in range(self.parallel)]
                planner = threading.Thread(target=self._replan, name="blobha-replan",
                                           daemon=True)
                for t in [*workers, planner]:
                    t.start()
                for t in workers:
                    t.join()
                with self.cond:
                    self.cond.notify_all()
                planner.join()
            if self.error is not None:
                raise self.error
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            for conns in self._idle.values():
                for c in conns:
                    c.close()
        with open(self.target, "rb") as f:
            digest, size = digest_stream(f)
        if size != plan.size or digest != plan.digest:
            raise ChecksumMismatch(
                f"{self.key!r} v{plan.version} assembled from pieces has digest {digest} over"
                f" {size} bytes, expected {plan.digest} over {plan.size}")
        return BlobInfo(plan.version, plan.size, plan.digest)

    def _stop(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def _replan(self) -> None:
        pause = FIRST_REPLAN_SECS
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.sched.complete() or self.error is not None,
                                   pause)
                pause = min(REPLAN_SECS, pause * 2)
                if self.sched.complete() or self.error is not None:
                    return
            try:
                plan = self.client.peer_plan(self.key, self.plan.version, self.address, False)
            except BlobError as e:
                log.debug("re-planning %r failed: %s", self.key, e)
                continue
            with self.cond:
                self._take_grants(plan)
                self.sched.set_masters(list(plan.replicas))
                if self.served is not None and plan.serve_key:
                    self.served.serve_key = plan.serve_key  # another after a rotated secret
                self.cond.notify_all()

    def _master_cap(self, now: float) -> int:
        # Once peers can serve, one request at a time goes to the masters, for pieces no peer
        # holds yet: the masters' links are the scarce ones.
        # Without peers, two: a replica's link is as fast as this node's, and pieces asked
        # for are committed to the masters, when peers may soon hold them.
        return 1 if self.sched.usable_peers(now) else min(2, self.parallel)

    def _work(self) -> None:
        while True:
            with self.cond:
                while True:
                    if self.error is not None or self.sched.complete():
                        self.cond.notify_all()
                        return
                    now = time.monotonic()
                    a = self.sched.next(now, self._master_cap(now))
                    if a is not None:
                        break
                    self.cond.wait(0.2)
            try:
                if a.from_master:
                    self._from_master(a)
                else:
                    self._from_peer(a)
            except BaseException as e:
                self._stop(e)
            finally:
                with self.cond:
                    self.sched.finished(a)
                    self.cond.notify_all()

    def _store(self, a: Assignment, piece: int, data: bytes | bytearray) -> None:
        os.pwrite(self._fd, data, piece * self.plan.chunk_size)
        with self.cond:
            self.sched.done(a, piece)
            self._stored += len(data)
            if self._progress is not None:
                self._progress(self._stored, self.plan.size)
        if self.server is not None and self.served is not None:
            self.server.add_piece(self.served, piece)

    def _piece_len(self, piece: int) -> int:
        return min(self.plan.chunk_size, self.plan.size - piece * self.plan.chunk_size)

    # -- from a replica --------------------------------------------------------------------

    def _from_master(self, a: Assignment) -> None:
        chunk = self.plan.chunk_size
        first = a.pieces[0]
        start = first * chunk
        length = sum(self._piece_len(p) for p in a.pieces)
        buf = bytearray()
        piece = first

        def take(data: memoryview) -> None:
            nonlocal piece
            buf.extend(data)
            while piece <= a.pieces[-1] and len(buf) >= self._piece_len(piece):
                n = self._piece_len(piece)
                got = bytes(buf[:n])
                del buf[:n]
                if not self.check(piece, got, False):
                    raise ChecksumMismatch(f"master {a.source} sent piece {piece} of"
                                           f" {self.key!r} with a wrong digest")
                self._store(a, piece, got)
                Totals.add(master=n)
                piece += 1

        try:
            self.client.read_range(self.key, self.plan.version, start, length, a.source, take)
        except NotAuthorized:
            raise
        except BlobError as e:
            # The replicas failed this range (the client tried each): the plain download
            # decides what to do.
            raise FetchFailed(str(e)) from e

    # -- from a peer -----------------------------------------------------------------------

    def _connect(self, peer: str) -> socket.socket:
        idle = self._idle.get(peer)
        if idle:
            with self.cond:
                if idle:
                    return idle.pop()
        host, port = peer.rsplit(":", 1)
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=PEER_TIMEOUT)
        if self.peer_tls is not None:
            conn = self.peer_tls.wrap_socket(conn, server_hostname=host)
        return conn

    def _from_peer(self, a: Assignment) -> None:
        peer, piece = a.source, a.pieces[0]
        # For the whole piece, connecting included: the time a trickle of bytes can hold it.
        deadline = time.monotonic() + piece_deadline(self._piece_len(piece))
        with self.cond:
            grant = self.grants.get(peer)
        if grant is None:  # not a peer a plan gave a grant for: nothing it would accept
            with self.cond:
                self.sched.drop(peer)
            return
        try:
            conn = self._connect(peer)
        except (OSError, ssl.SSLError) as e:
            log.info("peer %s unreachable: %s", peer, e)
            with self.cond:
                self.sched.failed(peer, bad_piece=False)
            return
        keep = False
        try:
            conn.settimeout(max(0.01, min(PEER_TIMEOUT, deadline - time.monotonic())))
            conn.sendall(wire.Request(self.key, self.plan.version, piece, grant).encode())
            answer = wire.read_answer(conn, deadline)
            have = wire.decode_have(answer.have, self.pieces) if answer.have else None
            if have is not None:
                with self.cond:
                    self.sched.learned(peer, have, time.monotonic())
            if answer.status == wire.OK:
                if answer.size != self._piece_len(piece):
                    raise wire.PeerProtocolError(f"a piece of {answer.size} bytes")
                data = wire.recv_by(conn, answer.size, deadline)
                if data is None:
                    raise wire.PeerProtocolError("the peer closed mid-piece")
                if not self.check(piece, data, True):
                    log.warning("peer %s sent piece %d of %r with a wrong digest: no more"
                                " pieces from it for this download", peer, piece, self.key)
                    Totals.add(bad=1)
                    with self.cond:
                        self.liars.add(peer)
                        self.sched.failed(peer, bad_piece=True)
                    return
                self._store(a, piece, data)
                Totals.add(peer=len(data))
                with self.cond:
                    self.peer_bytes += len(data)
                keep = True
            elif answer.status == wire.NOT_HELD:
                with self.cond:
                    self.sched.not_held(peer, piece)
                keep = True
            elif answer.status == wire.BUSY:
                with self.cond:
                    self.sched.busy(peer, time.monotonic())
            else:
                log.warning("peer %s refused piece %d of %r: %s (%s)", peer, piece, self.key,
                            answer.reason, wire.NAMES.get(answer.status, answer.status))
                with self.cond:
                    self.sched.drop(peer)
        except wire.TooSlow as e:
            log.info("peer %s missed the deadline of piece %d of %r (%.1f s: %s); fetching"
                     " it elsewhere", peer, piece, self.key,
                     piece_deadline(self._piece_len(piece)), e)
            with self.cond:
                self.sched.failed(peer, bad_piece=False)
        except (OSError, ssl.SSLError, wire.PeerProtocolError) as e:
            log.info("peer %s failed piece %d of %r: %s; fetching it elsewhere", peer, piece,
                     self.key, e)
            with self.cond:
                self.sched.failed(peer, bad_piece=False)
        finally:
            if keep:
                with self.cond:
                    self._idle.setdefault(peer, []).append(conn)
            else:
                with contextlib.suppress(OSError):
                    conn.close()
