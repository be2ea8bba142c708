"""The version rules of writes, as functions over values: who may write, a write's quorum, the
state a write commits, write tags and retries, and what a failed commit is told. No I/O."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from blobha.core import acl as acls
from blobha.core import keys
from blobha.core.acl import AccessControl
from blobha.core.blobstate import BlobState, write_tag
from blobha.core.digest import is_digest
from blobha.core.errors import (
    BlobError,
    InvalidArgument,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    Unavailable,
    VersionConflict,
)
from blobha.wire.status import ReplicationStatus
from blobha.zk import layout

log = logging.getLogger("blobha.master")


def no_such_key(key: str) -> KeyNotFound:
    return KeyNotFound(f"no blob with key {key!r}")


def replication_status(key: str, state: BlobState, holders: Sequence[str],
                       live: AbstractSet[str] = frozenset(),
                       holding: AbstractSet[str] | None = None) -> ReplicationStatus:
    """``holders``: the replica nodes of ``state``'s version. They count only for masters in
    ``holding`` (under /holders) when it is given: the nodes are persistent, and a dead
    master's stay (ha-rule 9). A master that confirmed a staged copy before the commit
    (``state.confirmed``) and has a session (in ``live``) holds it as durably, and counts as a
    holder too until its replica node follows."""
    if holding is not None:
        holders = [h for h in holders if h in holding]
    if state.confirmed and live:
        holders = sorted(set(holders) | (set(state.confirmed) & live))
    return ReplicationStatus(key, state.seq, len(holders), state.replication_factor,
                             tuple(holders))


@dataclass(frozen=True)
class PutRequest:
    """A whole small blob waiting for its group commit (see :meth:`Master.put`)."""

    user: str
    key: str
    create: bool
    acl: tuple[AccessControl, ...]
    #: Requested for a create; an update keeps the key's own.
    replication_factor: int
    write_quorum: int
    expected_version: int
    data: bytes
    digest: str
    write_tag: str = ""


def check_digest(digest: str) -> None:
    if not is_digest(digest):
        raise InvalidArgument(
            "the digest must be the xxh3-128 of the content as 32 lower-case hex digits"
        )


def fitting(key: str, state: BlobState) -> BlobState:
    """``state``, if its record fits in ZooKeeper (:data:`layout.MAX_STATE_BYTES`); else
    InvalidArgument, before anything is written. The ACL's own bound (acl.MAX_STORED_BYTES)
    leaves room for the rest; this catches what it cannot: a setter or creator entry added
    to an ACL at that bound, or a long history of retained versions."""
    size = record_bytes(state)
    if size > layout.MAX_STATE_BYTES:
        raise InvalidArgument(
            f"the metadata of {key!r} would take {size:,} bytes, more than the"
            f" {layout.MAX_STATE_BYTES:,} ZooKeeper has room for: give access to fewer users"
            " or use shorter names in its ACL"
        )
    return state


def record_bytes(state: BlobState) -> int:
    """At least the bytes ``state``'s record takes: for a small one its bound, an over-estimate
    (cheap, and a sum of them still keeps a transaction under ZooKeeper's limit) that spares
    encoding nearly every write once more to measure it, which costs far more; for a large one,
    the exact size."""
    bound = state.size_bound()
    return bound if bound <= layout.MAX_STATE_BYTES // 64 else len(state.encode())


class CommitOutcomeUnknown(Unavailable):
    """ZooKeeper stayed out of reach after a commit was sent, so it may have applied; with
    W=1 it would then be acknowledged in ZooKeeper, with this master's copy as its only one.
    That copy is kept: the synchroniser re-registers it once a session is back, or removes it
    as debris once the key's committed state shows the commit never happened."""


class Superseded(Exception):
    """A version waited for (its write quorum) was superseded by a newer commit, acknowledged
    (``state``)."""

    def __init__(self, state: BlobState) -> None:
        super().__init__(f"superseded by v{state.seq}")
        self.state = state


def retried(key: str, prior: BlobState, user: str) -> BlobState:
    log.info("%r v%d: a retry of the write that committed it (by %r); not written again",
             key, prior.seq, user)
    return prior


class AlreadyWritten(Exception):
    """A write found its own version committed (a retry after a lost answer)."""

    def __init__(self, state: BlobState) -> None:
        super().__init__(f"v{state.seq} was written by this write already")
        self.state = state


#: Longest write id a client may name a write with.
MAX_WRITE_ID_BYTES = 64


def tag_of(user: str, write_id: bytes) -> str:
    if len(write_id) > MAX_WRITE_ID_BYTES:
        raise InvalidArgument(
            f"a write id is at most {MAX_WRITE_ID_BYTES} bytes, not {len(write_id)}")
    return write_tag(user, write_id)


def commit_error(key: str, error: Exception, metadata: bool) -> BlobError:
    """What a write is told when its operation failed in a commit transaction."""
    if isinstance(error, NodeExistsError) and metadata:
        return KeyAlreadyExists(f"key {key!r} already exists")
    if isinstance(error, BadVersionError | NoNodeError):
        return VersionConflict(f"{key!r} changed during the commit; retry")
    return Unavailable(f"the commit of {key!r} failed ({type(error).__name__}); nothing was"
                       " committed, retry")

class Authority:
    """Who may do what: the cluster's administrators and the masters' own principal may do
    anything; a code key (``code.<user>.…``, :func:`blobha.core.keys.code_owner`) is its
    owner's alone to create, write and administer, whatever its ACL says, and others may at
    most read it; everyone else as a key's ACL says."""

    def __init__(self, admins: frozenset[str], principal: str) -> None:
        self.admins = admins
        self.principal = principal

    def privileged(self, user: str) -> bool:
        return user in self.admins or user == self.principal

    def require(self, user: str, acl: tuple[AccessControl, ...] | list[AccessControl],
                access: int, key: str) -> None:
        if self.privileged(user):
            return
        if access & (acls.WRITE | acls.ADMIN):
            # Before the ACL: one granting another user WRITE (stored before the masters kept
            # code keys to their owners) must not let them swap the owner's code.
            refusal = keys.code_key_refusal(user, key)
            if refusal:
                raise NotAuthorized(refusal)
        if keys.owns_code_key(user, key) or acls.allowed(acl, user, access):
            return
        raise NotAuthorized(
            f"user {user!r} lacks {acls.describe(access)} permission on {key!r}; ask a user"
            " with ADMIN on it to grant access"
        )

    def require_create(self, user: str, key: str,
                       acl: tuple[AccessControl, ...] | list[AccessControl]) -> None:
        """``user`` may create ``key`` with ``acl`` (as the create will store it): anyone may
        create a key, but a code key only its owner, with an ACL that grants nobody else
        WRITE or ADMIN."""
        if not self.privileged(user):
            refusal = keys.code_key_refusal(user, key)
            if refusal:
                raise NotAuthorized(refusal)
        self.require_acl(key, acl)

    def require_acl(self, key: str,
                    acl: tuple[AccessControl, ...] | list[AccessControl]) -> None:
        """``acl`` may be stored for ``key``: a code key's grants nobody but its owner (and
        the privileged) WRITE or ADMIN (:func:`acl.code_acl_refusal`)."""
        refusal = acls.code_acl_refusal(key, acl, self.privileged)
        if refusal:
            raise NotAuthorized(refusal)

    def access(self, user: str, acl: Sequence[AccessControl], key: str = "") -> int:
        """The permission bits ``user`` holds on ``key`` with ``acl`` (without ``key``: as
        the ACL says, for a key that is no code key)."""
        if self.privileged(user):
            return acls.ALL
        if keys.owns_code_key(user, key):
            return acls.ALL
        have = acls.access_of(acl, user)
        return have & acls.READ if keys.code_owner(key) is not None else have


def quorum(write_quorum: int, rf: int, default: int, key: str = "") -> int:
    """A write's quorum: as asked (0 = the default), which the replication factor ``rf``
    must allow; by default ``default`` (the configured quorum), capped by ``rf``. ``key``: an
    existing key's, whose factor can be raised."""
    if write_quorum > rf:
        what = f" of {key!r}; lower it, or raise the key's factor first" if key else "; lower it"
        raise InvalidArgument(
            f"write quorum {write_quorum} exceeds the replication factor {rf}{what}")
    return write_quorum or min(default, rf)


def check_update(authority: Authority, user: str, key: str, state: BlobState | None,
                 expected_version: int) -> BlobState:
    """The state an update by ``user`` applies to, if it may: the key exists, ``user`` may
    WRITE it, and it is at ``expected_version`` when one is named."""
    if state is None:
        raise KeyNotFound(f"no blob with key {key!r} to update")
    authority.require(user, state.acl, acls.WRITE, key)
    if expected_version and state.seq != expected_version:
        raise VersionConflict(
            f"{key!r} is at version {state.seq}, not {expected_version}; re-read and retry"
        )
    return state


def next_state(authority: Authority, user: str, key: str, create: bool,
               acl: tuple[AccessControl, ...], replication_factor: int, write_quorum: int,
               expected_version: int, size: int, digest: str, state: BlobState | None,
               now: float, tag: str = "", *, epoch: int, default_quorum: int,
               versions_retained: int) -> BlobState:
    """The state a write commits over ``state`` (the key's current one, None if absent), in
    leadership ``epoch``; acknowledged at once where the leader's own durable copy is the
    quorum (W=1). ``write_quorum`` is a create's own, or an update's as asked (0 = the
    default), checked here against the key's factor. :class:`AlreadyWritten` if ``state``
    records this write (``tag``) as made already."""
    prior = state.written_by(tag) if state is not None else None
    if prior is not None:
        # Checked before anything else: an update retried after someone else's would
        # otherwise write its data again on top, and a create would find its own key.
        raise AlreadyWritten(prior)
    if create:
        if state is not None:
            raise KeyAlreadyExists(f"key {key!r} already exists")
        # Checked when the write began too; here again, as every commit's last word.
        authority.require_create(user, key, acl)
        new = BlobState(
            seq=1, size=size, digest=digest, acl=acl, replication_factor=replication_factor,
            creator=user, created_at=now, updated_at=now, epoch=epoch, acked=False,
            write_quorum=write_quorum, write_tag=tag,
        )
    else:
        state = check_update(authority, user, key, state, expected_version)
        new = state.with_new_version(
            state.seq + 1, size, digest, now, epoch,
            quorum(write_quorum, state.replication_factor, default_quorum, key),
            versions_retained, tag,
        )
    return fitting(key, replace(new, acked=new.write_quorum <= 1))
