"""The committer: a write's new state by the version rules, its bytes installed, and the group's
metadata committed in one fenced ZooKeeper transaction (ha-rule 13)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

from kazoo.exceptions import (
    ConnectionLoss,
    KazooException,
)
from kazoo.handlers.threading import KazooTimeoutError

from blobha.core.acl import AccessControl
from blobha.core.blobstate import BlobState
from blobha.core.errors import (
    BlobError,
    ChecksumMismatch,
    InvalidArgument,
    KeyAlreadyExists,
    Unavailable,
    VersionConflict,
)
from blobha.leader import Deposed, LeaderElection, is_failure
from blobha.master.forward import Forwarder
from blobha.master.groupcommit import Later
from blobha.master.metadata import Metadata
from blobha.master.quotas import Quotas
from blobha.master.rules import (
    AlreadyWritten,
    Authority,
    CommitOutcomeUnknown,
    PutRequest,
    commit_error,
    next_state,
    record_bytes,
    retried,
)
from blobha.master.settings import MasterSettings
from blobha.master.uploads import Upload, UploadManager
from blobha.store.local import LocalStore
from blobha.sync import Membership, ReplicaSync, acl_bytes
from blobha.zk import layout
from blobha.zk.layout import key_path, replica_path

log = logging.getLogger("blobha.master")


def confirmed_by(new: BlobState, holders: tuple[str, ...]) -> BlobState:
    """``new`` with the holders that confirmed a staged copy, acknowledged in its commit when
    they and the leader make its write quorum (their copies are as durable as a replica's)."""
    if not holders:
        return new
    return replace(new, confirmed=holders,
                   acked=new.acked or 1 + len(holders) >= new.write_quorum)


def _by_index(batch: Sequence[PutRequest], confirmed: dict[str, tuple[str, ...]]
              ) -> dict[int, tuple[str, ...]]:
    return {i: confirmed[p.key] for i, p in enumerate(batch) if p.key in confirmed}


class Committer:
    """Commits writes: one at a time (an upload session) or a group of small ones together."""

    def __init__(self, settings: MasterSettings, identity: str, store: LocalStore,
                 election: LeaderElection, meta: Metadata, authority: Authority,
                 sync: ReplicaSync, membership: Membership, uploads: UploadManager,
                 quotas: Quotas, forwarder: Forwarder | None = None) -> None:
        self.settings = settings
        self.identity = identity
        self.store = store
        self.election = election
        self.meta = meta
        self.authority = authority
        self.sync = sync
        self.membership = membership
        self.uploads = uploads
        self.quotas = quotas
        self.forwarder = forwarder

    def commit_puts(self, batch: Sequence[PutRequest]) -> list[BlobState | BaseException | Later]:
        """One group commit (:class:`GroupCommitter` handler): the batch's new versions are
        installed together (appended to one segment, one fdatasync) and committed in one fenced
        transaction. A write whose operation fails there (the key appeared, moved or vanished
        meanwhile) leaves the batch with its error, and the others commit without it.

        A write whose key is locked elsewhere (a roll-back's fetch, a large upload's commit)
        waits for it off the committing thread and goes in a later batch: waiting here held
        up every other key's writes for as long (seconds, behind a roll-back)."""
        taken: list[int] = []
        with contextlib.ExitStack() as locks:
            for i, p in enumerate(batch):
                lock = self.store.key_lock(p.key)
                if lock.acquire(blocking=False):
                    locks.callback(lock.release)
                    taken.append(i)
            results = self._commit_locked([batch[i] for i in taken]) if taken else []
        done = dict(zip(taken, results, strict=True))
        return [done[i] if i in done else Later(self._key_free(p.key))
                for i, p in enumerate(batch)]

    def _key_free(self, key: str) -> Callable[[], None]:
        def wait() -> None:
            lock = self.store.key_lock(key)
            if not lock.acquire(timeout=self.settings.write_timeout_secs):
                raise Unavailable(f"{key!r} stayed busy with another change; retry")
            lock.release()
        return wait

    def _commit_locked(self, batch: Sequence[PutRequest]) -> list[BlobState | BaseException]:
        """:meth:`commit_puts` of the writes whose keys' locks are held."""
        out: list[BlobState | BaseException] = [
            Unavailable("not committed; retry")] * len(batch)
        try:
            self.meta.require_leader()
        except BlobError as e:
            return [e] * len(batch)
        news: dict[int, BlobState] = {}
        olds: dict[int, BlobState | None] = {}
        now = time.time()
        fresh = {p.key for p in batch if p.create and self.nothing_here(p.key)}
        for i, (p, state) in enumerate(zip(batch, self.meta.states_for_commit(batch, fresh),
                                           strict=True)):
            try:
                if isinstance(state, BaseException):
                    raise state
                olds[i] = state
                news[i] = new = self.next_state(
                    p.user, p.key, p.create, p.acl, p.replication_factor, p.write_quorum,
                    p.expected_version, len(p.data), p.digest, state, now, p.write_tag)
                if not p.create:
                    self.check_quorum(new.write_quorum)
            except Exception as e:
                out[i] = e
                news.pop(i, None)
        if not news:
            return out
        # The other holders receive the bytes while this master installs them.
        forward = self.forwarder.start(
            [(batch[i].key, new.replication_factor, new.write_quorum, new.size, new.digest,
              batch[i].data) for i, new in news.items()]) if self.forwarder else None
        installed = self.store.install_many(
            [(batch[i].key, new.seq, batch[i].data, len(batch[i].data), batch[i].digest)
             for i, new in news.items()])
        if forward is not None:
            for key_index, holders in _by_index(batch, forward.wait()).items():
                if key_index in news:
                    news[key_index] = confirmed_by(news[key_index], holders)
        live: list[int] = []
        for i, result in zip(list(news), installed, strict=True):
            if isinstance(result, ChecksumMismatch):
                out[i] = ChecksumMismatch(
                    f"the data received for {batch[i].key!r} does not match its digest"
                    f" {batch[i].digest}: {result}; nothing was stored, upload again")
            else:
                live.append(i)
        try:
            results = self.commit_together(
                [(batch[i].key, batch[i].create, news[i]) for i in live], fresh)
            for i, committed in zip(live, results, strict=True):
                out[i] = committed
                if isinstance(committed, BlobState):
                    self.quotas.committed(olds[i], committed, batch[i].key, acl_bytes)
        finally:
            for i in live:
                self.drop_uncommitted(batch[i].key, news[i].seq, out[i])
        return out

    def commit_together(self, writes: Sequence[tuple[str, bool, BlobState]],
                         fresh: AbstractSet[str]) -> list[BlobState | BaseException]:
        """Commit ``writes`` (key, create?, new state) in as few fenced transactions as fit in
        ZooKeeper's request limit (one, unless their records take more than
        :data:`layout.MAX_STATE_BYTES` together: a request over it is refused by dropping
        the connection). One result per write: its state, or its error. ``fresh``: the
        created keys this master held nothing of before their install (:meth:`nothing_here`).
        """
        out: list[BlobState | BaseException] = []
        chunk: list[tuple[str, bool, BlobState]] = []
        size = 0
        for write in writes:
            n = record_bytes(write[2])
            if chunk and size + n > layout.MAX_STATE_BYTES:
                out.extend(self._commit_transaction(chunk, fresh))
                chunk, size = [], 0
            chunk.append(write)
            size += n
        if chunk:
            out.extend(self._commit_transaction(chunk, fresh))
        return out

    def _commit_transaction(self, writes: Sequence[tuple[str, bool, BlobState]],
                            fresh: AbstractSet[str]) -> list[BlobState | BaseException]:
        """Commit ``writes`` in one fenced transaction: each its metadata and this master's
        replica node (installed durably before, so a version never appears without a holder),
        and the created keys in the change journal (no watch tells the other masters of them).
        A write whose own operation fails gets its error and the others are tried again
        without it. One result per write: its state, or its error."""
        out: list[BlobState | BaseException | None] = [None] * len(writes)
        live = list(range(len(writes)))
        session = self.sync.session_id()
        records = [new.encode() for _, _, new in writes]
        # New keys acknowledged in the commit, with no other version here (so nothing for a
        # reconcile to prune): the synchroniser makes their entries from the commit itself. A
        # ``fresh`` key had nothing here before its install, under the lock held since.
        creating = [key for key, create, new in writes
                    if create and new.acked
                    and (key in fresh or self.store.versions(key) == [new.seq])]
        self.sync.creating(creating)
        try:
            return self._commit_records(writes, records, out, live, session)
        finally:
            self.sync.created(creating)

    def _commit_records(self, writes: Sequence[tuple[str, bool, BlobState]],
                        records: list[bytes], out: list[BlobState | BaseException | None],
                        live: list[int], session: int) -> list[BlobState | BaseException]:
        """:meth:`_commit_transaction`'s retries, with each write's encoded ``records``."""
        while live:
            batch = [(*writes[i], records[i]) for i in live]

            def build(txn: Any, batch: list[tuple[str, bool, BlobState, bytes]] = batch
                      ) -> None:
                for key, create, new, record in batch:
                    if create:
                        txn.create(key_path(key), record)
                    else:
                        # The version read under the key's lock: any change since fails it.
                        txn.set_data(key_path(key), record, version=new.meta_version)
                    txn.create(replica_path(key, self.identity, new.seq), b"")

            try:
                results = self.election.fenced_results(
                    build, changed=[key for key, create, _, _ in batch if create])
            except Deposed as e:
                lost = Unavailable(f"not the leader any more ({e}); nothing was committed,"
                                   " retry (the client finds the new leader)")
                for i in live:
                    out[i] = lost
                break
            except ConnectionLoss:
                # ha-rule: after ConnectionLoss the write may or may not have applied: re-read.
                # A transaction applies whole, so one key's state tells for all of them.
                key, _, new, _ = batch[0]
                try:
                    self.meta.resolve_unknown_commit(key, new)
                except Unavailable as e:
                    for i in live:
                        out[i] = e
                    break
                results = [True] * (2 * len(batch))
            failed = next((n for n, r in enumerate(results) if is_failure(r)), None)
            if failed is None:
                # One line per transaction, not per write: under many writers a line per write
                # cost measurable leader CPU, and the audit log names each write anyway.
                log.info("committed %s in epoch %d", ", ".join(
                    f"{key!r} v{new.seq} ({new.size} bytes)" for key, _, new, _ in batch),
                    batch[0][2].epoch)
                for i in live:
                    key, create, new = writes[i]
                    self.sync.registered(key, new.seq, session, new.replication_factor,
                                         new if create else None, records[i])
                    # meta_version is stale here; Acknowledger.mark_acked re-reads before its write.
                    out[i] = new
                break
            i = live.pop(failed // 2)
            out[i] = commit_error(writes[i][0], results[failed], metadata=failed % 2 == 0)
        return [r if r is not None else Unavailable("not committed; retry") for r in out]

    def drop_uncommitted(self, key: str, seq: int, result: BlobState | BaseException) -> None:
        """After a commit attempt: delete the installed version ``seq`` unless its commit
        applied, or may have (:class:`CommitOutcomeUnknown`: with W=1 ZooKeeper may already
        call it acknowledged, and this copy would be its only one)."""
        if not isinstance(result, BlobState | CommitOutcomeUnknown):
            self.store.delete_version(key, seq)

    def nothing_here(self, key: str) -> bool:
        """Nothing of ``key`` on this master (the caller holds its lock, so no copy can arrive
        until its commit is over): a create then clobbers nothing, and its transaction's create
        fails if the key exists, so it needs no ZooKeeper read first."""
        return self.sync.view(key) is None and not self.store.versions(key)

    def next_state(self, user: str, key: str, create: bool, acl: tuple[AccessControl, ...],
                   replication_factor: int, write_quorum: int, expected_version: int,
                   size: int, digest: str, state: BlobState | None, now: float,
                   tag: str = "") -> BlobState:
        """:func:`rules.next_state` in this leader's epoch, with the configured defaults,
        within the quotas of the key's creator."""
        new = next_state(self.authority, user, key, create, acl, replication_factor,
                         write_quorum, expected_version, size, digest, state, now, tag,
                         epoch=self.election.epoch, default_quorum=self.settings.write_quorum,
                         versions_retained=self.settings.versions_retained)
        self.quotas.check_write(user, state, new, acl_bytes)
        return new

    def commit_once(self, key: str, tag: str, user: str, commit: Callable[[], BlobState]
                     ) -> BlobState:
        """``commit()``'s new version; or, where the write tagged ``tag`` committed already (a
        retry after a lost answer), that version, not written again. The caller answers
        either through :meth:`Acknowledger.acknowledge`, as the first attempt would have."""
        try:
            return commit()
        except AlreadyWritten as e:
            return retried(key, e.state, user)
        except (KeyAlreadyExists, VersionConflict):
            # A create that took the fast path (no read first) found the key, or the key moved
            # during the commit: it may be this very write's own, committed by an attempt
            # whose answer was lost.
            state = self.meta.read_state_for_write(key) if tag else None
            prior = state.written_by(tag) if state is not None else None
            if prior is None:
                raise
            return retried(key, prior, user)

    def commit_upload(self, user: str, up: Upload, size: int, digest: str,
                       generation: int) -> BlobState:
        key = up.key
        with up.lock, self.store.key_lock(key):
            try:
                fresh = up.create and self.nothing_here(key)
                state = None if fresh else self.meta.read_state_for_write(key)
                new = self.next_state(user, key, up.create, tuple(up.acl), up.replication_factor,
                                       up.write_quorum, up.expected_version, size, digest, state,
                                       time.time(), up.write_tag)
            except (Unavailable, KazooException, KazooTimeoutError):
                # ZooKeeper out of reach before the data was touched: the session goes back,
                # so the client's retry of the commit (it is told to retry) finds its data
                # instead of uploading it all again, or failing if it came from a pipe.
                self.uploads.restore(up, generation)
                raise
            except BaseException:
                up.discard()
                raise
            forward, up.forward = up.forward, None
            holders: list[str] = []
            try:
                if forward is not None and new.write_quorum >= 2:
                    # The holders sync their copies while this master syncs its own.
                    ending = threading.Thread(
                        target=lambda f=forward: holders.extend(f.finish(size, digest)),
                        name="forward-finish", daemon=True)
                    ending.start()
                    try:
                        self.store.install(key, new.seq, up.temp, size, digest)
                    finally:
                        ending.join()
                    new = confirmed_by(new, tuple(holders))
                else:
                    if forward is not None:
                        forward.drop()
                    self.store.install(key, new.seq, up.temp, size, digest)
            except BaseException:
                if forward is not None:
                    forward.drop()
                up.temp.discard()
                raise
            result: BlobState | BaseException = Unavailable("not committed; retry")
            try:
                result = self.commit_together([(key, up.create, new)],
                                               fresh={key} if fresh else set())[0]
            finally:
                self.drop_uncommitted(key, new.seq, result)
            if isinstance(result, BaseException):
                raise result
            self.quotas.committed(state, result, key, acl_bytes)
        return result

    def check_quorum(self, w: int) -> None:
        masters = len(self.membership.known() | {self.identity})
        if w > masters:
            # The commit could never be acknowledged: it would time out after committing, and
            # leave an unacknowledged version behind. Refuse before anything is written.
            raise InvalidArgument(
                f"write quorum {w} exceeds the {masters} masters in the cluster; lower it"
                " (--write-quorum, blobstore.write.quorum) or start more masters"
            )
