"""Builders of the synchroniser's replica-event tests (tests/unit/sync/test_sync_replica_*.py):
a Synchronizer over the fake ZooKeeper of tests/support/sync_fakes.py, view entries, and a key
just committed."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from kazoo.protocol.states import KazooState, WatchedEvent

from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.sync.feed import Wake
from blobha.sync.loop import SyncLoop
from blobha.sync.synchronizer import Synchronizer
from blobha.sync.view import Entry, ReplicaView, holders_of
from blobha.sync.workqueue import WorkQueue
from support.sync_fakes import (
    ME,
    SESSION,
    A,
    B,
    FakeZk,
    Guard,
    NoDuties,
    settings,
)


def synchroniser(leader: bool | list[bool] = False, store: Any = None, recursive: bool = False,
                 ours: Any = True, key_lock: Any = None, membership: Any = None,
                 **changes: Any) -> tuple[Synchronizer, FakeZk]:
    """``leader`` as a one-element list can be changed while the synchroniser runs;
    ``recursive``: following /blobstore with the recursive watch; ``ours``: ZooKeeper holds
    this store's cluster (deletions allowed), or a function that tells; ``key_lock``: the
    store's per-key lock; ``changes``: other settings."""
    zk = FakeZk()
    leading = leader if isinstance(leader, list) else [leader]
    s = Synchronizer(
        zk, store=store or SimpleNamespace(), identity=ME, peers=SimpleNamespace(),  # type: ignore[arg-type]
        membership=membership or SimpleNamespace(known=lambda: {ME, A, B}, live=lambda: {ME, A, B},
                                               holding=lambda: frozenset({ME, A, B})),
        settings=settings(recursive, **changes),
        duties=NoDuties(), guard=Guard(leading, ours, key_lock),
    )
    return s, zk


def entry(holders: list[str], registered: int = SESSION, acked: bool = True) -> Entry:
    return Entry(b"", 0, 5, 3, acked, holders_of([f"{h}-5" for h in holders], 5), registered)


def names(*holders: str) -> list[str]:
    return [f"{h}-5" for h in holders]


class Intake:
    """The change feed as the periodic thread sees it (blobha.sync.loop.Intake)."""

    def __init__(self, all_keys: Any, recursive: bool = False, watch_tree: Any = None) -> None:
        self.all_keys = all_keys
        self.recursive = recursive
        self.watch_tree = watch_tree or (lambda: None)

    def recheck_replicas(self, keys: list[str]) -> None:
        pass

    def check_own_nodes(self, stopping: threading.Event) -> tuple[int, int]:
        return 0, 0


def periodic_loop(period_secs: float, feed: Intake, zk: Any = None,
                  wake: Wake | None = None) -> SyncLoop:
    """A loop whose periodic thread can run: connected, alone, registered already."""
    membership = SimpleNamespace(next_grace_expiry=lambda: None, refresh=lambda: None,
                                 known=lambda: {ME}, take_departed=set,
                                 holding=lambda: frozenset({ME}))
    return SyncLoop(
        zk or SimpleNamespace(state=KazooState.CONNECTED, client_id=(SESSION, b"")),
        membership, settings(period_secs=period_secs), WorkQueue(),  # type: ignore[arg-type]
        ReplicaView(ME, membership), feed, SimpleNamespace(handle=lambda keys: {}),  # type: ignore[arg-type]
        wake or Wake(), session=SESSION)


def committed(key: str = "new", rf: int = 3, recursive: bool = False
              ) -> tuple[Synchronizer, FakeZk, BlobState]:
    """A leader that just committed v1 of ``key`` (its own copy registered by the commit), and
    a ZooKeeper that answers the reconcile's reads of it."""
    data = b"fresh"
    state = BlobState(seq=1, size=len(data), digest=digest_bytes(data), acl=(),
                      replication_factor=rf, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    store = SimpleNamespace(
        info=lambda k, seq: SimpleNamespace(digest=state.digest, size=state.size),
        versions=lambda k: [1], has_version=lambda k, seq: True)
    s, zk = synchroniser(leader=True, store=store, recursive=recursive)
    zk.data[f"/blobstore/{key}"] = (state.encode(), SimpleNamespace(version=0))
    zk.listed[f"/blobstore/{key}"] = [f"{ME}-1"]
    s.registered(key, 1, SESSION, rf)
    return s, zk, state


def tree_event(kind: str, path: str) -> WatchedEvent:
    return WatchedEvent(kind, KazooState.CONNECTED, path)
