"""Administration of keys: ACL and replication-factor changes, and deletes."""

from __future__ import annotations

import logging
from dataclasses import replace

from kazoo.exceptions import (
    BadVersionError,
    NoNodeError,
    NotEmptyError,
)

from blobha.core import acl as acls
from blobha.core.acl import AccessControl
from blobha.core.blobstate import BlobState
from blobha.core.errors import (
    KeyNotFound,
    Unavailable,
    VersionConflict,
)
from blobha.core.keys import validate_key
from blobha.leader import Deposed
from blobha.master.metadata import Metadata
from blobha.master.quotas import Quotas
from blobha.master.rules import (
    Authority,
    fitting,
)
from blobha.store.local import LocalStore
from blobha.sync import ReplicaSync, acl_bytes

log = logging.getLogger("blobha.master")


class Admin:
    """Metadata changes and deletes, each under the key's lock and fenced."""

    def __init__(self, store: LocalStore, meta: Metadata, authority: Authority,
                 sync: ReplicaSync, quotas: Quotas) -> None:
        self.store = store
        self.meta = meta
        self.authority = authority
        self.sync = sync
        self.quotas = quotas

    def set_meta(
        self, user: str, key: str, acl: list[AccessControl] | None, replication_factor: int,
        expected_meta_version: int | None,
    ) -> BlobState:
        """Change the ACL and/or the replication factor; with ``expected_meta_version`` (0
        included: a new key's metadata is at 0) only if the metadata is still that version."""
        self.meta.require_leader()
        validate_key(key)
        if acl is not None:
            acls.check_entries(acl)
        # The commit path holds this lock from read to conditional write; sharing it means a
        # metadata change never makes a concurrent upload fail with a spurious conflict.
        with self.store.key_lock(key):
            return self._set_meta_locked(user, key, acl, replication_factor,
                                         expected_meta_version)

    def _set_meta_locked(
        self, user: str, key: str, acl: list[AccessControl] | None, replication_factor: int,
        expected_meta_version: int | None,
    ) -> BlobState:
        for _ in range(5):
            state = self.meta.state_for_write_or_404(key)
            self.authority.require(user, state.acl, acls.ADMIN, key)
            if expected_meta_version is not None and state.meta_version != expected_meta_version:
                raise VersionConflict(
                    f"{key!r} metadata is at version {state.meta_version}, not"
                    f" {expected_meta_version}; re-read and retry"
                )
            new = state
            if acl is not None:
                new = replace(new, acl=tuple(acls.normalize_for_set(acl, user)))
                self.authority.require_acl(key, new.acl)
                self.quotas.check_acl(user, state.creator, acl_bytes(state), acl_bytes(new))
            if replication_factor:
                new = replace(new, replication_factor=replication_factor)
            fitting(key, new)
            try:
                self.meta.fenced_set(key, new, state.meta_version)
            except BadVersionError:
                continue
            except NoNodeError:
                raise KeyNotFound(f"{key!r} was deleted meanwhile") from None
            except Deposed as e:
                raise Unavailable(f"not the leader any more ({e}); nothing changed, retry (the"
                                  " client finds the new leader)") from None
            log.info("meta of %r changed by %r: acl=%s rf=%d", key, user,
                     acls.format_acl(new.acl), new.replication_factor)
            self.sync.schedule(key)
            return replace(new, meta_version=state.meta_version + 1)
        raise VersionConflict(f"{key!r} kept changing; retry")

    def delete(self, user: str, key: str, expected_created_at: float | None = None) -> None:
        """Delete ``key``; with ``expected_created_at``, only the key created at that time
        (:class:`VersionConflict` if it was deleted and created again since)."""
        self.meta.require_leader()
        validate_key(key)
        with self.store.key_lock(key):
            self._delete_locked(user, key, expected_created_at)

    def _delete_locked(self, user: str, key: str, expected_created_at: float | None) -> None:
        for _ in range(10):
            state = self.meta.state_for_write_or_404(key)
            # Before the permission check: the key the caller meant is gone either way, and the
            # new one, which it may not be allowed to touch, is none of its business (a delete
            # retried after a lost answer is told so, not refused). Nothing of the new key
            # is told but that it exists, which a NOT_FOUND tells anyone too.
            if expected_created_at is not None and state.created_at != expected_created_at:
                raise VersionConflict(
                    f"{key!r} was deleted and created again since it was read; nothing was"
                    " deleted"
                )
            self.authority.require(user, state.acl, acls.WRITE, key)
            try:
                self.meta.fenced_delete(key, state.meta_version)
            except (NotEmptyError, BadVersionError, NoNodeError):
                continue  # a replica registered or the meta changed meanwhile: re-read
            except Deposed as e:
                raise Unavailable(f"not the leader any more ({e}); nothing was deleted, retry"
                                  " (the client finds the new leader)") from None
            self.quotas.deleted(state, key, acl_bytes)
            log.info("deleted %r (was v%d) for %r", key, state.seq, user)
            return
        raise Unavailable(f"{key!r} kept changing while being deleted; retry")
