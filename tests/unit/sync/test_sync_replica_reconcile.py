"""What a master does when a key's replica list changes: a reconcile only where it has work on
the key, otherwise one more read that re-arms the watch. And what it does when masters come and
go: re-read the lists a departed master was on, and reconcile only the keys whose placement
moves; copies beyond the placement dropped, fetches not installed over a commit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from kazoo.exceptions import NodeExistsError
from support.sync_fakes import (
    ME,
    PATH,
    SESSION,
    A,
    Answer,
    B,
)
from support.sync_replicas import (
    entry,
    names,
    synchroniser,
)

from blobha.core import placement
from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.store.local import LocalStore
from blobha.sync.membership import Membership
from blobha.sync.synchronizer import SyncDeferred
from blobha.sync.view import Entry
from blobha.zk.layout import MASTERS, replica_path


def test_a_holder_with_nothing_to_do_only_re_arms_the_watch() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME])
    zk.next_names = names(ME, A)
    s.feed.replicas_read("k", PATH, Answer(names(ME, A)))
    assert s.queue.depth() == 0
    assert zk.watched_reads == [(PATH, s.feed.watcher)]
    assert s.replicas.entries["k"].holders == (ME, A)


def test_a_change_between_the_two_reads_brings_a_reconcile() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME])
    zk.next_names = names(ME, A, B)  # the re-arming read already sees the third copy
    s.feed.replicas_read("k", PATH, Answer(names(ME, A)))
    assert s.queue.depth() == 1


def test_a_fully_replicated_key_is_left_alone() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME, A])
    s.feed.replicas_read("k", PATH, Answer(names(ME, A, B)))
    assert s.queue.depth() == 0 and zk.watched_reads == []


@pytest.mark.parametrize("case", [
    "leader, unacknowledged",
    "copy not registered in this session",
    "chosen holder lacking the version",
    "unknown key",
    "our copy lost",
])
def test_where_this_master_has_work_the_key_is_reconciled(case: str) -> None:
    s, zk = synchroniser(leader=case.startswith("leader"))
    if case == "leader, unacknowledged":
        s.replicas.entries["k"] = entry([ME], acked=False)
        listed = names(ME, A)
    elif case == "copy not registered in this session":
        s.replicas.entries["k"] = entry([ME], registered=SESSION - 1)
        listed = names(ME, A)
    elif case == "chosen holder lacking the version":
        s.replicas.entries["k"] = entry([A], registered=0)
        listed = names(A, B)
    elif case == "our copy lost":
        s.replicas.entries["k"] = entry([ME, A])
        listed = names(A)
    else:
        listed = names(A)
    s.feed.replicas_read("k", PATH, Answer(listed))
    assert s.queue.depth() == 1
    assert zk.watched_reads == []


@pytest.mark.parametrize("in_the_way", ["gone by itself", "an earlier session's"])
def test_a_registration_that_finds_another_sessions_node_ends_with_its_own(
        in_the_way: str) -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([A], registered=0)
    path = replica_path("k", ME, 5)
    created: list[str] = []
    owners = [None if in_the_way == "gone by itself" else SimpleNamespace(ephemeralOwner=5)]

    def create(path: str, value: bytes = b"", ephemeral: bool = False) -> str:
        created.append(path)
        if len(created) == 1:  # the earlier session's node is still there
            raise NodeExistsError()
        return path

    zk.create = create  # type: ignore[attr-defined]
    zk.exists = lambda path: owners.pop(0)  # type: ignore[attr-defined]
    s.register_replica("k", 5)
    assert created == [path, path]
    assert zk.deleted == ([] if in_the_way == "gone by itself" else [path])
    assert s.replicas.entries["k"].registered == SESSION and ME in s.replicas.entries["k"].holders


def test_a_registration_that_keeps_losing_the_race_is_not_marked_done() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([A], registered=0)

    def create(path: str, value: bytes = b"", ephemeral: bool = False) -> str:
        raise NodeExistsError()

    zk.create = create  # type: ignore[attr-defined]
    zk.exists = lambda path: None  # type: ignore[attr-defined]
    with pytest.raises(NodeExistsError):
        s.register_replica("k", 5)
    assert s.replicas.entries["k"].registered == 0 and ME not in s.replicas.entries["k"].holders


def test_a_departure_re_reads_each_list_once_with_its_watch() -> None:
    s, zk = synchroniser()
    s.replicas.entries["k"] = entry([ME, A, B])
    s.replicas.entries["steady"] = entry([ME, A])
    assert s.replicas.tally.held_by({B}) == ["k"]
    zk.listed[PATH] = names(ME, A)  # B's replica node went with its session
    s.feed.recheck_replicas(["k"])
    # One read, which armed the watch: no second read to re-arm it, no reconcile.
    assert zk.watched_reads == [(PATH, s.feed.watcher)]
    assert s.replicas.entries["k"].holders == (ME, A)
    assert s.queue.depth() == 0
    assert s.figures()[1] == 2  # both keys now show as under-replicated


def test_a_departure_that_leaves_this_master_work_queues_the_key() -> None:
    s, zk = synchroniser(leader=True)
    s.replicas.entries["k"] = entry([A, B], acked=False)
    zk.listed[PATH] = names(A)
    s.feed.recheck_replicas(["k"])
    assert s.queue.depth() == 1


def test_only_keys_whose_placement_moves_are_reconciled_when_masters_change() -> None:
    s, _ = synchroniser()
    before, after = frozenset({ME, A, B}), frozenset({ME, A})
    for i in range(200):
        s.replicas.entries[f"three-{i}"] = Entry(b"", 0, 1, 3, True, (ME, A, B), SESSION)
        s.replicas.entries[f"one-{i}"] = Entry(b"", 0, 1, 1, True, (B,), SESSION)
    moved = set(s.replicas.tally.placement_moved(before, after))
    # With three copies wanted, both remaining masters hold every key either way.
    assert not any(key.startswith("three-") for key in moved)
    # With one, the keys B held move to whichever of ME and A the placement now picks.
    expected = {f"one-{i}" for i in range(200)
                if placement.choose(f"one-{i}", before, 1) == [B]
                and placement.choose(f"one-{i}", after, 1) == [ME]}
    assert moved == expected and 0 < len(expected) < 200


def test_departures_are_reported_once_even_after_a_quick_return() -> None:
    listed = [{ME, A, B}, {ME, A}, {ME, A, B}]
    zk = SimpleNamespace(get_children_async=lambda path, watch=None: Answer(
        sorted(listed.pop(0)) if path == MASTERS else []))
    changes: list[None] = []
    m = Membership(zk, ME, grace_secs=30, on_change=lambda: changes.append(None),  # type: ignore[arg-type]
                   info={})
    m.refresh()
    m.refresh()  # B's session ended
    m.refresh()  # B is back, with a new session, before anyone asked
    assert m.take_departed() == {B}
    assert m.take_departed() == set()
    assert m.known() == {ME, A, B} and len(changes) == 3


def test_each_departure_is_announced_before_the_change() -> None:
    # The master abandons its fetches from a master that left (Master._master_left) before
    # the synchroniser looks at the new membership.
    listed = [{ME, A, B}, {ME}, {ME}, {ME, A}]
    zk = SimpleNamespace(get_children_async=lambda path, watch=None: Answer(
        sorted(listed.pop(0)) if path == MASTERS else []))
    events: list[str] = []
    m = Membership(zk, ME, grace_secs=30, on_change=lambda: events.append("change"),  # type: ignore[arg-type]
                   info={}, on_leave=events.append)
    for _ in range(4):
        m.refresh()
    assert events == ["change", A, B, "change", "change"]


def test_dropping_a_copy_beyond_the_placement_keeps_a_version_committed_meanwhile(
        tmp_path: Path) -> None:
    # The leader, not chosen for R=2, read v1 complete on the chosen two and drops its copy;
    # meanwhile its write path installed and committed v2 (an acknowledged write). Only v1
    # may go.
    store = LocalStore(tmp_path / "store")
    key = next(k for k in (f"k{i}" for i in range(100))
               if ME not in placement.choose(k, {ME, A, B}, 2))
    v1, v2 = b"one", b"two"
    for seq, data in ((1, v1), (2, v2)):
        store.install_many([(key, seq, data, len(data), digest_bytes(data))])
    s, zk = synchroniser(leader=True, store=store)
    state = BlobState(seq=1, size=len(v1), digest=digest_bytes(v1), acl=(), replication_factor=2,
                      creator="alice", created_at=0.0, updated_at=0.0, epoch=1, acked=True)
    listed = [f"{h}-1" for h in (ME, A, B)]
    assert s.executor.settle(key, state.encode(), SimpleNamespace(version=0), listed) is None
    assert store.versions(key) == [2]
    assert b"".join(store.read(key, 2)) == v2
    assert zk.deleted == [f"/blobstore/{key}/{ME}-1"]


def test_a_read_older_than_the_leaders_own_commit_deletes_nothing(tmp_path: Path) -> None:
    # The key was deleted and created again by this leader after the batch sent its read: the
    # read shows the old v1 (content A), the store holds the new, acknowledged v1 (B). Acting
    # on the read deleted B as "a version of an earlier incarnation" and B's replica node with
    # it, leaving the acknowledged write on no master.
    store = LocalStore(tmp_path / "store")
    old, new = b"AAAA", b"BBBB"
    s, zk = synchroniser(leader=True, store=store)
    read_mark = s.replicas.commits  # the batch sends its reads
    store.install_many([("k", 1, new, len(new), digest_bytes(new))])
    s.registered("k", 1, SESSION, 1)  # the re-create's commit, under the key's lock
    stale = BlobState(seq=1, size=len(old), digest=digest_bytes(old), acl=(),
                      replication_factor=1, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    assert s.executor.settle("k", stale.encode(), SimpleNamespace(version=3), [f"{ME}-1"],
                     read_mark=read_mark) is None
    assert b"".join(store.read("k", 1)) == new and zk.deleted == []
    assert s.queue.get_batch(10) == ["k"]  # looked at again, with a newer read

    # That newer read (sent after the commit) is acted on as usual, and the mark is spent.
    current = BlobState(seq=1, size=len(new), digest=digest_bytes(new), acl=(),
                        replication_factor=1, creator="alice", created_at=0.0, updated_at=0.0,
                        epoch=1, acked=True)
    assert s.executor.settle("k", current.encode(), SimpleNamespace(version=0), [f"{ME}-1"],
                     read_mark=s.replicas.commits) is None
    assert b"".join(store.read("k", 1)) == new and zk.deleted == [] and not s.replicas.commit_marks


@pytest.mark.parametrize("ours", [True, False])
def test_a_copy_that_differs_from_zookeepers_record_goes_only_if_zookeeper_is_ours(
        tmp_path: Path, ours: bool) -> None:
    store = LocalStore(tmp_path / "store")
    mine, recorded = b"MINE", b"THEIRS"
    store.install_many([("k", 1, mine, len(mine), digest_bytes(mine))])
    s, zk = synchroniser(store=store, ours=ours)
    state = BlobState(seq=1, size=len(recorded), digest=digest_bytes(recorded), acl=(),
                      replication_factor=3, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    outcome = s.executor.settle("k", state.encode(), SimpleNamespace(version=0), [f"{A}-1"])
    if ours:  # an earlier incarnation's copy: replaced by a fetch of the recorded one
        assert store.versions("k") == [] and outcome == (state, [A])
    else:  # a wiped or foreign ZooKeeper's record: our copy stays, and nothing is fetched
        assert b"".join(store.read("k", 1)) == mine and outcome is None
    assert zk.deleted == []


def test_a_fetch_is_not_installed_over_a_commit_made_while_it_ran(tmp_path: Path) -> None:
    # The reconcile decided to fetch the old key's v1 (A) from a master that still had it; the
    # key was deleted and created again here meanwhile (v1 = B, acknowledged, this master's
    # copy only). Installing A then replaced B.
    store = LocalStore(tmp_path / "store")
    old, new = b"AAAA", b"BBBB"
    s, _ = synchroniser(leader=True, store=store)
    read_mark = s.replicas.commits
    stale = BlobState(seq=1, size=len(old), digest=digest_bytes(old), acl=(),
                      replication_factor=3, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    store.install_many([("k", 1, new, len(new), digest_bytes(new))])
    s.registered("k", 1, SESSION, 1)
    other = replace(stale, seq=4)
    failures = s.fetcher.install_fetched([("k", stale, old), ("j", other, old)], read_mark)
    assert list(failures) == ["k"] and isinstance(failures["k"], SyncDeferred)
    assert b"".join(store.read("k", 1)) == new
    assert b"".join(store.read("j", 4)) == old  # the rest of the batch is installed
