"""A read that carries the client's minimum is never answered older, whatever ZooKeeper's
server says: behind before a sync, it is read again after one; still behind after it (a
server that lost or skipped the change), the read is refused as Stale and the client asks
another master."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.client import KazooState
from support.masterparts import Node

from blobha.core.blobstate import BlobState
from blobha.core.consistency import DELETED, MinVersion, View
from blobha.core.errors import Stale

CREATED = 1_700_000_000.25


def _state(seq: int) -> BlobState:
    return BlobState(seq=seq, size=1, digest=f"{seq:032x}", acl=(), replication_factor=3,
                     creator="alice", created_at=CREATED, updated_at=CREATED, epoch=1,
                     acked=True)


class _Server:
    """One master's ZooKeeper server: ``before`` is the key's state until a ``sync``,
    ``after`` once one was made."""

    state = KazooState.CONNECTED

    def __init__(self, before: int, after: int) -> None:
        self.before = before
        self.after = after
        self.syncs = 0

    def fenced_results(self, build: Any, changed: Any = ()) -> list[object]:
        raise AssertionError("a read commits nothing")

    def sync_async(self, path: str) -> Any:
        self.syncs += 1
        return SimpleNamespace(get=lambda timeout=None: path)

    def get_async(self, path: str) -> Any:
        seq = self.after if self.syncs else self.before
        return SimpleNamespace(get=lambda timeout=None: (_state(seq).encode(),
                                                         SimpleNamespace(version=seq)))


@pytest.mark.parametrize("view", [View.SESSION, View.LINEARIZABLE],
                         ids=["session", "linearizable"])
def test_a_server_still_behind_after_a_sync_is_refused_as_stale(tmp_path: Path,
                                                                view: View) -> None:
    server = _Server(before=343, after=343)
    m = Node(tmp_path, server)
    with pytest.raises(Stale, match=r"shows v343 of 'k' even after a sync, older than what"
                                    r" this client has seen \(v346\); retry at another master"):
        m.reads.state_for_read("k", MinVersion(346, CREATED), view)
    assert server.syncs == 1


def test_a_server_behind_until_a_sync_serves_what_the_sync_shows(tmp_path: Path) -> None:
    server = _Server(before=343, after=346)
    m = Node(tmp_path, server)
    state, _ = m.reads.state_for_read("k", MinVersion(346, CREATED))
    assert (state.seq, server.syncs) == (346, 1)


def test_a_deleted_incarnation_shown_after_a_sync_is_refused(tmp_path: Path) -> None:
    m = Node(tmp_path, _Server(before=5, after=5))
    with pytest.raises(Stale, match=r"older than what this client has seen \(the key deleted\)"):
        m.reads.state_for_read("k", MinVersion(DELETED, CREATED))


def test_a_minimum_met_is_served_without_a_sync(tmp_path: Path) -> None:
    server = _Server(before=346, after=346)
    m = Node(tmp_path, server)
    assert m.reads.state_for_read("k", MinVersion(345, CREATED))[0].seq == 346
    assert m.reads.state_for_read("k", MinVersion(346, CREATED))[0].seq == 346
    # Created again since the client's incarnation: newer whatever its version.
    assert m.reads.state_for_read("k", MinVersion(900, CREATED - 1))[0].seq == 346
    assert server.syncs == 0
