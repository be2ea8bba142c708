"""The master's ZooKeeper data access: committed key states, fenced writes and deletes, and
what to do when a commit's outcome is unknown."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    KazooException,
    NoNodeError,
)
from kazoo.handlers.threading import KazooTimeoutError

from blobha.core.blobstate import BlobState
from blobha.core.errors import (
    NotLeader,
    Refused,
    Unavailable,
)
from blobha.leader import LeaderElection, answer_within
from blobha.master.rules import (
    CommitOutcomeUnknown,
    PutRequest,
    no_such_key,
    replication_status,
)
from blobha.wire.status import ReplicationStatus
from blobha.zk import layout
from blobha.zk.layout import BLOBSTORE, key_path

log = logging.getLogger("blobha.master")


class Metadata:
    """Reads and fenced writes of the committed state in ZooKeeper, for one master."""

    def __init__(self, zk: KazooClient, election: LeaderElection, identity: str,
                 session_timeout: float, stopped: threading.Event) -> None:
        self.zk = zk
        self.election = election
        self.identity = identity
        self.session_timeout = session_timeout
        self._stopped = stopped
        self._key_list: tuple[int, list[str]] | None = None  # (cversion, sorted keys)

    def require_leader(self) -> None:
        if self.election.is_leader:
            return
        if self.zk.state != KazooState.CONNECTED:
            raise Refused(
                f"ZooKeeper is unreachable from master {self.identity}: it has lost its"
                " ZooKeeper connection and takes no writes; nothing was written, retry shortly"
                " or use another master"
            )
        leader = self.election.leader_address
        if leader and leader != self.identity:
            raise NotLeader(f"{self.identity} is not the leader; send this to {leader}", leader)
        raise Refused("no leader is ready yet (election in progress); retry in a moment")

    def require_zk(self) -> None:
        if self.zk.state != KazooState.CONNECTED:
            raise Refused(
                f"ZooKeeper is unreachable from master {self.identity}; retry shortly or ask"
                " another master"
            )

    def answer(self, pending: Any) -> Any:
        """The answer to a ZooKeeper call made for a read, waited for at most the session
        timeout (then KazooTimeoutError: unreachable). The connection check before it and the
        call are not atomic: a call made just after the connection dropped is held by kazoo
        until a connection is back, for ever if ZooKeeper stays away, with the request's
        thread."""
        return pending.get(timeout=self.session_timeout)

    def answer_write(self, pending: Any) -> Any:
        """:meth:`answer` for a write: waited for at most the suspension limit (2/3 of the
        session timeout), and not past the watchdog's bound once the connection is suspended,
        so that a leader cut off from ZooKeeper answers its writers within that bound.

        kazoo pings only an idle connection: a master that keeps sending requests (a leader
        under writes) may not see a dead connection as suspended for as long as it sends, so
        a write's wait ends by itself, as kazoo ends an unanswered ping (its read timeout, the
        same 2/3 of the session)."""
        return answer_within(pending, self._limit(), self._watchdog())

    def read_state(self, key: str) -> BlobState | None:
        return self._read_state(key, self.answer)

    def _read_state(self, key: str, answer: Callable[[Any], Any]) -> BlobState | None:
        self.require_zk()
        try:
            data, stat = answer(self.zk.get_async(key_path(key)))
        except NoNodeError:
            return None
        return BlobState.decode(data, stat.version)

    def read_state_synced(self, key: str) -> BlobState | None:
        """``read_state`` after a ZooKeeper ``sync``: the server this master's session is on
        may trail the one that took a write (just after a ZooKeeper restart, say), and a
        synced read sees every write committed before it."""
        self.require_zk()
        self.answer(self.zk.sync_async(key_path(key)))
        return self.read_state(key)

    def state_or_404(self, key: str) -> BlobState:
        state = self.read_state(key)
        if state is None:
            raise no_such_key(key)
        return state

    def read_state_for_write(self, key: str) -> BlobState | None:
        """:meth:`read_state` for a write (:meth:`answer_write`)."""
        return self._read_state(key, self.answer_write)

    def state_for_write_or_404(self, key: str) -> BlobState:
        state = self.read_state_for_write(key)
        if state is None:
            raise no_such_key(key)
        return state

    def states_for_commit(self, batch: Sequence[PutRequest], fresh: AbstractSet[str]
                           ) -> list[BlobState | BaseException | None]:
        """Each write's current key state (the caller holds the keys' locks), read in one
        pipelined round trip; none is read for a create of a ``fresh`` key (one this master
        knows nothing of, :meth:`Committer.nothing_here`)."""
        read = [p.key for p in batch if not (p.create and p.key in fresh)]
        states = iter(pipelined_states(self.zk, read, self.answer_write))
        return [None if p.create and p.key in fresh else next(states) for p in batch]

    def read_states(self, keys: Sequence[str]) -> list[BlobState | BaseException | None]:
        """Each key's committed state (None: no such key, or the error reading it), read in one
        pipelined round trip."""
        return pipelined_states(self.zk, keys, self.answer)

    def read_states_for_write(self, keys: Sequence[str]
                              ) -> list[BlobState | BaseException | None]:
        """:meth:`read_states` for a write (:meth:`answer_write`)."""
        return pipelined_states(self.zk, keys, self.answer_write)

    def fenced_set(self, key: str, new: BlobState, expected_meta_version: int) -> None:
        def build(txn: Any) -> None:
            txn.set_data(key_path(key), new.encode(), version=expected_meta_version)

        self.election.fenced(build)

    def fenced_delete(self, key: str, expected_meta_version: int) -> None:
        path = key_path(key)
        names = self.answer_write(self.zk.get_children_async(path))

        def build(txn: Any) -> None:
            # Replica nodes belong to other sessions; deleting them with the key in one
            # transaction keeps replicas from ever seeing a half-deleted key.
            for n in names:
                txn.delete(f"{path}/{n}")
            txn.delete(path, version=expected_meta_version)

        self.election.fenced(build)

    def resolve_unknown_commit(self, key: str, new: BlobState) -> BlobState:
        """After a commit whose answer was lost: ``new`` as committed if it applied; Unavailable
        if it did not; CommitOutcomeUnknown if ZooKeeper stays out of reach for the suspension
        limit, or past the watchdog's bound on a suspension (the writer's answer must not wait
        longer than the leadership it was made under)."""
        deadline = time.monotonic() + self._limit()
        while time.monotonic() < self._resolve_deadline(deadline):
            try:
                # Connected first: while kazoo reconnects it queues requests rather than failing
                # them, so a sync sent now could wait out the whole outage.
                self.require_zk()
                # The session may now be on a server that has not yet seen the transaction
                # (its zxid never reached this client): sync first, or a stale read would say
                # "did not apply" of a commit that did, and its only copy would be deleted.
                answer_within(self.zk.sync_async(key_path(key)),
                              max(deadline - time.monotonic(), 0.01), self._watchdog())
                after = self.read_state_for_write(key)
            except (Unavailable, KazooException, KazooTimeoutError):
                self._stopped.wait(max(min(0.2, self._resolve_deadline(deadline)
                                           - time.monotonic()), 0.0))
                continue
            if (after is not None and after.seq == new.seq and after.digest == new.digest
                    and after.epoch == new.epoch):
                return after
            if after is not None and after.seq > new.seq and any(
                    past.seq == new.seq and past.digest == new.digest
                    and past.write_tag == new.write_tag for past in after.history):
                # Applied, then superseded (by a next leader) before this read: the version
                # stays in the key's history, and this master's copy may be its only one.
                return new
            raise Unavailable(f"the commit of {key!r} did not apply (ZooKeeper hiccup); retry")
        raise CommitOutcomeUnknown(
            f"ZooKeeper is unreachable from master {self.identity} since the commit of {key!r}"
            " was sent, so its outcome is unknown: re-read the key's metadata before retrying"
            " (the client does, with the next leader)"
        )

    def _resolve_deadline(self, deadline: float) -> float:
        watchdog = self._watchdog()
        give_up = watchdog() if watchdog is not None else None
        return deadline if give_up is None else min(deadline, give_up)

    def _limit(self) -> float:
        """The election's suspension limit (2/3 of the session timeout ZooKeeper granted), or
        2/3 of the configured one for an election without it (a unit test's double)."""
        limit = getattr(self.election, "suspension_limit", None)
        return limit if isinstance(limit, float) else self.session_timeout * 2 / 3

    def _watchdog(self) -> Callable[[], float | None] | None:
        """The election's bound on a suspended connection, which ends every wait on ZooKeeper
        (:meth:`LeaderElection.give_up_at`); an election without one (a unit test's double)
        bounds waits by time alone."""
        give_up_at: Callable[[], float | None] | None = getattr(
            self.election, "give_up_at", None)
        return give_up_at

    def replication(self, key: str, state: BlobState,
                    live: AbstractSet[str] = frozenset(),
                    holding: AbstractSet[str] | None = None) -> ReplicationStatus:
        try:
            names = self.answer(self.zk.get_children_async(key_path(key)))
        except NoNodeError:
            names = []
        return replication_status(key, state, layout.holders(names, state.seq), live, holding)

    def sorted_keys(self) -> list[str]:
        """Every key, sorted; re-read only when the key list changed (ZooKeeper bumps the
        parent's cversion on every create and delete of a child), so the pages of one listing
        cost one small stat each instead of fetching and sorting 100,000s of names."""
        stat = self.answer(self.zk.exists_async(BLOBSTORE))
        cached = self._key_list
        if cached is not None and stat is not None and cached[0] == stat.cversion:
            return cached[1]
        try:
            names, stat = self.answer(self.zk.get_children_async(BLOBSTORE, include_data=True))
        except NoNodeError:
            return []
        keys = sorted(names)
        self._key_list = (stat.cversion, keys)
        return keys


def pipelined_states(zk: KazooClient, keys: Sequence[str], answer: Callable[[Any], Any]
                     ) -> list[BlobState | BaseException | None]:
    """Each key's committed state (None: no such key, or the error reading it), its reads sent
    at once and each waited for by ``answer``."""
    pending = [zk.get_async(key_path(k)) for k in keys]
    out: list[BlobState | BaseException | None] = []
    for result in pending:
        try:
            data, stat = answer(result)
            out.append(BlobState.decode(data, stat.version))
        except NoNodeError:
            out.append(None)
        except Exception as e:
            out.append(e)
    return out
