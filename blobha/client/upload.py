"""One create or update: put whole, or begun, appended in segments and committed.

A small blob goes in one Put; a larger one in segments (over the data channel where the leader
offers one). Resumed or restarted when the leader fails; a commit whose answer was lost is
recognised."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from blobha.client.retry import Deadline, Mismatches, cut_short, may_have_run
from blobha.client.routing import Router
from blobha.client.sources import Source, open_source
from blobha.client.transport import LeaderMoved
from blobha.client.values import BlobMeta, ProgressCallback, UploadData, check_body
from blobha.core.digest import PUT_MAX_BYTES, Digester
from blobha.core.errors import (
    NO_ANSWER,
    BlobError,
    DeadlineExceeded,
    InternalError,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    NotLeader,
    Unavailable,
    UploadNotFound,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.chunks import UploadPiece
from blobha.wire.convert import meta_from_pb
from blobha.wire.datachannel import MIN_BYTES as _DATA_CHANNEL_MIN_BYTES
from blobha.wire.datachannel import DataChannelUnusable, send_upload

#: Seconds a write whose outcome is unknown at its deadline may take beyond it to find out.
_OUTCOME_GRACE = 2.0
_ABORT_TIMEOUT = 2.0


def upload(router: Router, request: pb.BeginUploadRequest, data: UploadData,
           progress: ProgressCallback | None) -> BlobMeta:
    """Write ``data`` as ``request`` asks (create or update)."""
    check_body(data)  # before any call: a refused body writes nothing
    base_version = 0
    if not request.create:
        # Remembered so a commit whose answer was lost can be recognised by a newer version
        # carrying our digest; a writer not shown the metadata (by a master older than
        # showing it to writers) still uploads, less precisely.
        try:
            base_version = meta_from_pb(router.read_meta(request.key, None)).version
        except NotAuthorized:
            base_version = request.expected_version
    source = open_source(data)
    try:
        request.size_hint = source.size
        return UploadJob(router, request, source, base_version, progress).run()
    finally:
        source.close()


class UploadJob:
    """One create/update: begin, append segments, commit; resumed or restarted on failures."""

    def __init__(
        self,
        router: Router,
        begin: pb.BeginUploadRequest,
        source: Source,
        base_version: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.router = router
        self.begin = begin
        if not begin.write_id:
            # One name for every attempt of this write: a master that committed an attempt
            # whose answer was lost answers the next one with that version, never a second.
            begin.write_id = os.urandom(16)
        self.source = source
        self.base_version = base_version
        self.progress = progress
        self.what = f"{'create' if begin.create else 'update'} {begin.key!r}"
        self.leader = ""
        self.upload_id = ""
        self.started = False
        self.commit_unknown = False
        self.digester = Digester()
        self.hashed = 0  # bytes fed to the digester: the digest covers [0, hashed)
        # gRPC reads an upload segment on a thread of its own, which may still be inside a read
        # (of a slow pipe) when its call was given up and the next attempt starts reading.
        self._read_lock = threading.Lock()
        self.source_error: BaseException | None = None
        self.high_water = 0  # most bytes any attempt of this upload got acknowledged
        # Cleared when the leader offers no data channel (TLS, turned off, an older release),
        # so the rest of this upload does not ask again.
        self.channel = True

    def run(self) -> BlobMeta:
        deadline = Deadline(self.router.timeout)
        attempt = 0
        last: BlobError | None = None
        mismatches = Mismatches()
        try:
            while True:
                try:
                    return self._step(deadline)
                except _CannotRestart:
                    raise
                except DeadlineExceeded as exc:
                    cut_short(exc, last, self.what, deadline)
                except NotLeader as exc:
                    self.router.redirect(self.leader, exc.leader)
                    self.upload_id = ""  # bound to the old leader
                    last = exc
                except UploadNotFound as exc:
                    self.upload_id = ""
                    self.router.forget_leader(self.leader)
                    last = exc
                except LeaderMoved as exc:
                    self.router.leader_moved(self.leader, exc.leader)
                    last = exc
                except Unavailable as exc:
                    self.router.forget_leader(self.leader)
                    last = exc
                except KeyAlreadyExists:
                    meta = self._committed_meta(deadline) if self.commit_unknown else None
                    if meta is None:
                        raise
                    return meta
                self.router.give_up_on_tls(last, mismatches)
                self.router.pause(attempt, deadline, last, self.what)
                attempt += 1
        except NO_ANSWER as exc:
            self._abort_quietly()
            if not self.commit_unknown:
                raise
            # Giving up after a commit whose answer was lost: it may have been made, and a
            # plain "unavailable" would send the user to write it again.
            note = (f"{exc}; an earlier attempt's commit got no answer, so the {self.what}"
                    " may have been made: check its metadata before writing again")
            raise type(exc)(note) from None
        except BaseException:
            self._abort_quietly()
            raise

    def _step(self, deadline: Deadline) -> BlobMeta:
        if self.commit_unknown:
            meta = self._committed_meta(deadline)
            if meta is not None:
                return meta
        if self.upload_id and self.router.discover_leader(deadline) != self.leader:
            self.upload_id = ""  # upload ids die with the leadership that issued them
        if not self.upload_id and 0 <= self.source.size <= self.router.limits.put_max_bytes:
            return self._put(deadline)
        offset = 0
        if self.upload_id:
            status = self._control(
                "GetUploadStatus", pb.UploadStatusRequest(upload_id=self.upload_id), deadline
            )
            offset = int(status.received)
        else:
            done = self._begin(deadline)
            if done is not None:
                return done
        self._send(offset, deadline)
        return self._commit(deadline)

    def _begin(self, deadline: Deadline) -> BlobMeta | None:
        """Open an upload session; or, where the leader says this write (its write id) is
        committed already, its answer."""
        stuck = self.started and not self.source.can_restart()
        if stuck and not self.commit_unknown:
            raise _CannotRestart(
                f"the leader changed during the upload of {self.begin.key!r} and the data cannot"
                " be read again (it comes from a stream); nothing was written, upload it again"
                " (from a file, it would have restarted by itself)"
            )
        self.leader = self.router.discover_leader(deadline)
        response = self._control("BeginUpload", self.begin, deadline)
        if response.HasField("committed"):
            self.commit_unknown = False
            self.upload_id = ""
            self.router.after_write(self.leader)
            return meta_from_pb(response.committed)
        self.upload_id = response.upload_id
        if stuck:
            # Asked only to learn whether the commit whose answer was lost applied: it did not
            # (as of now), and the data cannot be sent again.
            self._abort_quietly()
            raise _CannotRestart(
                f"the commit of {self.begin.key!r} got no answer, and the leader has no record of"
                " it; the data cannot be read again (it comes from a stream): upload it again"
                " (from a file, it would have restarted by itself)"
            )
        self.started = True
        return None

    def _control(self, method: str, request: Any, deadline: Deadline) -> Any:
        return self.router.control_call(self.leader, method, request, deadline, to_leader=True)

    def _read(self, offset: int, view: bool = False) -> bytes | memoryview:
        with self._read_lock:
            if view:
                data = self.source.view_at(offset, self.router.chunk_size)
            else:
                data = self.source.read_at(offset, self.router.chunk_size)
            end = offset + len(data)
            if offset <= self.hashed < end:
                self.digester.update(memoryview(data)[self.hashed - offset :])
                self.hashed = end
            return data

    def _send(self, offset: int, deadline: Deadline) -> None:
        """Append from ``offset`` to the end of the source."""
        while True:
            first = self._read(offset)
            if not first:
                if offset != self.hashed:
                    raise InternalError(
                        f"the input ended at {offset} bytes but {self.hashed} were read before;"
                        " was the file truncated during the upload?"
                    )
                return
            received = self._channel_segment(offset, first, deadline)
            if received is None:
                received = self._stream_segment(offset, first)
            if received <= offset:
                raise InternalError(
                    f"the leader acknowledged no progress at offset {offset} of upload"
                    f" {self.upload_id!r}"
                )
            self.source.ack(received)
            offset = received
            if received > self.high_water:
                # Only new ground renews the deadline; re-sending bytes that an earlier attempt
                # already delivered is not progress, so a commit that keeps failing still ends.
                self.high_water = received
                deadline.restart()

    def _channel_segment(self, offset: int, first: bytes | memoryview, deadline: Deadline
                         ) -> int | None:
        """Send a segment from ``offset`` (whose first piece is ``first``) over the leader's
        data channel (blobha.wire.datachannel); the bytes the leader then holds, or None when the
        channel cannot be used and the segment goes in an ``AppendUpload`` stream."""
        channels = self.router.data_channels
        if not self.channel or not channels.usable(self.leader):
            return None
        left = self.source.size - offset
        if 0 <= left < _DATA_CHANNEL_MIN_BYTES:
            return None  # a connection of its own costs more than the copies it saves
        host = self.router.transport.data_host(self.leader)
        if host is None:
            return None
        status = self._control(
            "GetUploadStatus",
            pb.UploadStatusRequest(upload_id=self.upload_id, data_channel=True), deadline)
        if not status.ticket:
            self.channel = False
            return None
        if int(status.received) != offset:
            return int(status.received)  # an earlier stream's bytes arrived after all
        limits = self.router.limits
        segment = (limits.upload_segment_bytes if self.source.buffers
                   else limits.channel_segment_bytes)

        def pieces() -> Iterator[bytes | memoryview]:
            pos, data = offset, first
            while data:
                yield data
                pos += len(data)
                if self.progress is not None:
                    self.progress(pos, self.source.size)
                if pos - offset >= segment:
                    return
                data = self._read(pos, view=True)

        # The channel's own time limits (connect, answer, each send) are the stall limit.
        limit = min(self.router.timeout, self.router.stall_timeout)
        try:
            return send_upload(host, status.data_port, status.ticket, limit, pieces(),
                               channels.tls())
        except DataChannelUnusable as e:
            channels.failed(self.leader, e)
            return None

    def _stream_segment(self, offset: int, first: bytes | memoryview) -> int:
        """Send a segment from ``offset`` in an ``AppendUpload`` stream; the bytes the leader
        then holds."""
        sent = offset
        self.source_error = None

        def chunks(start: int = offset, data: bytes | memoryview = first
                   ) -> Iterator[UploadPiece]:
            nonlocal sent
            # gRPC pulls this iterator on its own thread and reports failures inside it only
            # as a cancelled call, so keep the real error to raise it ourselves.
            pos = start
            try:
                while data:
                    yield UploadPiece(self.upload_id, pos, memoryview(data))
                    pos += len(data)
                    sent = pos
                    if self.progress is not None:
                        self.progress(pos, self.source.size)
                    if pos - start >= self.router.limits.upload_segment_bytes:
                        return
                    data = self._read(pos)
            except GeneratorExit:
                raise
            except BaseException as exc:
                self.source_error = exc
                raise

        try:
            status = self.router.transport.client_stream(
                self.leader, "AppendUpload", chunks(), self.router.timeout,
                stall=self.router.stall_timeout, rivals=self.router.known_addresses(),
            )
        except BlobError:
            if self.source_error is not None:
                raise self.source_error from None
            raise
        received = int(status.received)
        if received <= offset:
            raise InternalError(
                f"the leader acknowledged no progress at offset {offset} of upload"
                f" {self.upload_id!r} ({sent - offset} bytes were sent)"
            )
        return received

    def _put(self, deadline: Deadline) -> BlobMeta:
        """A small blob of known size: begin, append and commit in one call."""
        data = self.source.read_at(0, PUT_MAX_BYTES + 1)
        if len(data) != self.source.size:
            raise InternalError(
                f"the input changed size during the {self.what}: {self.source.size} bytes"
                f" expected, {len(data)} read; nothing was written"
            )
        self.digester = Digester()
        self.digester.update(data)
        self.hashed = len(data)
        self.leader = self.router.discover_leader(deadline)
        self.started = True
        request = pb.PutRequest(begin=self.begin, data=data, digest=self.digester.hexdigest())
        return self._finish("Put", request, deadline)

    def _commit(self, deadline: Deadline) -> BlobMeta:
        request = pb.CommitUploadRequest(
            upload_id=self.upload_id, size=self.hashed, digest=self.digester.hexdigest()
        )
        return self._finish("CommitUpload", request, deadline)

    def _finish(self, method: str, request: Any, deadline: Deadline) -> BlobMeta:
        """The call that commits (CommitUpload or Put), and what a lost answer means."""
        try:
            response = self.router.transport.unary(self.leader, method, request,
                                                   deadline.remaining(),
                                                   stall=self.router.stall_timeout,
                                                   rivals=self.router.known_addresses())
        except Unavailable as exc:
            # The commit may have happened and only its answer been lost; not when the call
            # was refused before it ran (then asking would only wait on a busy cluster).
            self.commit_unknown = self.commit_unknown or may_have_run(exc)
            raise
        except DeadlineExceeded:
            if deadline.remaining() > 1.0:
                # The master's own answer (write quorum not reached in its time): its message
                # says what became of the version.
                raise
            meta = self._committed_meta(Deadline(_OUTCOME_GRACE))
            if meta is None:
                # A leader that let the whole deadline pass without an answer may be paused
                # or cut off: the next operation looks for the leader again.
                self.router.forget_leader(self.leader)
                raise
            return meta
        self.upload_id = ""
        self.router.after_write(self.leader)
        return meta_from_pb(response)

    def _committed_meta(self, deadline: Deadline) -> BlobMeta | None:
        """The blob's metadata if its committed version is exactly what we uploaded (asked
        within ``deadline``, the upload's own: the check must not add a timeout of its own)."""
        if deadline.remaining() < _OUTCOME_GRACE / 2:
            deadline = Deadline(_OUTCOME_GRACE)
        try:
            meta = meta_from_pb(self.router.read_meta(self.begin.key, deadline))
        except (KeyNotFound, NotAuthorized, Unavailable, DeadlineExceeded):
            return None
        if (
            meta.size == self.hashed
            and meta.digest == self.digester.hexdigest()
            and meta.version > self.base_version
            # Committed is not enough: a version its leader could not get acknowledged (the
            # leader failed before the write quorum) may be rolled back by the next leader, so
            # it is not ours to report as written; the upload is made again instead.
            and meta.acknowledged
        ):
            self.commit_unknown = False
            self.upload_id = ""
            return meta
        return None

    def _abort_quietly(self) -> None:
        if not self.upload_id or not self.leader:
            return
        with contextlib.suppress(BlobError):
            self.router.transport.unary(
                self.leader,
                "AbortUpload",
                pb.AbortUploadRequest(upload_id=self.upload_id),
                _ABORT_TIMEOUT,
            )
        self.upload_id = ""


class _CannotRestart(UploadNotFound):
    """Raised out of the retry loop: the only way forward would be re-reading a stream."""
