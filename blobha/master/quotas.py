"""Per-user quotas on what the leader takes on for a user (docs/security.md, "Quotas"): keys,
the bytes of their current versions, their ACLs' bytes in ZooKeeper, unfinished uploads' bytes
and live job tokens. One user past a limit is refused with RESOURCE_EXHAUSTED; everybody
else's writes go on.

The key figures come from the leader's replica view (:meth:`Synchronizer.usage`), which follows
every committed change within moments, plus what this leader committed that its view does not
show yet (:meth:`Quotas.committed`): a user's next write is checked against all of its last
ones. Writes committing at the same moment are each checked against the figures before them,
so together they may pass a limit by one group commit or the user's unfinished uploads; the
next write is refused. A delete frees its room once the view has it, within moments.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blobha.core.blobstate import BlobState
from blobha.core.errors import ResourceExhausted
from blobha.master.rules import Authority
from blobha.master.settings import MasterSettings
from blobha.sync import Usage


@dataclass(frozen=True)
class QuotaLimits:
    """Each limit per user; 0: none."""

    keys: int = 0
    bytes: int = 0
    acl_bytes: int = 0
    upload_bytes: int = 0
    job_tokens: int = 0
    #: The cluster's, whoever creates (blobstore.keys.max).
    cluster_keys: int = 0

    @classmethod
    def of(cls, s: MasterSettings) -> QuotaLimits:
        return cls(keys=s.quota_keys, bytes=s.quota_bytes, acl_bytes=s.quota_acl_bytes,
                   upload_bytes=s.quota_upload_bytes, job_tokens=s.quota_job_tokens,
                   cluster_keys=s.keys_max)


def _refuse(user: str, what: str, have: int, adding: int, limit: int, option: str,
            fix: str) -> ResourceExhausted:
    return ResourceExhausted(
        f"user {user!r} is at its quota of {what}: it holds {have:,}, this would add"
        f" {adding:,}, and {option} is {limit:,}; {fix}, or ask an operator to raise {option}")


#: How long a change is counted while the view does not show it: far longer than the view
#: takes, and the bound on a miscount after a change whose outcome was lost.
PENDING_SECS = 30.0
#: Changes remembered so per user at most (the oldest go first): a bound on memory and on
#: each check.
PENDING_MAX = 4096

#: Where the pending creates of the whole cluster are kept (no user is named "").
_CLUSTER = ""

#: What the view holds of a key: (the creation time of its incarnation, its version); None:
#: nothing.
Seen = tuple[float, int] | None


@dataclass(frozen=True)
class _Change:
    """A change this leader made that the view may not show yet."""

    key: str
    #: The incarnation of the key it changed (its creation time), and the version it made
    #: (0: it deleted that incarnation).
    created_at: float
    seq: int
    added: Usage
    until: float

    def shown(self, seen: Seen) -> bool:
        """Whether the view has this change (or something later) as ``seen``."""
        if self.seq == 0:  # a delete: the view has that incarnation no more
            return seen is None or seen[0] > self.created_at
        return seen is not None and (seen[0] > self.created_at
                                     or (seen[0] == self.created_at and seen[1] >= self.seq))


class Quotas:
    """The checks, each before the change it guards is made. ``usage``: a user's figures as
    the view has them; ``seen``: what the view has of a key."""

    def __init__(self, limits: QuotaLimits, authority: Authority,
                 usage: Callable[[str], Usage], seen: Callable[[str], Seen],
                 key_count: Callable[[], int]) -> None:
        self.limits = limits
        #: The keys the cluster holds, as the leader's view has them.
        self._key_count = key_count
        self.authority = authority
        self._view_usage = usage
        self._seen = seen
        self._lock = threading.Lock()
        # Per creator, in the order made; under _CLUSTER, every create (for the cluster's
        # limit, with one set).
        self._pending: dict[str, list[_Change]] = {}

    def committed(self, old: BlobState | None, new: BlobState, key: str,
                  acl_bytes: Callable[[BlobState], int]) -> None:
        """This leader committed ``new`` over ``old`` (None: a create): counted until the
        view shows it."""
        if old is None and self.limits.cluster_keys:
            self._remember(_CLUSTER, _Change(key, new.created_at, new.seq, Usage(1),
                                             time.monotonic() + PENDING_SECS))
        self._add(new.creator, _Change(key, new.created_at, new.seq, Usage(
            1 if old is None else 0, new.size - (old.size if old is not None else 0),
            acl_bytes(new) - (acl_bytes(old) if old is not None else 0)),
            time.monotonic() + PENDING_SECS))

    def deleted(self, state: BlobState, key: str, acl_bytes: Callable[[BlobState], int]
                ) -> None:
        """This leader deleted ``key``, which was ``state``: its room is free at once, not
        once the view has heard (a user at a limit deletes to write the next)."""
        self._add(state.creator, _Change(key, state.created_at, 0,
                                         Usage(-1, -state.size, -acl_bytes(state)),
                                         time.monotonic() + PENDING_SECS))

    def _add(self, owner: str, change: _Change) -> None:
        lim = self.limits
        if not (lim.keys or lim.bytes or lim.acl_bytes) or self.exempt(owner):
            return
        self._remember(owner, change)

    def _remember(self, owner: str, change: _Change) -> None:
        with self._lock:
            mine = self._pending.setdefault(owner, [])
            mine.append(change)
            if len(mine) > PENDING_MAX:
                del mine[0]

    def exempt(self, *users: str) -> bool:
        """Whether a change by or for these users is not counted: any of them an admin (or
        the masters' principal), who is trusted with the cluster as a whole."""
        return any(self.authority.privileged(u) for u in users)

    def _cluster_keys(self) -> int:
        """The keys of the leader's view, and its creates the view does not show yet."""
        return self._key_count() + sum(c.added.keys for c in self._unshown(_CLUSTER))

    def _usage(self, user: str) -> Usage:
        """``user``'s figures: the view's, and this leader's changes the view lacks."""
        u = self._view_usage(user)
        for c in self._unshown(user):
            u = Usage(u.keys + c.added.keys, u.bytes + c.added.bytes,
                      u.acl_bytes + c.added.acl_bytes)
        return u

    def _unshown(self, owner: str) -> list[_Change]:
        """``owner``'s changes the view does not show yet (those it shows, or too old to
        count, are forgotten here)."""
        with self._lock:
            mine = list(self._pending.get(owner, ()))
        if not mine:
            return []
        now = time.monotonic()
        done = {id(c) for c in mine if c.until < now or c.shown(self._seen(c.key))}
        if done:
            with self._lock:
                left = [c for c in self._pending.get(owner, ()) if id(c) not in done]
                if left:
                    self._pending[owner] = left
                else:
                    self._pending.pop(owner, None)
        return [c for c in mine if id(c) not in done]

    def check_write(self, user: str, old: BlobState | None, new: BlobState,
                    acl_bytes: Callable[[BlobState], int]) -> None:
        """A commit of ``new`` over ``old`` (None: a create) by ``user``, counted against the
        key's creator (who pays for a key however many others may write it)."""
        owner = new.creator
        lim = self.limits
        if old is None and lim.cluster_keys:
            # Everybody's, admins too: it guards ZooKeeper's heap.
            have = self._cluster_keys()
            if have + 1 > lim.cluster_keys:
                raise ResourceExhausted(
                    f"the cluster is at its limit of keys: it holds {have:,} and"
                    f" blobstore.keys.max is {lim.cluster_keys:,}; delete keys no longer"
                    " needed, or ask an operator to raise blobstore.keys.max once ZooKeeper"
                    " has the heap for more (docs/operations.md, \"Capacity\")")
        if not (lim.keys or lim.bytes or lim.acl_bytes) or self.exempt(user, owner):
            return
        u = self._usage(owner)
        if old is None and lim.keys and u.keys + 1 > lim.keys:
            raise _refuse(owner, "keys", u.keys, 1, lim.keys, "blobstore.quota.user.keys",
                          "delete keys it no longer needs")
        grow = new.size - (old.size if old is not None else 0)
        if lim.bytes and grow > 0 and u.bytes + grow > lim.bytes:
            raise _refuse(owner, "stored bytes", u.bytes, grow, lim.bytes,
                          "blobstore.quota.user.bytes", "delete or shrink blobs")
        if old is None:
            self.check_acl(user, owner, 0, acl_bytes(new), u)

    def check_acl(self, user: str, owner: str, before: int, after: int,
                  u: Usage | None = None) -> None:
        """An ACL of ``after`` bytes replacing one of ``before`` on a key of ``owner``'s, set
        by ``user``."""
        lim = self.limits.acl_bytes
        grow = after - before
        if not lim or grow <= 0 or self.exempt(user, owner):
            return
        u = u if u is not None else self._usage(owner)
        if u.acl_bytes + grow > lim:
            raise _refuse(owner, "ACL bytes", u.acl_bytes, grow, lim,
                          "blobstore.quota.user.acl.bytes",
                          "give access through fewer entries (a group instead of its users)")

    def check_begin(self, user: str, owner: str, open_bytes: int, size_hint: int,
                    old_size: int) -> None:
        """An upload that says it will send ``size_hint`` bytes (-1: not said), begun while
        ``user``'s unfinished uploads hold ``open_bytes``: refused at once when it could
        not commit, not after its last byte."""
        if size_hint < 0 or self.exempt(user, owner):
            return
        self.check_upload(user, open_bytes, size_hint)
        lim = self.limits.bytes
        grow = size_hint - old_size
        if lim and grow > 0:
            u = self._usage(owner)
            if u.bytes + grow > lim:
                raise _refuse(owner, "stored bytes", u.bytes, grow, lim,
                              "blobstore.quota.user.bytes", "delete or shrink blobs")

    def check_upload(self, user: str, open_bytes: int, adding: int) -> None:
        """``adding`` more bytes to ``user``'s unfinished uploads, which hold ``open_bytes``."""
        lim = self.limits.upload_bytes
        if lim and adding > 0 and open_bytes + adding > lim and not self.exempt(user):
            raise _refuse(user, "unfinished upload bytes", open_bytes, adding, lim,
                          "blobstore.quota.user.upload.bytes",
                          "commit or abort its other uploads first")

    def check_job_token(self, user: str, live: int) -> None:
        """One more job token for ``user``, who holds ``live`` unexpired ones."""
        lim = self.limits.job_tokens
        if lim and live + 1 > lim and not self.exempt(user):
            raise _refuse(user, "live job tokens", live, 1, lim, "auth.job.token.max.per.user",
                          "revoke tokens of finished jobs ('blobha token revoke')")


__all__ = ["QuotaLimits", "Quotas"]
