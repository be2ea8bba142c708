"""The synchroniser and the master it runs in, each as the other sees it: what the synchroniser
needs of the master (the leader's duties, the cluster guard), and what the master's parts need
of the synchroniser (:class:`ReplicaSync`).

Defined here, below the master (blobha.master implements the first two and uses the third:
sync never imports it). The master's parts depend on :class:`ReplicaSync`, not on the concrete
:class:`blobha.sync.Synchronizer`, which only the master's facade builds and runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from blobha.core.blobstate import BlobState
from blobha.sync.view import KeyView


class LeaderDuties(Protocol):
    """What the synchroniser asks of the leader, for a key it reconciles while leading."""

    def leader_duty(self, key: str, view: KeyView) -> bool:
        """Leader-only upkeep of one key (acknowledge a version enough masters hold, or roll
        back one no live master holds); True if it changed the key's committed state."""
        ...


class ClusterGuard(Protocol):
    """Whether and when this master may act: leadership, deletions, the per-key lock."""

    def is_leader(self) -> bool:
        """Whether this master leads now (asked again before each decision)."""
        ...

    def deletions_allowed(self) -> bool:
        """Whether ZooKeeper still holds this store's cluster, asked just before every local
        delete (ha-rule 10: a wiped or foreign ZooKeeper must not read as "every key was
        deleted")."""
        ...

    def key_lock(self, key: str) -> AbstractContextManager[object]:
        """The lock the commit path holds from install to commit of ``key``."""
        ...


class LiveMasters(Protocol):
    """The masters alive now, and those whose replica nodes count (blobha.sync.Membership)."""

    def live(self) -> set[str]: ...
    def holding(self) -> frozenset[str]: ...


class QueueFigures(Protocol):
    """The work queue's figures, for the status page (blobha.sync.WorkQueue)."""

    def depth(self) -> int: ...
    @property
    def batches(self) -> int: ...
    @property
    def batched_keys(self) -> int: ...


class ReplicaSync(Protocol):
    """What the master's parts ask of the synchroniser (blobha.sync.Synchronizer): the replica
    view and its figures, a key to look at, and the bookkeeping of the leader's commits."""

    # ---- the replica view and its figures (reads, status, summary, the commit path) -------

    def view(self, key: str) -> KeyView | None:
        """What this master last read of ``key`` (None: nothing)."""
        ...

    def views(self) -> dict[str, KeyView]:
        """Every key's view (the status page)."""
        ...

    def figures(self) -> tuple[int, int, int]:
        """(keys, keys with fewer holders than their replication factor, keys this master
        should hold but lacks)."""
        ...

    def keys_behind(self) -> tuple[int, int]:
        """Keys whose view awaits a read of an announced change, and of those, the keys not
        read since the latest reconnect."""
        ...

    @property
    def queue(self) -> QueueFigures: ...

    @property
    def membership(self) -> LiveMasters: ...

    # ---- keys to look at ---------------------------------------------------------------------

    def schedule(self, key: str) -> None:
        """Reconcile ``key`` soon (admin, repairs)."""
        ...

    # ---- the leader's commits (the committer, the acknowledgements) -------------------------

    def session_id(self) -> int:
        """The current ZooKeeper session's id (0 when there is none)."""
        ...

    def creating(self, keys: list[str]) -> None:
        """``keys`` are about to be created by this master's commit (see
        ReplicaRegistry.creating); :meth:`created` follows, whatever the outcome."""
        ...

    def created(self, keys: list[str]) -> None:
        """The commit announced by :meth:`creating` is over."""
        ...

    def registered(self, key: str, seq: int, session: int, replication_factor: int,
                   state: BlobState | None = None, record: bytes = b"") -> None:
        """The leader's commit created our replica node of ``seq`` in ``session``."""
        ...

    def follow(self, key: str, seq: int) -> None:
        """After this master's commit of ``seq``: reconcile ``key`` where it needs it."""
        ...


__all__ = ["ClusterGuard", "LeaderDuties", "LiveMasters", "QueueFigures", "ReplicaSync"]
