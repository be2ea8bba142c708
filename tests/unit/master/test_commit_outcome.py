"""A commit whose answer ZooKeeper never gave (ConnectionLoss): the leader keeps its copy
unless it knows the commit did not apply, since with W=1 an applied commit is already
acknowledged in ZooKeeper and that copy is its only one."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.client import KazooState
from kazoo.exceptions import ConnectionLoss, NoNodeError, SessionMovedError
from kazoo.handlers.threading import KazooTimeoutError
from support.masterparts import Node

from blobha.core.acl import READ, AccessControl
from blobha.core.blobstate import BlobState, PastVersion, write_tag
from blobha.core.digest import digest_bytes
from blobha.core.errors import Unavailable
from blobha.master.groupcommit import GroupCommitter
from blobha.master.repairs import ROLLBACK_MIN_RATE
from blobha.master.rules import CommitOutcomeUnknown, PutRequest
from blobha.sync import KeyView
from blobha.zk.layout import MAX_STATE_BYTES


class _Txn:
    def __init__(self) -> None:
        self.ops: list[tuple[str, bytes]] = []

    def create(self, path: str, data: bytes = b"", ephemeral: bool = False) -> None:
        self.ops.append((path, data))

    def set_data(self, path: str, data: bytes, version: int = -1) -> None:
        self.ops.append((path, data))


class _Ensemble:
    """ZooKeeper as one master's session sees it after a lost answer: ``applied`` says whether
    the transaction applied; until ``sync`` is called the session's server may not have seen
    it yet (``lagging``); ``reachable`` says whether any read gets through."""

    def __init__(self, applied: bool, reachable: bool, lagging: bool = False,
                 superseded: bool = False) -> None:
        self.applied = applied
        self.lagging = lagging
        #: A newer version was committed (by a next leader) before the read-back.
        self.superseded = superseded
        self.state = KazooState.CONNECTED if reachable else KazooState.SUSPENDED
        self.data: dict[str, bytes] = {}
        self.synced = False

    def fenced_results(self, build: Any, changed: Any = ()) -> list[object]:
        txn = _Txn()
        build(txn)
        if self.applied:
            self.data.update(txn.ops)
            if self.superseded:
                state = BlobState.decode(self.data["/blobstore/k"])
                newer = state.with_new_version(state.seq + 1, 5, digest_bytes(b"newer"), 1.0,
                                               state.epoch + 1, 1, 2)
                self.data["/blobstore/k"] = newer.encode()
        raise ConnectionLoss()

    def sync_async(self, path: str) -> Any:
        # Only ever sent while connected (a sync queued while kazoo reconnects could wait out
        # the whole outage).
        assert self.state == KazooState.CONNECTED, "sync sent while not connected"
        self.synced = True
        return SimpleNamespace(get=lambda timeout=None: path)

    def get_async(self, path: str) -> Any:
        def answer(timeout: float | None = None) -> tuple[bytes, Any]:
            if path not in self.data or (self.lagging and not self.synced):
                raise NoNodeError()
            return self.data[path], SimpleNamespace(version=0)
        return SimpleNamespace(get=answer)


def _put(data: bytes) -> PutRequest:
    return PutRequest("alice", "k", True, (), 1, 1, 0, data, digest_bytes(data))


def test_an_applied_commit_whose_outcome_stays_unknown_keeps_the_only_copy(
    tmp_path: Path,
) -> None:
    zk = _Ensemble(applied=True, reachable=False)
    m = Node(tmp_path, zk)
    [result] = m.committer.commit_puts([_put(b"precious")])
    assert isinstance(result, CommitOutcomeUnknown) and "outcome is unknown" in str(result)
    assert isinstance(result, Unavailable)  # the client's status: UNAVAILABLE, then re-read
    committed = BlobState.decode(zk.data["/blobstore/k"])
    assert committed.acked and committed.seq == 1
    # The version ZooKeeper calls acknowledged is still on disk, for the synchroniser to
    # register again once a session is back.
    assert m.store.versions("k") == [1]


def test_a_commit_read_back_after_a_sync_is_known_to_have_applied(tmp_path: Path) -> None:
    # The session moved to a server that had not seen the transaction: read without a sync
    # first, it looked as if the commit did not apply, and the only copy was deleted.
    zk = _Ensemble(applied=True, reachable=True, lagging=True)
    m = Node(tmp_path, zk)
    [result] = m.committer.commit_puts([_put(b"precious")])
    assert isinstance(result, BlobState) and result.seq == 1, result
    assert zk.synced
    assert m.store.versions("k") == [1]


def test_an_applied_commit_superseded_before_the_read_back_keeps_its_copy(
        tmp_path: Path) -> None:
    # The next leader committed v2 over the applied v1 before this master read the key back:
    # v1 was taken for "did not apply" and its copy deleted, though ZooKeeper keeps it (as
    # acknowledged, W=1) in the key's history for roll-back.
    zk = _Ensemble(applied=True, reachable=True, superseded=True)
    m = Node(tmp_path, zk)
    [result] = m.committer.commit_puts([_put(b"precious")])
    assert isinstance(result, BlobState) and result.seq == 1, result
    assert BlobState.decode(zk.data["/blobstore/k"]).history[0].seq == 1
    assert m.store.versions("k") == [1]


def test_a_commit_known_not_to_have_applied_leaves_nothing_behind(tmp_path: Path) -> None:
    zk = _Ensemble(applied=False, reachable=True)
    m = Node(tmp_path, zk)
    [result] = m.committer.commit_puts([_put(b"never committed")])
    assert isinstance(result, Unavailable) and not isinstance(result, CommitOutcomeUnknown)
    assert "did not apply" in str(result)
    assert m.store.versions("k") == []


@pytest.mark.parametrize(("applied", "reachable", "kept"),
                         [(True, False, True), (False, True, False)])
def test_the_streamed_upload_commit_decides_the_same_way(
    tmp_path: Path, applied: bool, reachable: bool, kept: bool,
) -> None:
    zk = _Ensemble(applied=applied, reachable=reachable)
    data = b"streamed"
    upload: Any = SimpleNamespace(key="k", forward=None, lock=threading.Lock(), create=True, acl=(),
                                  replication_factor=1, write_quorum=1, expected_version=0,
                                  write_tag="")
    m = Node(tmp_path, zk, uploads=SimpleNamespace(take=lambda upload_id, user: upload,
                                                    generation=0))
    upload.temp = m.store.new_temp("up")
    upload.temp.write_at(0, data)
    with pytest.raises(Unavailable) as e:
        m.writes.commit("alice", "u1", len(data), digest_bytes(data))
    assert isinstance(e.value, CommitOutcomeUnknown) == kept
    assert m.store.versions("k") == ([1] if kept else [])


def test_a_roll_back_drops_the_tags_of_every_version_it_skipped(tmp_path: Path) -> None:
    # v5 acknowledged; alice's v6 (W=2) was superseded by bob's v7 before any follower copied
    # it; their leader died. The next leader rolls back to v5, skipping v6 and v7: a retry of
    # either write must then write it again, not be told "made" from the history's tag.
    m = Node(tmp_path, _Ensemble(applied=True, reachable=True),
              membership=SimpleNamespace(live=lambda: {"m1:6627"},
                                         holding=lambda: frozenset({"m1:6627"})),
              peers=SimpleNamespace(rank=list))
    written: dict[str, BlobState] = {}
    m.meta.fenced_set = lambda key, new, version: written.__setitem__(key, new)  # type: ignore[method-assign]
    v5 = b"five"
    m.store.install_many([("k", 5, v5, len(v5), digest_bytes(v5))])
    alice, bob = write_tag("alice", b"a"), write_tag("bob", b"b")
    state = BlobState(seq=5, size=len(v5), digest=digest_bytes(v5), acl=(), replication_factor=3,
                      creator="alice", created_at=0.0, updated_at=0.0, epoch=1, acked=True,
                      write_quorum=2)
    state = state.with_new_version(6, 3, "6" * 32, 1.0, 1, 2, 3, alice)
    state = state.with_new_version(7, 3, "7" * 32, 2.0, 1, 2, 3, bob)
    assert state.written_by(alice) is not None  # before the roll-back: v6 is in the history
    assert m.repairs._roll_back("k", state)
    restored = written["k"]
    assert (restored.seq, restored.digest, restored.acked) == (8, digest_bytes(v5), True)
    assert restored.written_by(alice) is None and restored.written_by(bob) is None


def _rollback_master(tmp_path: Path, fetch: Any) -> Node:
    return Node(tmp_path, _Ensemble(applied=True, reachable=True),
                 membership=SimpleNamespace(
                     live=lambda: {"m1:6627", "m2:6627", "m3:6627"},
                     holding=lambda: frozenset({"m1:6627", "m2:6627", "m3:6627"})),
                 peers=SimpleNamespace(rank=sorted, fetch=fetch))


def test_a_roll_back_fetch_resumes_on_the_next_peer_and_leaves_no_temporary_file(
        tmp_path: Path) -> None:
    data = b"0123456789" * 1000
    past = PastVersion(4, len(data), digest_bytes(data))
    calls: list[tuple[str, int, float]] = []

    def fetch(address: str, key: str, seq: int, digest: str, dest: Any, timeout: float) -> None:
        calls.append((address, dest.size, timeout))
        if address == "m2:6627":  # half of it, then the peer goes away
            dest.write_at(0, data[:4000])
            raise Unavailable("m2 went away")
        dest.write_at(dest.size, data[dest.size:])

    m = _rollback_master(tmp_path, fetch)
    info = m.repairs._obtain("k", past)
    assert info is not None and b"".join(m.store.read("k", 4)) == data
    assert [(a, size) for a, size, _ in calls] == [("m2:6627", 0), ("m3:6627", 4000)]
    assert list(m.store.tmp_dir.iterdir()) == []
    # A large version gets time in proportion to its size, beyond the fixed minute.
    big = PastVersion(5, 10 * 1024**3, "0" * 32)
    m.store.reserve = lambda nbytes: None  # type: ignore[method-assign]  # no 10 GiB on the test's disk: not fetched

    def unreachable(address: str, key: str, seq: int, digest: str, dest: Any,
                    timeout: float) -> None:
        calls.append((address, dest.size, timeout))
        raise Unavailable("gone")

    m.peers.fetch = unreachable
    assert m.repairs._obtain("k", big) is None
    assert calls[-1][2] >= 10 * 1024**3 / ROLLBACK_MIN_RATE


def test_a_roll_back_fetch_that_fails_unexpectedly_leaves_no_temporary_file(
        tmp_path: Path) -> None:
    def fetch(address: str, key: str, seq: int, digest: str, dest: Any, timeout: float) -> None:
        dest.write_at(0, b"partial")
        raise RuntimeError("a bug, or an OSError of the disk")

    m = _rollback_master(tmp_path, fetch)
    with pytest.raises(RuntimeError):
        m.repairs._obtain("k", PastVersion(4, 100, "0" * 32))
    assert list(m.store.tmp_dir.iterdir()) == []


def test_a_put_to_a_key_busy_elsewhere_does_not_hold_up_the_others(tmp_path: Path) -> None:
    # The committing thread waited for every key's lock in turn: one key held by a roll-back's
    # fetch or a large upload's commit held up the writes of every other key as long.
    m = Node(tmp_path, _Ensemble(applied=True, reachable=True), write_timeout_secs=30)

    def put(key: str) -> PutRequest:
        return PutRequest("alice", key, True, (), 1, 1, 0, key.encode(), digest_bytes(key.encode()))

    committer = GroupCommitter(m.committer.commit_puts, key=lambda p: p.key)
    busy = m.store.key_lock("busy")
    busy.acquire()
    try:
        waiting = committer.submit_async(put("busy"))
        assert committer.submit_async(put("free")).result(timeout=20).seq == 1
        assert not waiting.done()
    finally:
        busy.release()
    try:
        assert waiting.result(timeout=20).seq == 1  # committed once its key was free
        assert m.store.versions("busy") == [1] and m.store.versions("free") == [1]
    finally:
        committer.close(timeout=20)


@pytest.mark.parametrize("failure", [KazooTimeoutError(), SessionMovedError(), ConnectionLoss()])
def test_a_read_while_zookeeper_is_out_of_reach_serves_the_last_committed_state(
        tmp_path: Path, failure: Exception) -> None:
    # A request given up unanswered (KazooTimeoutError) is ZooKeeper out of reach as much as a
    # lost connection: it failed the read instead of serving the state this master last saw.
    state = BlobState(seq=2, size=1, digest="2" * 32, acl=(), replication_factor=3,
                      creator="alice", created_at=0.0, updated_at=0.0, epoch=1, acked=True)
    view = KeyView(state, ("m1:6627", "m2:6627"))
    m = Node(tmp_path, _Ensemble(applied=True, reachable=True),
              sync=SimpleNamespace(view=lambda key: view))

    def unreachable(key: str) -> BlobState:
        raise failure

    m.meta.state_or_404 = unreachable  # type: ignore[method-assign]
    assert m.reads.state_for_read("k") == (state, view)


@pytest.mark.parametrize(("failure", "kept"), [
    (ConnectionLoss(), True), (KazooTimeoutError(), True), (NoNodeError(), False)])
def test_a_roll_back_whose_commit_went_unanswered_keeps_the_restored_copy(
        tmp_path: Path, failure: Exception, kept: bool) -> None:
    # Before: any failure of the roll-back's commit deleted the restored copy. Unanswered, the
    # commit may have applied, and ZooKeeper then calls the restored version acknowledged with
    # this copy as its only one.
    m = Node(tmp_path, _Ensemble(applied=True, reachable=True),
              membership=SimpleNamespace(live=lambda: {"m1:6627"},
                                         holding=lambda: frozenset({"m1:6627"})),
              peers=SimpleNamespace(rank=list))
    written: dict[str, BlobState] = {}

    def fenced_set(key: str, new: BlobState, version: int) -> None:
        written[key] = new  # applied, or not: the caller cannot tell either way
        raise failure

    m.meta.fenced_set = fenced_set  # type: ignore[method-assign]
    v5 = b"five"
    m.store.install_many([("k", 5, v5, len(v5), digest_bytes(v5))])
    state = BlobState(seq=5, size=len(v5), digest=digest_bytes(v5), acl=(), replication_factor=3,
                      creator="alice", created_at=0.0, updated_at=0.0, epoch=1, acked=True,
                      write_quorum=1)
    state = state.with_new_version(6, 3, "6" * 32, 1.0, 1, 1, 3, write_tag("alice", b"a"))
    with pytest.raises(type(failure)):
        m.repairs._roll_back("k", state)
    assert written["k"].seq == 7
    assert m.store.versions("k") == ([5, 7] if kept else [5])


class _Recorder:
    """ZooKeeper applying every transaction, recording the record bytes each one carried."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.state = KazooState.CONNECTED

    def fenced_results(self, build: Any, changed: Any = ()) -> list[object]:
        txn = _Txn()
        build(txn)
        self.sizes.append(sum(len(data) for _, data in txn.ops))
        return [True] * len(txn.ops)


def test_a_group_commit_too_large_for_one_zookeeper_request_is_split(tmp_path: Path) -> None:
    # Before: the batch's records all went in one transaction. Three keys with large ACLs took
    # 1.4 MB, over ZooKeeper's 1 MB request limit: it dropped the connection at each retry.
    zk = _Recorder()
    m = Node(tmp_path, zk)
    acl = tuple(AccessControl("u", f"{i:04d}" + "日" * 252, READ) for i in range(600))
    writes = [(f"k{n}", True, BlobState(
        seq=1, size=1, digest="0" * 32, acl=acl, replication_factor=3, creator="alice",
        created_at=1.0, updated_at=1.0, epoch=3, acked=True)) for n in range(3)]
    results = m.committer.commit_together(writes, set())
    assert [r.seq for r in results if isinstance(r, BlobState)] == [1, 1, 1], results
    assert len(zk.sizes) == 2 and all(size <= MAX_STATE_BYTES for size in zk.sizes), zk.sizes
    assert sum(zk.sizes) == sum(len(new.encode()) for _, _, new in writes)
