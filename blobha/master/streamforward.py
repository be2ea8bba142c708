"""The leader's forward of a streamed upload: with a write quorum above 1, the upload's bytes go
to W-1 of the key's other holders as they arrive, each into a staging session of its own
(BeginStaging, then its data channel, then FinishStaging) sent by a thread of its own, so the
holders write their copies while the client still sends and the commit waits only for their
final sync.

Each holder's thread sends from the upload's temp file, each range once the upload has written
it (``sendfile`` from the page cache in plaintext): the leader copies no byte for a forward,
and keeps none in memory. The temp file's written bytes never change (appends only go past
them), so a range read once written is the range the digest covers.

A holder that falls more than a bound behind the upload and stays there past the stall limit
(it stalled, or cannot keep up) is dropped, as is one whose stream fails: it fetches the
version after the commit through the ordinary sync, and the write then waits for replica nodes
as without forwarding. Fewer holders are forwarded to than the placement chooses (W-1, not
R-1): every forwarded copy is sent by the leader, whose outgoing bytes would otherwise grow
with R while the client's upload waits on them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

from blobha.master.forward import Forwarder
from blobha.wire.datachannel import FileRange

log = logging.getLogger("blobha.master")

#: Bytes a holder may trail the upload before the upload waits for it (up to the stall limit).
LAG_BYTES = 32 * 1024 * 1024
#: Bytes handed to the holder's socket per range at most: between ranges the sender looks for
#: the holder's refusal.
RANGE_BYTES = 4 * 1024 * 1024


class _Holder:
    """One holder's staging stream, fed from the upload's temp file."""

    def __init__(self, address: str, fd: int, max_lag: int) -> None:
        self.address = address
        #: The temp file, opened before the session is handed out: the commit may move it.
        self._fd = fd
        self._max_lag = max_lag
        self._cond = threading.Condition()
        self._written = 0  # bytes of the temp file the upload has written
        self._sent = 0  # bytes handed to the holder's socket
        self._end: tuple[int, str] | None = None
        #: Set when the holder was given up: its session is never finished, and expires.
        self.dropped = False
        #: Whether the holder keeps a synced copy of the size and digest the commit gave.
        self.outcome: Future[bool] = Future()

    def ranges(self) -> Iterator[FileRange]:
        """The written ranges to send, as the upload writes them, until the end (or the holder
        is dropped)."""
        while True:
            with self._cond:
                while self._written <= self._sent and self._end is None and not self.dropped:
                    self._cond.wait()
                if self.dropped or self._written <= self._sent:
                    return  # given up, or every byte sent and the end given
                start = self._sent
                count = min(self._written - start, RANGE_BYTES)
            yield FileRange(self._fd, start, count)
            with self._cond:  # sent: asked for the next one
                self._sent = start + count
                self._cond.notify_all()

    def run(self, forwarder: Forwarder, key: str, epoch: int) -> None:
        """The holder's session, from its beginning to its confirmation (its own thread)."""
        try:
            confirmed = self._session(forwarder, key, epoch)
            if not confirmed:
                self.drop()  # nothing more is sent to it: the upload must not wait for it
            self.outcome.set_result(confirmed)
        except BaseException as e:
            self.drop()
            self.outcome.set_exception(e)
        finally:
            os.close(self._fd)

    def _session(self, forwarder: Forwarder, key: str, epoch: int) -> bool:
        peers, bound = forwarder.peers, forwarder.bound_secs
        upload_id, offer = peers.begin_staging(self.address, key, epoch, bound)
        if offer is None:
            self.drop()  # no data channel to it: it syncs after the commit
            return False
        received = peers.send_staging(self.address, offer, self.ranges(), bound)
        if self.dropped or self._end is None:
            return False
        size, digest = self._end
        if received != size:  # the holder has fewer bytes than the commit names
            return False
        return peers.finish_staging(self.address, upload_id, key, epoch, size, digest, bound)

    def advance(self, written: int, wait: float) -> bool:
        """The upload has written ``written`` bytes; waits up to ``wait`` while the holder
        trails by more than the bound. False (and dropped) if it still did."""
        deadline = time.monotonic() + wait
        with self._cond:
            while not self.dropped and self._written - self._sent > self._max_lag:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._drop_locked()
                    break
                self._cond.wait(left)
            if self.dropped:
                return False
            self._written = max(self._written, written)
            self._cond.notify_all()
            return True

    def end(self, size: int, digest: str) -> None:
        """Every byte is written: the stream ends once they are sent."""
        with self._cond:
            self._end = (size, digest)
            self._cond.notify_all()

    def drop(self) -> None:
        with self._cond:
            self._drop_locked()

    def _drop_locked(self) -> None:
        if not self.dropped:
            self.dropped = True
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

    def advance(self, written: int) -> None:
        """The upload's temp file holds ``written`` bytes: send them on."""
        for h in self._holders:
            if not h.dropped and not h.advance(written, self._bound):
                log.info("forward of %r to %s dropped: it fell %d MiB behind; it syncs after"
                         " the commit", self.key, h.address, LAG_BYTES >> 20)
                self._forwarder.suspect(h.address)

    def finish(self, size: int, digest: str) -> tuple[str, ...]:
        """End every stream with the commit's size and digest; the holders that confirmed a
        synced copy matching them within the bound."""
        for h in self._holders:
            h.end(size, digest)
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


def start_stream(forwarder: Forwarder, key: str, replication_factor: int, write_quorum: int,
                 temp: Path) -> StreamForward | None:
    """The forwards of an upload to ``key`` whose bytes are written to ``temp`` (None when there
    are none to make)."""
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
        h = _Holder(address, os.open(temp, os.O_RDONLY | os.O_CLOEXEC), LAG_BYTES)
        threading.Thread(target=h.run, args=(forwarder, key, epoch), daemon=True,
                         name=f"forward-{address}").start()
        holders.append(h)
    return StreamForward(key, write_quorum, holders, forwarder.bound_secs, forwarder)
