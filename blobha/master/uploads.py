"""Upload sessions on the leader: begun, appended to, then committed or aborted.

A session holds a temp file in the store's ``tmp/`` and is bound to the user who began it.
Sessions idle longer than ``blobstore.upload.expiration.secs`` are aborted by a reaper and their
data deleted; so are all sessions when this master stops leading, because an upload id is only
meaningful to the leader that issued it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from blobha.core.acl import AccessControl
from blobha.core.errors import (
    BlobError,
    NotAuthorized,
    ResourceExhausted,
    Unavailable,
    upload_not_found,
)
from blobha.master.streamforward import StreamForward
from blobha.store.local import LocalStore, TempBlob

log = logging.getLogger("blobha.uploads")


@dataclass
class Upload:
    upload_id: str
    user: str
    key: str
    create: bool
    acl: list[AccessControl]
    replication_factor: int
    expected_version: int
    #: A create's write quorum; an update's as asked (0 = the default), for the commit to
    #: check against the key's replication factor as it is then.
    write_quorum: int
    temp: TempBlob
    #: The write's tag (blobha.core.blobstate.write_tag), stored with the version it commits.
    write_tag: str = ""
    last_active: float = field(default_factory=time.monotonic)
    #: Held while a chunk stream or the commit uses the session, so they never interleave.
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The forwards of its bytes to other holders, with W >= 2 (blobha.master.streamforward).
    forward: StreamForward | None = None

    def discard(self) -> None:
        """Delete what was received, and give its forwards up."""
        if self.forward is not None:
            self.forward.drop()
        self.temp.discard()


class UploadManager:
    """``max_per_user`` (0: no limit) bounds the sessions one user holds at once: each keeps a
    file open, and a client looping on BeginUpload would otherwise run the leader out of
    descriptors, for every user, until the sessions expire."""

    def __init__(self, store: LocalStore, expiration_secs: float, max_per_user: int = 0) -> None:
        self.store = store
        self.expiration_secs = expiration_secs
        self.max_per_user = max_per_user
        self._uploads: dict[str, Upload] = {}
        self._guard = threading.Lock()
        #: Bumped by :meth:`abort_all`: a session begun or given back by a caller that checked
        #: leadership before the last abort would outlive it (on a follower, with its file).
        self._generation = 0
        self._stop = threading.Event()
        #: Whether a commit this master knows of names a staged copy (key, digest): such a copy
        #: is kept past the expiration (set by the master once its synchroniser exists).
        self.staged_wanted: Callable[[str, str], bool] | None = None
        self._started = time.monotonic()
        self._reaper = threading.Thread(target=self._reap_loop, name="upload-reaper", daemon=True)

    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        self.abort_all("master shutting down")

    @property
    def generation(self) -> int:
        """Read before checking leadership, and passed to :meth:`begin` or :meth:`restore`."""
        with self._guard:
            return self._generation

    def begin(
        self, user: str, key: str, create: bool, acl: list[AccessControl], replication_factor: int,
        expected_version: int, write_quorum: int, write_tag: str = "",
        generation: int | None = None,
    ) -> Upload:
        """A new session; with ``generation``, refused with :class:`Unavailable` if every
        session was aborted since it was read (this master stopped leading meanwhile)."""
        with self._guard:
            refused = self._refusal(user, key, generation)
        if refused is not None:
            raise refused  # before a file is made: a client looping past the limit makes none
        upload_id = uuid.uuid4().hex
        temp = self.store.new_temp(f"upload-{upload_id}")
        up = Upload(upload_id, user, key, create, acl, replication_factor, expected_version,
                    write_quorum, temp, write_tag)
        with self._guard:
            refused = self._refusal(user, key, generation)  # again: it may have changed since
            if refused is None:
                self._uploads[upload_id] = up
        if refused is not None:
            temp.discard()
            raise refused
        log.info("upload %s begun by %r for %r (%s)", upload_id, user, key,
                 "create" if create else "update")
        return up

    def _refusal(self, user: str, key: str, generation: int | None) -> BlobError | None:
        """Why a new session of ``user`` may not begin now (None: it may). Caller holds
        ``_guard``."""
        if generation is not None and generation != self._generation:
            return Unavailable(f"this master stopped leading while the upload of {key!r} began;"
                               " nothing was stored: retry with the new leader")
        if self.max_per_user:
            held = sum(u.user == user for u in self._uploads.values())
            if held >= self.max_per_user:
                return ResourceExhausted(
                    f"user {user!r} already has {held} unfinished uploads on this master (the"
                    " limit, blobstore.upload.max.per.user); commit or abort some, or let them"
                    f" expire ({self.expiration_secs:g} s idle)")
        return None

    def open_bytes(self, user: str) -> int:
        """What ``user``'s unfinished sessions hold on disk, together (quotas)."""
        with self._guard:
            return sum(u.temp.size for u in self._uploads.values() if u.user == user)

    def key_of(self, upload_id: str) -> str:
        with self._guard:
            up = self._uploads.get(upload_id)
        return up.key if up is not None else ""

    def get(self, upload_id: str, user: str) -> Upload:
        with self._guard:
            up = self._uploads.get(upload_id)
        if up is None:
            raise upload_not_found(upload_id)
        if up.user != user:
            # Same answer as for a stranger's key: the session is not theirs to touch.
            raise NotAuthorized(f"upload {upload_id!r} belongs to another user; begin your own")
        up.last_active = time.monotonic()
        return up

    def take(self, upload_id: str, user: str) -> Upload:
        """Remove a session for commit: later calls with its id get 'unknown upload'."""
        up = self.get(upload_id, user)
        with self._guard:
            if self._uploads.pop(upload_id, None) is None:
                raise upload_not_found(upload_id)
        return up

    def restore(self, up: Upload, generation: int) -> bool:
        """Give back a session taken for a commit that failed before touching its data (a
        transient error), so a retried commit finds it; discarded instead if every session
        was aborted since ``generation`` was read."""
        with self._guard:
            current = generation == self._generation
            if current:
                up.last_active = time.monotonic()
                self._uploads[up.upload_id] = up
        if not current:
            up.discard()
        return current

    def abort(self, upload_id: str, user: str) -> None:
        up = self.take(upload_id, user)
        with up.lock:
            up.discard()
        log.info("upload %s for %r aborted by its user", upload_id, up.key)

    def abort_all(self, reason: str) -> int:
        with self._guard:
            self._generation += 1
            ups = list(self._uploads.values())
            self._uploads.clear()
        for up in ups:
            # A chunk stream may hold the lock; discarding the file under it is still safe
            # because the stream fails on its next write, and the id is already gone.
            up.discard()
        if ups:
            log.warning("aborted %d in-flight upload(s): %s", len(ups), reason)
        return len(ups)

    def count(self) -> int:
        with self._guard:
            return len(self._uploads)

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._guard:
            stale = [u for u in self._uploads.values()
                     if now - u.last_active > self.expiration_secs and not u.lock.locked()]
            for u in stale:
                del self._uploads[u.upload_id]
        for u in stale:
            u.discard()
            log.warning("upload %s for %r expired after %.0fs idle; its data was deleted",
                        u.upload_id, u.key, self.expiration_secs)
        return len(stale)

    def _reap_loop(self) -> None:
        period = min(max(self.expiration_secs / 4, 0.2), 10.0)
        while not self._stop.wait(period):
            try:
                self.expire()
                # Forwarded copies no commit installed expire as abandoned uploads do; not
                # before this master had an expiration's time to read the commits, after a
                # restart that found old ones.
                if time.monotonic() - self._started > self.expiration_secs:
                    self.store.staged.expire(self.expiration_secs, wanted=self.staged_wanted)
            except Exception:
                log.exception("upload reaper failed; it keeps running")
