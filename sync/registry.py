"""Replica registration: this master's replica nodes, and the leader's commits that make them."""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import TYPE_CHECKING

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError

from blobha.core.blobstate import BlobState
from blobha.sync.feed import session_of
from blobha.sync.view import ReplicaView
from blobha.sync.workqueue import WorkQueue
from blobha.zk.layout import replica_path

if TYPE_CHECKING:
    from blobha.sync.feed import ChangeFeed
    from blobha.sync.settings import SyncSettings

log = logging.getLogger("blobha.sync.synchronizer")


class SyncDeferred(Exception):
    """Nothing to fetch from right now; the key is retried when a replica registers."""


class ReplicaRegistry:
    """Makes and removes this master's replica nodes, and keeps the view in step with them."""

    def __init__(self, zk: KazooClient, identity: str, view: ReplicaView, feed: ChangeFeed,
                 queue: WorkQueue, settings: SyncSettings) -> None:
        self.zk = zk
        self.identity = identity
        self.view = view
        self.feed = feed
        self.queue = queue
        self.settings = settings

    def session_id(self) -> int:
        """The current ZooKeeper session's id (0 when there is none)."""
        return session_of(self.zk)

    def delete_node(self, path: str) -> None:
        with suppress(NoNodeError):
            self.zk.delete(path)

    # ---- registering -----------------------------------------------------------------------

    def register_replica(self, key: str, seq: int) -> None:
        """Make our replica node exist (ha-rules 6, 7): persistent, so a master's death costs
        ZooKeeper one node (its /holders node), not one per key it held."""
        session = self.session_id()
        if self.view.is_registered(key, seq, session):
            return
        path = replica_path(key, self.identity, seq)
        for _ in range(self.settings.register_attempts):
            try:
                # No makepath: if the key was deleted meanwhile, we must not resurrect it.
                self.zk.create(path, b"")
                break
            except NodeExistsError:
                stat = self.zk.exists(path)
                if stat is not None and stat.ephemeralOwner in (0, session):
                    break  # ours: persistent (checked this session), or made in it
                # An ephemeral node of an earlier session (made before replica nodes were
                # persistent): removed here, or gone by itself between the create and the
                # look. Either way, none is ours yet.
                if stat is not None:
                    self.delete_node(path)
            except NoNodeError:
                return
        else:
            raise NodeExistsError(f"{path} kept belonging to another session; retried later")
        self.view.registered(key, seq, session)

    def register_many(self, items: list[tuple[str, int]]) -> dict[str, Exception]:
        """Register many replica nodes, ``register_batch`` per ZooKeeper transaction; the
        failures per key. Callers pass only versions installed and verified (ha-rule 7)."""
        failures: dict[str, Exception] = {}
        session = self.session_id()
        step = self.settings.register_batch
        for start in range(0, len(items), step):
            chunk = items[start:start + step]
            ok = False
            if len(chunk) > 1:
                txn = self.zk.transaction()
                for key, seq in chunk:
                    # No makepath here either: a deleted key fails the create.
                    txn.create(replica_path(key, self.identity, seq), b"")
                try:
                    results = txn.commit()
                    # commit() does not raise when an op fails: every element must be checked.
                    ok = all(not isinstance(r, BaseException) for r in results)
                except KazooException:
                    ok = False  # outcome unknown: the one-by-one path below re-reads
            if ok:
                for key, seq in chunk:
                    self.view.registered(key, seq, session)
                continue
            # A multi-op is all or nothing: one node left over from an earlier session, or one
            # key deleted meanwhile, fails it all. Those cases take the careful path per key.
            for key, seq in chunk:
                try:
                    self.register_replica(key, seq)
                except Exception as e:
                    failures[key] = e
        return failures

    def drop_deleted(self, to_register: list[tuple[str, int]], failures: dict[str, Exception]
                     ) -> list[tuple[str, int]]:
        """``to_register`` without the keys deleted since the batch read them (recursive watch):
        the copy may be of the deleted key, and the node, created after a re-create, would count
        it as a holder of the new version. The deletion's event queued the key again."""
        gone = self.view.deleted_meanwhile(key for key, _ in to_register)
        for key in gone:
            failures[key] = SyncDeferred(f"{key!r} was deleted while it was fetched; looking"
                                         " again")
        return [item for item in to_register if item[0] not in gone]

    def undo_deleted(self, registered: list[tuple[str, int]], failures: dict[str, Exception]
                     ) -> None:
        """Remove the replica nodes just created for keys deleted meanwhile. ZooKeeper sends a
        session its events before the answers to its later requests, and on_tree runs on the
        connection thread: a deletion that came before the registrations is known by now, even
        one whose event was still on the way when drop_deleted looked."""
        gone = self.view.deleted_meanwhile(key for key, _ in registered if key not in failures)
        late = [(key, seq) for key, seq in registered if key not in failures and key in gone]
        for key, seq in late:
            try:
                self.delete_node(replica_path(key, self.identity, seq))
            except Exception as e:
                failures[key] = e  # retried; the next reconcile judges the copy again
                continue
            self.view.unregistered(key)
            failures[key] = SyncDeferred(f"{key!r} was deleted while it was registered; looking"
                                         " again")

    def corrupted(self, key: str, seq: int) -> None:
        """A stored version failed its digest and was removed: stop advertising it and fetch
        a healthy copy."""
        self.view.unregistered(key)
        try:
            self.delete_node(replica_path(key, self.identity, seq))
        except KazooException:
            log.warning("could not unregister corrupt replica of %r now; the reconcile will", key)
        self.queue.put(key)

    # ---- the leader's commits ----------------------------------------------------------------

    def creating(self, keys: list[str]) -> None:
        """``keys`` are about to be created by this master's commit, each acknowledged in it
        and with no other version here: from now their replica-node events are held for
        :meth:`registered`, which makes their entries. Call :meth:`created` once the commit
        is over, whatever its outcome."""
        if not self.feed.recursive:
            return  # the one-shot watches are armed by the reconcile this would save
        self.view.commit_creating(keys)

    def created(self, keys: list[str]) -> None:
        """The commit announced by :meth:`creating` is over."""
        self.view.commit_ended(keys)

    def follow(self, key: str, seq: int) -> None:
        """After this master's commit of ``seq``: reconcile ``key``, unless the commit itself
        gave it its entry (a create acknowledged in its commit, :meth:`creating`). Only the
        follower's work is left then, and nothing to read back: the version and our replica
        node are what the commit wrote, and the other holders come as events."""
        if not self.view.commit_followed(key, seq):
            self.queue.put(key)

    def registered(self, key: str, seq: int, session: int, replication_factor: int,
                   state: BlobState | None = None, record: bytes = b"") -> None:
        """The leader's commit created our replica node of ``seq`` in ``session`` (in the same
        transaction as the version itself). ``state`` and ``record`` (its encoding, as
        written): the version, for a key created by that commit and announced by
        :meth:`creating`."""
        # Without the recursive watch, the new version's replica list is about to move (the
        # other holders fetch it), and this master's own node is in it already: the reconcile
        # that follows the commit arms the list's watch with its first read, instead of a
        # second.
        arm_at = (time.monotonic() if replication_factor > 1 and not self.feed.recursive
                  else None)
        self.view.commit_registered(key, seq, session, state, record, arm_at)


__all__ = ["ReplicaRegistry", "SyncDeferred"]
