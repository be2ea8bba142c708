"""Rotating the cluster secret, the masters' proof of identity to each other: the leader
writes a new one in a fenced transaction, and every master learns of it through its watch
(blobha.master.cluster), still accepting the old one for a while."""

from __future__ import annotations

import logging
from typing import Any

from kazoo.client import KazooClient

from blobha.core.auth import new_cluster_secret
from blobha.core.errors import NotAuthorized, Unavailable
from blobha.leader import Deposed, LeaderElection
from blobha.master.metadata import Metadata
from blobha.master.rules import Authority
from blobha.zk.layout import MASTER_SECRET

__all__ = ["SecretRotation"]

log = logging.getLogger("blobha.master")


class SecretRotation:
    def __init__(self, zk: KazooClient, election: LeaderElection, meta: Metadata,
                 authority: Authority) -> None:
        self.zk = zk
        self.election = election
        self.meta = meta
        self.authority = authority

    def rotate(self, user: str) -> int:
        """A new cluster secret, by an admin; the generation of the secret (its znode's
        version)."""
        if not self.authority.privileged(user):
            raise NotAuthorized(f"user {user!r} may not rotate the cluster secret; only the"
                                " cluster's admins (the masters' 'admins' setting) may")
        self.meta.require_leader()
        secret = new_cluster_secret().encode()

        def build(txn: Any) -> None:
            txn.set_data(MASTER_SECRET, secret)

        try:
            stat = self.election.fenced(build)[0]
        except Deposed as e:
            raise Unavailable(f"not the leader any more ({e}); the secret was not rotated,"
                              " retry (the client finds the new leader)") from None
        log.warning("the cluster secret was rotated by %r (generation %d)", user, stat.version)
        return int(stat.version)
