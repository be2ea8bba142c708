"""Upload sessions on the leader across ZooKeeper trouble and lost leadership: a commit that
could not reach ZooKeeper keeps its data for the retry, and no session outlives the term it
was begun in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.client import KazooState
from kazoo.exceptions import ConnectionLoss, NoNodeError
from support.masterparts import Node

from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    InvalidArgument,
    NotAuthorized,
    ResourceExhausted,
    Unavailable,
    UploadNotFound,
)
from blobha.master.uploads import UploadManager
from blobha.store.local import LocalStore

MiB = 1024 * 1024


def _master(tmp_path: Path, zk: Any) -> Node:
    election = SimpleNamespace(is_leader=True, epoch=3, leader_address="m1:6627",
                               fenced_results=None)
    zk.fenced_results = None
    m = Node(tmp_path, zk, uploads=None, replication_factor=1, write_quorum=1,
             sync=SimpleNamespace(view=lambda key: None, stepped_down=lambda: None))
    m.election.__dict__.update(election.__dict__)
    uploads = UploadManager(m.store, 600)
    m.uploads = m.committer.uploads = m.writes.uploads = uploads
    return m


def _temp_files(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "store" / "tmp").iterdir())


def _answering(read: Callable[[str], Any]) -> Callable[[str], Any]:
    """A ZooKeeper read made asynchronously (as the master makes it), answered by ``read``."""
    return lambda path: SimpleNamespace(get=lambda timeout=None: read(path))

def test_a_commit_that_cannot_read_zookeeper_keeps_the_upload_for_its_retry(
        tmp_path: Path) -> None:
    # The commit reads the key's state first. A dropped connection there was answered "retry
    # shortly", but the session and its data were gone: the retry found no upload, a file was
    # sent again from its first byte, and an upload from a pipe failed.
    zk: Any = SimpleNamespace(state=KazooState.CONNECTED)

    def unreachable(path: str) -> Any:
        raise ConnectionLoss()

    zk.get_async = _answering(unreachable)
    m = _master(tmp_path, zk)
    data = b"x" * (3 * MiB)
    up = m.uploads.begin("alice", "k", False, [], 1, 0, 1)
    m.writes.append("alice", up.upload_id, 0, data)
    with pytest.raises(ConnectionLoss):
        m.writes.commit("alice", up.upload_id, len(data), digest_bytes(data))
    assert m.writes.upload_status("alice", up.upload_id) == len(data)
    assert m.store.versions("k") == []
    # A refusal that retrying cannot change still ends the session and its data.
    state = BlobState(seq=1, size=1, digest="0" * 32, acl=(), replication_factor=1,
                      creator="bob", created_at=1.0, updated_at=1.0, epoch=3, acked=True)
    zk.get_async = _answering(lambda path: (state.encode(), SimpleNamespace(version=0)))
    with pytest.raises(NotAuthorized):
        m.writes.commit("alice", up.upload_id, len(data), digest_bytes(data))
    with pytest.raises(UploadNotFound):
        m.writes.upload_status("alice", up.upload_id)
    assert _temp_files(tmp_path) == []


def test_a_session_begun_while_leadership_is_lost_does_not_outlive_it(tmp_path: Path) -> None:
    # BeginUpload checks leadership, reads the key, then opens the session. Deposed in between,
    # the abort of every session came first and this one stayed on the follower, with its
    # open file, taking data until it expired (10 minutes).
    m: Any = None

    def deposed_during_the_read(path: str) -> Any:
        # What the master does when deposed (Master._on_deposed).
        m.election.is_leader = False
        m.uploads.abort_all("this master is no longer the leader")
        raise NoNodeError()

    m = _master(tmp_path, SimpleNamespace(state=KazooState.CONNECTED,
                                          get_async=_answering(deposed_during_the_read)))
    with pytest.raises(Unavailable, match="stopped leading"):
        m.writes.begin_upload("alice", "k", True, [], 0, 0, -1, 0)
    assert m.uploads.count() == 0
    assert _temp_files(tmp_path) == []


def test_a_session_given_back_after_every_session_was_aborted_is_discarded(
        tmp_path: Path) -> None:
    uploads = UploadManager(LocalStore(tmp_path / "store"), 600)
    up = uploads.begin("alice", "k", True, [], 1, 0, 1)
    generation = uploads.generation
    taken = uploads.take(up.upload_id, "alice")
    uploads.abort_all("this master is no longer the leader")
    assert not uploads.restore(taken, generation)
    assert uploads.count() == 0 and _temp_files(tmp_path) == []


def test_a_user_holds_at_most_the_configured_number_of_unfinished_uploads(
        tmp_path: Path) -> None:
    uploads = UploadManager(LocalStore(tmp_path / "store"), 600, max_per_user=3)
    mine = [uploads.begin("alice", f"k{i}", True, [], 1, 0, 1) for i in range(3)]
    made: list[str] = []
    new_temp = uploads.store.new_temp
    uploads.store.new_temp = lambda label: made.append(label) or new_temp(label)  # type: ignore[method-assign]
    with pytest.raises(ResourceExhausted, match="3 unfinished uploads"):
        uploads.begin("alice", "k3", True, [], 1, 0, 1)
    assert made == []  # refused before any file was made (a loop past the limit makes none)
    # Nothing is left of the refused one, and other users are not held back by alice.
    assert uploads.count() == 3 and len(_temp_files(tmp_path)) == 3
    uploads.begin("bob", "b", True, [], 1, 0, 1)
    # A finished session makes room again.
    uploads.abort(mine[0].upload_id, "alice")
    uploads.begin("alice", "k3", True, [], 1, 0, 1)
    assert uploads.count() == 4
    uploads.abort_all("done")


def test_an_append_leaving_a_gap_is_refused_as_such_not_as_an_unknown_upload(
        tmp_path: Path) -> None:
    # The store refuses a gap with InvalidArgument, which is a ValueError too: the append's
    # own ValueError (a file discarded under it) must not take it for an expired upload.
    m = _master(tmp_path, SimpleNamespace(state=KazooState.CONNECTED))
    up = m.uploads.begin("alice", "k", False, [], 1, 0, 1)
    m.writes.append("alice", up.upload_id, 0, b"abc")
    with pytest.raises(InvalidArgument, match="gap"):
        m.writes.append("alice", up.upload_id, 10, b"def")
    assert m.writes.upload_status("alice", up.upload_id) == 3
