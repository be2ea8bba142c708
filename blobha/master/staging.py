"""The holder's side of a forwarded write: a leader's StageVersions, fenced by its epoch, kept
staged on disk (blobha.store.staged) until the synchroniser sees the commit that names it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence

from blobha.core.digest import PUT_MAX_BYTES
from blobha.core.errors import InvalidArgument, NotAuthorized, NotLeader
from blobha.core.keys import validate_key
from blobha.store.local import LocalStore

log = logging.getLogger("blobha.master")

#: Versions one StageVersions call may carry: a group commit's batch at most.
STAGE_MAX_VERSIONS = 256


class Staging:
    """Accepts forwards from the leader, never from one older than the newest epoch seen:
    from ZooKeeper's ``/epoch`` record (``current_epoch``) or from an earlier forward."""

    def __init__(self, principal: str, store: LocalStore,
                 current_epoch: Callable[[], int]) -> None:
        self.principal = principal
        self.store = store
        self.current_epoch = current_epoch
        self._newest = 0
        self._lock = threading.Lock()
        #: Versions staged since start (read by tests and the status page's figures).
        self.staged = 0

    def stage(self, user: str, epoch: int, versions: Sequence[tuple[str, int, str, bytes]]
              ) -> list[bool]:
        if user != self.principal:
            raise NotAuthorized(
                f"{user!r} may not call StageVersions: it is for the leader forwarding writes;"
                " write blobs with Put or an upload")
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

    def stage_stream(self, user: str, key: str, epoch: int, pieces: Iterator[bytes],
                     end: Callable[[], tuple[int, str] | None]) -> bool:
        """A streamed upload's forward: ``pieces`` are its bytes in order; ``end()``, once
        they are over, the (size, digest) its last message gave (None: the stream ended
        without one, so the leader gave up on it). Whether the copy is staged."""
        if user != self.principal:
            raise NotAuthorized(
                f"{user!r} may not call StageUpload: it is for the leader forwarding writes;"
                " write blobs with an upload")
        validate_key(key)
        self._check_epoch(epoch)
        temp = self.store.staged.new_part()
        try:
            for data in pieces:
                temp.write_at(temp.size, data)
            ending = end()
            if ending is None:
                raise InvalidArgument(f"the forward of {key!r} ended without its size and"
                                      " digest; nothing was staged")
        except BaseException:
            temp.discard()
            raise
        size, digest = ending
        ok = self.store.staged.adopt(key, size, digest, temp)
        self.staged += ok
        return ok

    def _check_epoch(self, epoch: int) -> None:
        with self._lock:
            newest = max(self._newest, self.current_epoch())
            if epoch < newest:
                raise NotLeader(f"a forward from epoch {epoch}, but epoch {newest} has begun:"
                                " its leader was deposed, and nothing it sends is staged")
            self._newest = epoch
