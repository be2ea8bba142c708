"""The holder's side of a forwarded write: a leader's StageVersions, fenced by its epoch, kept
staged on disk (blobha.store.staged) until the synchroniser sees the commit that names it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from blobha.core.digest import PUT_MAX_BYTES
from blobha.core.errors import InvalidArgument, NotAuthorized, NotLeader
from blobha.core.keys import validate_key
from blobha.master.uploads import UploadManager
from blobha.store.local import LocalStore
from blobha.wire.datachannel import DataOffer

log = logging.getLogger("blobha.master")

#: Versions one StageVersions call may carry: a group commit's batch at most.
STAGE_MAX_VERSIONS = 256


class Staging:
    """Accepts forwards from the leader, never from one older than the newest epoch seen:
    from ZooKeeper's ``/epoch`` record (``current_epoch``) or from an earlier forward."""

    def __init__(self, principal: str, store: LocalStore, current_epoch: Callable[[], int],
                 uploads: UploadManager,
                 offer: Callable[[str, str], tuple[int, DataOffer | None]],
                 offer_link: Callable[[str], DataOffer | None] = lambda user: None) -> None:
        self.principal = principal
        self.store = store
        self.current_epoch = current_epoch
        self.uploads = uploads
        self.offer = offer
        self.offer_link = offer_link
        self._newest = 0
        self._lock = threading.Lock()
        #: Versions staged since start (read by tests and the status page's figures).
        self.staged = 0

    def stage(self, user: str, epoch: int, versions: Sequence[tuple[str, int, str, bytes]]
              ) -> list[bool]:
        self._check_master(user, "StageVersions")
        if len(versions) > STAGE_MAX_VERSIONS:
            raise InvalidArgument(f"{len(versions)} versions in one StageVersions call; at most"
                                  f" {STAGE_MAX_VERSIONS}")
        for key, size, _, data in versions:
            validate_key(key)
            if size > PUT_MAX_BYTES or len(data) != size:
                raise InvalidArgument(f"the forwarded copy of {key!r} carries {len(data)} bytes,"
                                      f" not its size {size} (at most {PUT_MAX_BYTES})")
        self._check_epoch(epoch)
        out = self.store.staged.stage(list(versions))
        self.staged += sum(out)
        return out

    def begin_link(self, user: str, epoch: int) -> DataOffer | None:
        """A data-channel offer for a stage link: a connection carrying the leader's batches,
        each fenced as :meth:`stage` fences (blobha.wire.stagelink). None: no data channel
        here, and the leader calls StageVersions."""
        self._check_master(user, "BeginStaging")
        self._check_epoch(epoch)
        return self.offer_link(user)

    def begin_stream(self, user: str, key: str, epoch: int) -> tuple[str, DataOffer | None]:
        """A streamed upload's forward begins: a session of this master's own uploads (its
        bytes come through the data channel as a client's do, and it expires as an abandoned
        upload does unless :meth:`finish_stream` takes it); its id, and the data channel's
        offer for its bytes."""
        self._check_master(user, "BeginStaging")
        validate_key(key)
        self._check_epoch(epoch)
        up = self.uploads.begin(user, key, True, [], 1, 0, 1)
        _, offer = self.offer(user, up.upload_id)
        return up.upload_id, offer

    def finish_stream(self, user: str, upload_id: str, key: str, epoch: int, size: int,
                      digest: str) -> bool:
        """Keep a streamed forward's bytes staged if they are ``size`` bytes with ``digest``
        (synced first); whether they are."""
        self._check_master(user, "FinishStaging")
        self._check_epoch(epoch)
        up = self.uploads.take(upload_id, user)
        if up.key != key:
            up.discard()
            raise InvalidArgument(f"staging session {upload_id} is for {up.key!r}, not {key!r}")
        with up.lock:
            ok = self.store.staged.adopt(key, size, digest, up.temp)
        self.staged += ok
        return ok

    def _check_master(self, user: str, call: str) -> None:
        if user != self.principal:
            raise NotAuthorized(
                f"{user!r} may not call {call}: it is for the leader forwarding writes;"
                " write blobs with an upload")

    def _check_epoch(self, epoch: int) -> None:
        with self._lock:
            newest = max(self._newest, self.current_epoch())
            if epoch < newest:
                raise NotLeader(f"a forward from epoch {epoch}, but epoch {newest} has begun:"
                                " its leader was deposed, and nothing it sends is staged")
            self._newest = epoch
