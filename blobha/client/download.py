"""One download: segments from the replicas, failing over and resuming, verified whole.

Each segment comes from one replica (over its data channel where one is offered); when that
replica fails, the next resumes at the byte where it stopped, pinned to the version first seen."""

from __future__ import annotations

import functools
import logging

from blobha.client.retry import Deadline, gave_up
from blobha.client.routing import Router
from blobha.client.sources import Sink
from blobha.client.values import BlobInfo, ProgressCallback
from blobha.core.digest import Digester
from blobha.core.errors import (
    BlobError,
    ChecksumMismatch,
    DeadlineExceeded,
    InternalError,
    KeyNotFound,
    Stale,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import info_from_pb
from blobha.wire.datachannel import DataOffer

_NOT_HELD_PREFIX = "not held here"

log = logging.getLogger("blobha.client")


class DownloadJob:
    """One download: segments from a chosen replica, failing over and resuming at the byte
    where the previous replica stopped (pinned to the version first seen)."""

    def __init__(
        self,
        router: Router,
        key: str,
        sink: Sink,
        version: int,
        offset: int,
        length: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.router = router
        self.key = key
        self.sink = sink
        self.version = version
        self.offset = offset
        self.limit = offset + length if length else None
        self.progress = progress
        self.candidates: list[str] = []
        self.failed: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self.info: BlobInfo | None = None
        self.pos = self.offset
        self.end: int | None = self.limit
        self.digester = Digester()

    def run(self) -> BlobInfo:
        deadline = Deadline(self.router.timeout)
        attempt = 0
        what = f"download {self.key!r}"
        may_guess = True
        guessing = False
        # The last failure of a master that should have served the bytes (down, corrupt,
        # failing), which says more than the "not held here" of the others.
        unreached: BlobError | None = None
        last: BlobError | None = None
        while True:
            if not self.candidates:
                known = self.router.known_addresses() if may_guess else []
                may_guess = False
                guessing = bool(known)
                if guessing:
                    # Any master that holds the committed version serves it, and one that does
                    # not says so: try one straight away and ask where the replicas are only
                    # on a miss (one call instead of two for most reads).
                    self.candidates = [self.router.rng.choice(known)]
                else:
                    try:
                        self._choose_replicas(deadline)
                    except DeadlineExceeded:
                        # The last pause left too little of the deadline for this call: why
                        # the download was retrying ("no reachable master holds v1") is the
                        # news, not that its next question was cut short.
                        if last is None or not deadline.expired():
                            raise
                        raise gave_up(self._why(last, unreached), what,
                                       deadline.seconds) from None
            address = self.candidates[0]
            before = self.pos
            try:
                try:
                    self._segment(address)
                except DeadlineExceeded as exc:
                    if self.pos == before:
                        raise
                    # The segment's deadline passed while its bytes still came (a slow link):
                    # that is progress, and the download goes on from where it got to.
                    raise Unavailable(f"{exc}; resuming at byte {self.pos}") from None
            except (Unavailable, ChecksumMismatch, InternalError) as exc:
                # A replica that is down, sent bad bytes, or failed (a disk error there): the
                # others hold the same version.
                last = exc
                unreached = exc
                self.candidates.pop(0)
                self.failed.add(address)
            except KeyNotFound as exc:
                # "No longer kept" of the version this download began on (the latest then):
                # the key was updated meanwhile, and the replica list tells which to start over.
                replaced = self.version == 0 and self.info is not None
                if str(exc).startswith(_NOT_HELD_PREFIX) or replaced:
                    last = exc
                    self.candidates.pop(0)
                    self.failed.add(address)
                else:
                    raise
            else:
                deadline.restart()
                attempt = 0
                if self.end is not None and self.pos >= self.end:
                    return self._finish()
                continue
            if self.pos > before:
                # Bytes still arrive, from one replica or the next: the deadline bounds a wait
                # for the cluster, not a download that is progressing.
                deadline.restart()
                attempt = 0
            if not self.candidates and not guessing:
                self.router.pause(attempt, deadline, self._why(last, unreached), what)
                attempt += 1
            guessing = False

    def _why(self, last: BlobError, unreached: BlobError | None) -> BlobError:
        """What to give up with: a failure of a master that should have served the bytes,
        else, where every master said it lacks the version, that none holds it now. The key
        exists (its replica list was read), so "key not found" (exit 3), the last master's
        "not held here", would tell a script that it is gone, and name the internal call to
        ask instead."""
        if unreached is not None:
            return unreached
        if isinstance(last, KeyNotFound):
            version = self.info.version if self.info else self.version
            which = f"v{version}" if version else "the latest version"
            return Unavailable(
                f"no reachable master holds {which} of {self.key!r}: its copies may be on"
                " masters that are down, or being repaired; retry later")
        return last

    def _choose_replicas(self, deadline: Deadline) -> None:
        status = self.router.read_call(
            f"find replicas of {self.key!r}",
            "GetReplication",
            pb.GetReplicationRequest(key=self.key),
            deadline,
            self.key,
        )
        if self.info is not None and self.version == 0 and status.version != self.info.version:
            # Every replica failed us on a version that is no longer the latest: it was
            # replaced mid-download and is probably pruned. Start over on the new one.
            if not self.sink.restart():
                raise KeyNotFound(
                    f"{self.key!r} was updated during the download and version"
                    f" {self.info.version} is no longer served; download it again"
                )
            self._reset()
        holders = [h for h in status.holders if h]
        self.router.learn(holders)
        wanted = self.info.version if self.info else self.version
        rng = self.router.rng
        others = [a for a in self.router.known_addresses() if a not in holders]
        rng.shuffle(others)
        if wanted in (0, status.version):
            rng.shuffle(holders)
            self.candidates = holders + others
        else:
            self.candidates = others + holders
            rng.shuffle(self.candidates)
        # Masters that already failed this download go last (stable: the order stays random).
        self.candidates.sort(key=lambda a: a in self.failed)
        if self.router.in_outage():
            # ZooKeeper is out: the master that said so answers from its last view at once;
            # another may first wait on ZooKeeper for the session timeout.
            first = self.router.preferred()
            self.failed.discard(first)
            self.candidates.sort(key=lambda a: a != first)

    def _segment(self, address: str, stream_only: bool = False) -> None:
        want = self.router.limits.download_segment_bytes
        bound = self.end if self.end is not None else self.limit
        if bound is not None:
            want = min(want, bound - self.pos)
        host = None
        if not stream_only and self.router.data_channels.usable(address):
            host = self.router.transport.data_host(address)
        request = self.router.with_minimum(self.key, pb.DownloadRequest(
            key=self.key,
            version=self.info.version if self.info else self.version,
            offset=self.pos,
            length=want,
            data_channel=host is not None,
        ))
        try:
            self._receive(address, request, want, host)
        except Stale:
            self.router.refused_as_stale(address, request)
            raise

    def _receive(self, address: str, request: pb.DownloadRequest, want: int,
                 host: str | None) -> None:
        start = self.pos
        seen_info = False
        offer: DataOffer | None = None
        for message in self.router.transport.server_stream(
            address, "Download", request, self.router.timeout, stall=self.router.stall_timeout
        ):
            if not seen_info:
                if not message.HasField("info"):
                    raise InternalError(f"master {address} sent data before the blob info")
                self._check_info(address, info_from_pb(message.info))
                log.debug("reading %r v%d from %s", self.key, message.info.version, address,
                          extra={"master": address})
                # Monotonic reads: no later read of this client accepts an older view.
                self.router.seen.saw(self.key, message.info.version, message.info.created_at)
                seen_info = True
            if message.ticket:  # offered only when asked for: the data comes over the channel
                offer = DataOffer(message.data_port, message.ticket)
            self._take(address, message.data)
        if host is not None and offer is not None:
            assert self.info is not None
            size = min(self.pos + want, self.info.size) - self.pos  # the master's range
            # The channel's own timeouts (connect, answer, each receive) are the stall limit.
            limit = min(self.router.timeout, self.router.stall_timeout)
            if not self.router.data_channels.take(address, host, offer, size, limit,
                                              functools.partial(self._take, address)):
                self._segment(address, stream_only=True)
            return
        if not seen_info:
            raise Unavailable(f"master {address} ended the download stream without data")
        if self.pos - start < want and self.end is not None and self.pos < self.end:
            raise Unavailable(f"master {address} ended the download early at byte {self.pos}")

    def _take(self, address: str, data: bytes | memoryview) -> None:
        if not data:
            return
        if self.end is not None and self.pos + len(data) > self.end:
            raise ChecksumMismatch(f"master {address} sent more bytes than the blob holds")
        self.sink.write(data)
        self.digester.update(data)
        self.pos += len(data)
        if self.progress is not None and self.end is not None:
            self.progress(self.pos - self.offset, self.end - self.offset)

    def _check_info(self, address: str, info: BlobInfo) -> None:
        if self.info is None:
            self.info = info
            self.end = info.size if self.limit is None else min(self.limit, info.size)
            self.end = max(self.end, self.offset)
            return
        if info != self.info:
            raise ChecksumMismatch(
                f"master {address} served version {info.version} ({info.digest}) while resuming"
                f" version {self.info.version} ({self.info.digest})"
            )

    def _finish(self) -> BlobInfo:
        info = self.info
        assert info is not None
        whole = self.offset == 0 and self.end == info.size
        if whole and (self.digester.size != info.size or self.digester.hexdigest() != info.digest):
            raise ChecksumMismatch(
                f"{self.key!r} version {info.version} arrived corrupt: digest"
                f" {self.digester.hexdigest()} over {self.digester.size} bytes, expected"
                f" {info.digest} over {info.size}; a destination path is left untouched, try"
                " again"
            )
        return info
