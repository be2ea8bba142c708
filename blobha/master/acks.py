"""Acknowledgements: a committed version is answered as made once W masters hold it, and
marked acknowledged in ZooKeeper first."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from kazoo.exceptions import (
    BadVersionError,
)

from blobha.core.blobstate import BlobState
from blobha.core.errors import (
    DeadlineExceeded,
    KeyNotFound,
    Unavailable,
)
from blobha.leader import Deposed
from blobha.master.metadata import Metadata
from blobha.master.rules import (
    Superseded,
)
from blobha.master.settings import MasterSettings
from blobha.master.waits import ReplicationWaits
from blobha.store.local import LocalStore
from blobha.sync import ReplicaSync
from blobha.wire.status import ReplicationStatus

log = logging.getLogger("blobha.master")


class Acknowledger:
    """Waits for a write quorum and marks versions acknowledged."""

    def __init__(self, settings: MasterSettings, store: LocalStore, meta: Metadata,
                 waits: ReplicationWaits, sync: ReplicaSync) -> None:
        self.settings = settings
        self.store = store
        self.meta = meta
        self.waits = waits
        self.sync = sync

    def acknowledge(self, key: str, committed: BlobState) -> tuple[str, BlobState, int]:
        """Answer for a committed version once W masters hold it: (key, state, holders)."""
        try:
            if committed.acked:
                # The leader, and the holders whose staged copies made the quorum at commit.
                return key, committed, 1 + len(committed.confirmed)
            try:
                reached, info = self._await_holders(key, committed, committed.write_quorum)
            except KeyNotFound:
                # A new leader's roll-back of an unacknowledged create removes the key (or a
                # delete did): the write was never acknowledged, so its retry writes it again.
                raise Unavailable(
                    f"{key!r} v{committed.seq} was removed before its write quorum (rolled back"
                    " or deleted); retry to write it again") from None
            except Superseded as e:
                # A newer version, acknowledged, replaced this one before its quorum: no
                # roll-back can reach below an acknowledged version, so this write stands in
                # the key's history, unless a roll-back already skipped it (a new leader found
                # the newer version held by no live master, and this one on none either). A
                # roll-back is a later epoch's write, and drops the tags of what it skipped:
                # the newer version in this write's epoch means none came between.
                made = e.state.epoch == committed.epoch or bool(
                    committed.write_tag and e.state.written_by(committed.write_tag))
                if not made:
                    raise Unavailable(
                        f"{key!r} v{committed.seq} was replaced before its write quorum and may"
                        " have been rolled back; re-read the metadata before writing it again"
                    ) from None
                log.info("%r v%d superseded by v%d before its write quorum; answered as made",
                         key, committed.seq, e.state.seq)
                return key, replace(committed, acked=True), 0
            if not reached:
                current = self.meta.read_state_for_write(key)
                if current is not None and current.seq > committed.seq:
                    raise DeadlineExceeded(
                        f"{key!r} v{committed.seq} was replaced by v{current.seq} before"
                        f" {committed.write_quorum} masters held it, and v{current.seq} is not"
                        " acknowledged yet either: if its leader fails first, the key rolls back"
                        " to an earlier version; its metadata shows whether it was acknowledged"
                    )
                raise DeadlineExceeded(
                    f"{key!r} v{committed.seq} is committed but only {info.replication} of the"
                    f" {committed.write_quorum} required masters hold it after"
                    f" {self.settings.write_timeout_secs}s, so it is NOT acknowledged"
                    " yet: it will be once enough masters hold it, unless its leader fails first"
                    " (then it is rolled back); its metadata shows whether it was"
                    " acknowledged, before you write it again"
                )
            return key, self.mark_acked(key, committed), info.replication
        finally:
            # Whatever the outcome, the leader's synchroniser follows the key from here: a
            # version that timed out stays committed and is acknowledged once enough masters
            # hold it (Repairs.leader_duty). Nothing else would bring a new key to it before the
            # periodic pass: the leader has no watch on a key it has not reconciled yet, and
            # does not read its own journal. A create acknowledged in its commit needs none
            # (see Synchronizer.follow).
            self.sync.follow(key, committed.seq)

    def mark_acked(self, key: str, state: BlobState) -> BlobState:
        # Under the key's lock, as every other write of the key's metadata: between a commit's
        # read of the state and its conditional write, this write made the commit fail with a
        # conflict the client had not asked for (an update without expected_version).
        with self.store.key_lock(key):
            return self._mark_acked_locked(key, state)

    def _mark_acked_locked(self, key: str, state: BlobState) -> BlobState:
        for _ in range(5):
            current = self.meta.read_state_for_write(key)
            if current is None or current.seq != state.seq or current.digest != state.digest:
                return state  # superseded or deleted meanwhile; nothing to mark
            if current.acked:
                return current
            marked = replace(current, acked=True)
            try:
                self.meta.fenced_set(key, marked, current.meta_version)
            except BadVersionError:
                continue
            except Deposed as e:
                raise Unavailable(
                    f"not the leader any more ({e}) while acknowledging {key!r} v{state.seq};"
                    " it is committed but unacknowledged: re-read the metadata and retry if"
                    " needed"
                ) from None
            return replace(marked, meta_version=current.meta_version + 1)
        # Never answer success for a version ZooKeeper does not record as acknowledged: a later
        # leader could roll it back. The client re-reads and, finding it unacknowledged,
        # uploads again.
        raise Unavailable(f"{key!r} v{state.seq} is committed but could not be marked"
                          " acknowledged (the key kept changing); retry")

    def _await_holders(self, key: str, state: BlobState, minimum: int
                       ) -> tuple[bool, ReplicationStatus]:
        deadline = time.monotonic() + self.settings.write_timeout_secs
        reached, infos = self.waits.wait(
            [key], minimum, deadline, seq_of={key: state.seq}, require_leader=True
        )
        return reached, infos[0]
