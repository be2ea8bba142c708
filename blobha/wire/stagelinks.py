"""The leader's stage links to the other masters (blobha.wire.stagelink): kept open per holder
and reused, with StageVersions over gRPC wherever a link cannot be had."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from blobha.core.addresses import host_of
from blobha.core.errors import BlobError, InvalidArgument, Unavailable
from blobha.wire.datachannel import DataChannels, DataChannelUnusable, DataOffer
from blobha.wire.stagelink import StageLink, Version, open_stage_link

log = logging.getLogger("blobha.master")  # the forwards it carries log there too

#: Seconds a master whose links failed to open is sent StageVersions over gRPC instead.
NO_LINK_SECS = 300.0
#: Idle links kept per holder: as many as forwards in flight to one (blobha.master.forward).
MAX_IDLE = 4

#: Ask ``address`` for a link's ticket under ``epoch``: its offer, or None (it has no data
#: channel). Raises the master's refusal.
Begin = Callable[[str, int, float], DataOffer | None]
#: StageVersions over gRPC: (address, epoch, versions, timeout) -> one bool per version.
Call = Callable[[str, int, Sequence[Version], float], list[bool]]


class StageLinks:
    """Stage calls to the other masters over links where they can be had."""

    def __init__(self, begin: Begin, call: Call, channels: DataChannels,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._begin = begin
        self._call = call
        self._channels = channels
        self._clock = clock
        self._idle: dict[str, list[StageLink]] = {}
        self._no_link: dict[str, float] = {}
        self._lock = threading.Lock()
        #: Batches sent over links and over gRPC since start (read by tests and metrics).
        self.over_links = 0
        self.over_grpc = 0

    def stage(self, address: str, epoch: int, versions: Sequence[Version], timeout: float
              ) -> list[bool]:
        """Stage ``versions`` on ``address``: over an idle link, else a new one, else gRPC.
        A reused link that failed is tried once more on a new one (staging a version twice
        keeps one copy)."""
        deadline = self._clock() + timeout

        def left() -> float:
            return max(deadline - self._clock(), 0.001)

        reused = self._take(address)
        if reused is not None:
            try:
                return self._over(address, reused, epoch, versions, timeout)
            except Unavailable as e:
                log.debug("stage link to %s failed (%s); opening another", address, e)
        link = self._open(address, epoch, left())
        if link is None:
            with self._lock:
                self.over_grpc += 1
            return self._call(address, epoch, versions, left())
        return self._over(address, link, epoch, versions, left())

    def _over(self, address: str, link: StageLink, epoch: int, versions: Sequence[Version],
              timeout: float) -> list[bool]:
        try:
            staged = link.stage(epoch, versions, timeout)
        except BlobError:
            self._give_back(address, link)  # kept if only the holder's answer was an error
            raise
        with self._lock:
            self.over_links += 1
        self._give_back(address, link)
        return staged

    def _take(self, address: str) -> StageLink | None:
        with self._lock:
            links = self._idle.get(address, [])
            while links:
                link = links.pop()
                if link.fresh():
                    return link
                link.close()
        return None

    def _give_back(self, address: str, link: StageLink) -> None:
        if link.closed:
            return
        with self._lock:
            links = self._idle.setdefault(address, [])
            if len(links) < MAX_IDLE:
                links.append(link)
                return
        link.close()

    def _open(self, address: str, epoch: int, timeout: float) -> StageLink | None:
        """A new link to ``address``; None when it has none to offer or cannot be reached
        (remembered for NO_LINK_SECS). Raises the master's refusal of the ticket (a deposed
        epoch, say)."""
        now = self._clock()
        with self._lock:
            until = self._no_link.get(address)
            if until is not None and until > now:
                return None
        if not self._channels.usable(address):
            return None
        try:
            offer = self._begin(address, epoch, timeout)
        except InvalidArgument as e:  # a master of an older release: no links there
            self._without(address, f"it refused a link ({e})")
            return None
        if offer is None:
            self._without(address, "it offers no data channel")
            return None
        try:
            return open_stage_link(host_of(address), offer.port, offer.ticket, timeout,
                                   self._channels.tls())
        except DataChannelUnusable as e:
            self._channels.failed(address, e)
            return None
        except BlobError as e:
            log.info("stage link to %s refused: %s; StageVersions over gRPC", address, e)
            return None

    def _without(self, address: str, why: str) -> None:
        log.info("no stage link to %s: %s; StageVersions over gRPC for %.0f s", address, why,
                 NO_LINK_SECS)
        with self._lock:
            self._no_link[address] = self._clock() + NO_LINK_SECS

    def close(self) -> None:
        with self._lock:
            links = [link for ls in self._idle.values() for link in ls]
            self._idle.clear()
        for link in links:
            link.close()
