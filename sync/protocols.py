"""What the synchroniser needs of the master it runs in: the leader's duties and the cluster guard.

Defined here, below the master (blobha.master implements them: sync never imports it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

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


__all__ = ["ClusterGuard", "LeaderDuties"]
