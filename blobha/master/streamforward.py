"""The leader's forward of a streamed upload: with a write quorum above 1, the upload's bytes go
to W-1 of the key's other holders as they arrive, each into a staging session of its own
(BeginStaging, then its data channel, then FinishStaging) fed from a bounded queue by a thread
of its own, so the holders write their copies while the client still sends and the commit
waits only for their final sync.

A holder whose queue stays full past the bound (it stalled, or cannot keep up) is dropped, as is
one whose stream fails: it fetches the version after the commit through the ordinary sync, and
the write then waits for replica nodes as without forwarding. Fewer holders are forwarded to
than the placement chooses (W-1, not R-1): every forwarded copy is sent by the leader, whose
outgoing bytes would otherwise grow with R while the client's upload waits on them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

from blobha.master.forward import Forwarder

log = logging.getLogger("blobha.master")

#: Bytes queued for one holder at most: the pipeline's memory bound per holder.
QUEUE_BYTES = 32 * 1024 * 1024


class _Holder:
    """One holder's staging stream and its queue."""

    def __init__(self, address: str, max_bytes: int) -> None:
        self.address = address
        self._max = max_bytes
        self._queue: deque[bytes | tuple[int, str]] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        #: Set when the holder was given up: its session is never finished, and expires.
        self.dropped = False
        #: The (size, digest) the commit gave, once the bytes are all queued.
        self.ending: tuple[int, str] | None = None
        #: Whether the holder keeps a synced copy matching ``ending``.
        self.outcome: Future[bool] = Future()

    def pieces(self) -> Iterator[bytes]:
        """The bytes to send, as they are queued, until the end (or the holder is dropped)."""
        while True:
            with self._cond:
                while not self._queue and not self.dropped:
                    self._cond.wait()
                if self.dropped:
                    return
                piece = self._queue.popleft()
                if isinstance(piece, tuple):
                    self.ending = piece
                    return
                self._queued -= len(piece)
                self._cond.notify_all()
            yield piece

    def run(self, forwarder: Forwarder, key: str, epoch: int) -> None:
        """The holder's session, from its beginning to its confirmation (its own thread)."""
        try:
            self.outcome.set_result(self._session(forwarder, key, epoch))
        except BaseException as e:
            self.drop()
            self.outcome.set_exception(e)

    def _session(self, forwarder: Forwarder, key: str, epoch: int) -> bool:
        peers, bound = forwarder.peers, forwarder.bound_secs
        upload_id, offer = peers.begin_staging(self.address, key, epoch, bound)
        if offer is None:
            self.drop()  # no data channel to it: it syncs after the commit
            return False
        received = peers.send_staging(self.address, offer, self.pieces(), bound)
        if self.dropped or self.ending is None:
            return False
        size, digest = self.ending
        if received != size:
            return False
        return peers.finish_staging(self.address, upload_id, key, epoch, size, digest, bound)

    def put(self, piece: bytes | tuple[int, str], wait: float) -> bool:
        """Queue ``piece``, waiting up to ``wait`` for room; False (and dropped) if none came."""
        deadline = time.monotonic() + wait
        with self._cond:
            while (not self.dropped and isinstance(piece, bytes) and self._queued
                   and self._queued + len(piece) > self._max):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._drop_locked()
                    break
                self._cond.wait(left)
            if self.dropped:
                return False
            self._queue.append(piece)
            if isinstance(piece, bytes):
                self._queued += len(piece)
            self._cond.notify_all()
            return True

    def drop(self) -> None:
        with self._cond:
            self._drop_locked()

    def _drop_locked(self) -> None:
        if not self.dropped:
            self.dropped = True
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()


class StreamForward:
    """One upload's forwards. Fed under the upload's lock, so its pieces keep their order."""

    def __init__(self, key: str, write_quorum: int, holders: list[_Holder], bound_secs: float,
                 forwarder: Forwarder) -> None:
        self.key = key
        self.write_quorum = write_quorum
        self._holders = holders
        self._bound = bound_secs
        self._forwarder = forwarder

    def feed(self, data: bytes) -> None:
        for h in self._holders:
            if not h.dropped and not h.put(data, self._bound):
                log.info("forward of %r to %s dropped: it fell %d MiB behind; it syncs after"
                         " the commit", self.key, h.address, QUEUE_BYTES >> 20)
                self._forwarder.suspect(h.address)

    def finish(self, size: int, digest: str) -> tuple[str, ...]:
        """End every stream with the commit's size and digest; the holders that confirmed a
        synced copy matching them within the bound."""
        for h in self._holders:
            if not h.dropped:
                h.put((size, digest), self._bound)
        deadline = time.monotonic() + self._bound
        confirmed: list[str] = []
        for h in self._holders:
            if h.dropped:
                continue
            try:
                if h.outcome.result(max(deadline - time.monotonic(), 0.001)):
                    confirmed.append(h.address)
            except Exception as e:
                log.info("forward of %r to %s failed (%s); it syncs after the commit",
                         self.key, h.address, e)
                self._forwarder.suspect(h.address)
                h.drop()
        return tuple(sorted(confirmed))

    def drop(self) -> None:
        """Give every stream up (the upload was aborted, expired or failed)."""
        for h in self._holders:
            h.drop()


def start_stream(forwarder: Forwarder, key: str, replication_factor: int, write_quorum: int
                 ) -> StreamForward | None:
    """The forwards of an upload to ``key`` (None when there are none to make)."""
    if not forwarder.enabled or write_quorum < 2:
        return None
    now = time.monotonic()
    known = forwarder.known() | {forwarder.identity}
    targets = forwarder.targets(key, replication_factor, known, forwarder.live(), now)
    if not targets:
        return None
    epoch = forwarder.epoch()
    holders: list[_Holder] = []
    for address in targets[:write_quorum - 1]:
        h = _Holder(address, QUEUE_BYTES)
        threading.Thread(target=h.run, args=(forwarder, key, epoch), daemon=True,
                         name=f"forward-{address}").start()
        holders.append(h)
    return StreamForward(key, write_quorum, holders, forwarder.bound_secs, forwarder)
