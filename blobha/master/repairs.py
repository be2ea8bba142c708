"""The leader's repairs: acknowledging versions that reached their quorum late, and rolling back
ones an earlier leader committed that no live master holds."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from blobha.core.blobstate import BlobState, PastVersion
from blobha.core.errors import (
    BlobError,
    ChecksumMismatch,
)
from blobha.leader import LeaderElection
from blobha.master.acks import Acknowledger
from blobha.master.metadata import Metadata
from blobha.master.settings import MasterSettings
from blobha.store.local import LocalStore, VersionInfo
from blobha.sync import KeyView, Membership, ReplicaSync
from blobha.wire.peers import Peers
from blobha.zk.connection import UNREACHABLE

log = logging.getLogger("blobha.master")


#: A roll-back's fetch of a past version from one peer: this long, plus a second per
#: ROLLBACK_MIN_RATE bytes (a fixed minute never restored a large version over TLS). A peer
#: that stops sending is left sooner, at the fetch's stall limit.
ROLLBACK_FETCH_SECS = 60.0
ROLLBACK_MIN_RATE = 8 * 1024 * 1024


class Repairs:
    """Leader-only upkeep of keys, asked for by the synchroniser."""

    def __init__(self, settings: MasterSettings, identity: str, store: LocalStore,
                 election: LeaderElection, meta: Metadata, acks: Acknowledger,
                 membership: Membership, peers: Peers, sync: ReplicaSync) -> None:
        self.settings = settings
        self.identity = identity
        self.store = store
        self.election = election
        self.meta = meta
        self.acks = acks
        self.membership = membership
        self.peers = peers
        self.sync = sync

    def leader_duty(self, key: str, view: KeyView) -> bool:
        """Leader-only upkeep of one key; True if it changed the key's committed state."""
        state = view.state
        holders = view.holders
        if state.acked:
            return False
        if holders and len(holders) >= state.write_quorum:
            self.acks.mark_acked(key, state)
            return True
        if not holders and state.epoch != self.election.epoch:
            # Committed by an earlier leader, which died before anyone copied it.
            return self._roll_back(key, state)
        return False

    def _roll_back(self, key: str, state: BlobState) -> bool:
        """A version committed by an earlier leader, never acknowledged, held by no live master:
        return the key to the newest version still available, so it never stays unreadable."""
        with self.store.key_lock(key):
            for past in state.history:
                source = self._obtain(key, past)
                if source is None:
                    continue
                new = state.with_new_version(
                    state.seq + 1, past.size, past.digest, time.time(), self.election.epoch,
                    state.write_quorum, self.settings.versions_retained,
                    undone=True,
                )
                # Every version between the one restored and the one undone was skipped, held
                # by nobody: undone too, so a retry of their writes writes them again.
                new = replace(new, acked=True, history=tuple(
                    replace(h, write_tag="") if h.seq > past.seq else h for h in new.history))
                self.store.install_copy(key, new.seq, source)
                try:
                    self.meta.fenced_set(key, new, state.meta_version)
                except BaseException as e:
                    # Unanswered, it may have applied: then this copy is the restored
                    # version's only one (the synchroniser registers it once a session is
                    # back, or removes it as debris once the key shows it never applied).
                    if not isinstance(e, UNREACHABLE):
                        self.store.delete_version(key, new.seq)
                    raise
                log.warning("ROLL-BACK: %r v%d was never acknowledged and no live master holds"
                            " it; restored the content of v%d as v%d", key, state.seq, past.seq,
                            new.seq)
                self.sync.schedule(key)
                return True
            if state.seq == 1 or not state.history:
                self.meta.fenced_delete(key, state.meta_version)
                log.warning("ROLL-BACK: the create of %r was never acknowledged and no live master"
                            " holds it; removed the key", key)
                return True
        log.error("%r v%d is unacknowledged, unheld and no earlier version is available", key,
                  state.seq)
        return False

    def _obtain(self, key: str, past: PastVersion) -> VersionInfo | None:
        local = self.store.find_by_digest(key, past.digest, past.size)
        if local is not None:
            return local
        self.store.reserve(past.size)
        timeout = ROLLBACK_FETCH_SECS + past.size / ROLLBACK_MIN_RATE
        temp = self.store.new_temp("rollback")
        try:
            for address in self.peers.rank(self.membership.live() - {self.identity}):
                try:
                    self.peers.fetch(address, key, past.seq, past.digest, temp, timeout)
                except BlobError as e:
                    # What arrived stays: the next peer's fetch resumes from there.
                    log.info("roll-back of %r: fetching v%d from %s failed: %s", key, past.seq,
                             address, e)
                    continue
                try:
                    return self.store.install(key, past.seq, temp, past.size, past.digest)
                except ChecksumMismatch:
                    temp = self.store.new_temp("rollback")  # install removed the bad bytes
            return None
        finally:
            # Whatever ended the loop, no temporary file outlives it (after an install, its
            # name is gone already).
            temp.discard()
