"""Versions judged again under the key lock, deletes and registrations across them, full
passes that fail during a paced pass, and status checks sharing one pass over the keys."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.protocol.states import EventType, KazooState
from support.sync_fakes import (
    ME,
    SESSION,
    A,
    B,
)
from support.sync_replicas import (
    Intake,
    entry,
    periodic_loop,
    synchroniser,
    tree_event,
)

from blobha.core import placement
from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.store.local import LocalStore
from blobha.sync.feed import Wake
from blobha.sync.synchronizer import SyncDeferred
from blobha.sync.view import Entry, holders_of


def test_a_version_above_the_committed_one_is_judged_again_under_the_key_lock(
    tmp_path: Any,
) -> None:
    # The worker read the key at v5 and saw "not leading" during a blip of the leader's own
    # connection; meanwhile the still-leading master committed v6 (under the key's lock). Judged
    # on the v5 read, v6 looked like debris and was deleted, though committed.
    store = LocalStore(tmp_path / "s")
    store.install_many([("k", 6, b"new", 3, digest_bytes(b"new"))])
    s, zk = synchroniser(leader=False, store=store, key_lock=store.key_lock)

    def committed(seq: int) -> Any:
        state = BlobState(seq=seq, size=3, digest=digest_bytes(b"new"), acl=(),
                          replication_factor=3, creator="alice", created_at=0.0,
                          updated_at=0.0, epoch=1, acked=True)
        return lambda path: (state.encode(), SimpleNamespace(version=1))

    zk.get = committed(6)  # type: ignore[attr-defined]
    s.executor.prune("k", 5)
    assert store.versions("k") == [6]
    # Still above the committed version once the lock is held: debris, removed.
    zk.get = committed(5)  # type: ignore[attr-defined]
    s.executor.prune("k", 5)
    assert store.versions("k") == []


def test_a_delete_refused_for_the_cluster_identity_waits_a_full_grace_afterwards(
    tmp_path: Any,
) -> None:
    # ZooKeeper wiped, then restored in stages (the cluster's identity first, the keys after):
    # a key not back yet was deleted at once, on a grace counted from the wipe.
    store = LocalStore(tmp_path / "s")
    store.install_many([("k", 1, b"x", 1, digest_bytes(b"x"))])
    identity_back = [False]
    s, zk = synchroniser(store=store, key_lock=store.key_lock, ours=lambda: identity_back[0],
                         delete_grace_secs=0.2)
    zk.exists = lambda path: None  # type: ignore[attr-defined]
    now = [100.0]
    s.executor.clock = lambda: now[0]
    s.executor.key_gone("k")  # found gone (the wipe): its grace starts
    assert store.versions("k") == [1] and s.queue.depth() == 1
    now[0] += 0.25  # the grace passes while ZooKeeper holds no cluster identity
    s.executor.key_gone("k")
    assert store.versions("k") == [1]
    identity_back[0] = True
    s.executor.key_gone("k")
    assert store.versions("k") == [1]  # its grace starts now


def test_a_copy_fetched_across_a_delete_is_not_registered() -> None:
    # The batch read the key, then fetched it; meanwhile the key was deleted and created
    # again at the same version number. The copy was of the deleted key, and its replica node
    # (created after the re-create) counted it as a holder of the new version, which a
    # replication wait then trusted.
    s, _ = synchroniser(recursive=True)
    old = BlobState(seq=1, size=4, digest=digest_bytes(b"OLD!"), acl=(), replication_factor=3,
                    creator="alice", created_at=1.0, updated_at=1.0, epoch=1, acked=True)
    registered: list[tuple[str, int]] = []
    s.executor.reader.read_many = lambda keys, armed, listless: {"k": (old, (A,)), "j": (old, (A,))}  # type: ignore[method-assign,assignment,return-value]
    s.executor.settle = lambda key, state, holders, **_: (state, list(holders))  # type: ignore[method-assign,assignment,misc]

    def fetch_all(to_fetch: Any, failures: Any, read_mark: int) -> Any:
        s.feed.on_tree(tree_event(EventType.DELETED, "/blobstore/k"))  # during the fetch
        return [], [("k", 1), ("j", 1)], set()

    s.fetcher.fetch_all = fetch_all  # type: ignore[method-assign]
    s.registry.register_many = lambda items: registered.extend(items) or {}  # type: ignore[method-assign,func-returns-value]
    s.executor.prune = lambda key, seq: None  # type: ignore[method-assign]
    failures = s.executor.reconcile(["k", "j"], set(), {})
    assert registered == [("j", 1)]
    assert isinstance(failures["k"], SyncDeferred) and "j" not in failures
    assert s.queue.get_batch(10) == ["k"]  # the deletion's event sends it round again
    assert not s.replicas.flight.deleted_in_batch  # nothing kept past the batch


def test_a_deletion_seen_only_once_the_copy_was_registered_takes_the_registration_back() -> None:
    # The delete and the re-create reached ZooKeeper before the registration did, but their
    # events arrived after _drop_deleted looked: the node just created is removed again.
    s, zk = synchroniser(recursive=True)
    old = BlobState(seq=1, size=4, digest=digest_bytes(b"OLD!"), acl=(), replication_factor=3,
                    creator="alice", created_at=1.0, updated_at=1.0, epoch=1, acked=True)
    s.executor.reader.read_many = lambda keys, armed, listless: {"k": (old, (A,)), "j": (old, (A,))}  # type: ignore[method-assign,assignment,return-value]
    s.executor.settle = lambda key, state, holders, **_: (state, list(holders))  # type: ignore[method-assign,assignment,misc]
    s.fetcher.fetch_all = lambda to_fetch, failures, read_mark: ([], [("k", 1), ("j", 1)], set())  # type: ignore[method-assign,assignment,return-value]

    def register_many(items: list[tuple[str, int]]) -> dict[str, Exception]:
        s.feed.on_tree(tree_event(EventType.DELETED, "/blobstore/k"))  # before the answers
        return {}

    s.registry.register_many = register_many  # type: ignore[method-assign]
    s.executor.prune = lambda key, seq: None  # type: ignore[method-assign]
    failures = s.executor.reconcile(["k", "j"], set(), {})
    assert zk.deleted == [f"/blobstore/k/{ME}-1"]
    assert isinstance(failures["k"], SyncDeferred) and "j" not in failures


def test_a_full_pass_that_fails_during_a_paced_pass_neither_ends_the_thread_nor_is_forgotten(
        ) -> None:
    # A reconnect asks for a full pass while the paced safety-net pass is being handed out
    # (its next start is then infinite); the full pass's listing fails as the connection drops
    # again, and kazoo is still reconnecting a second later. The thread used to die on its next
    # wait (Event.wait(inf) overflows), and nothing re-registered or reconciled after that.
    import threading

    from kazoo.exceptions import ConnectionLoss
    from support.waiting import wait_until

    class Connection:
        """kazoo's state, counting how often the thread looked at it while disconnected."""

        def __init__(self) -> None:
            self.up = True
            self.looks_while_down = 0

        @property
        def state(self) -> str:
            if not self.up:
                self.looks_while_down += 1
            return KazooState.CONNECTED if self.up else KazooState.SUSPENDED

        client_id = (SESSION, b"")

    zk = Connection()
    listings: list[str] = []

    def all_keys() -> list[str]:
        if len(listings) == 1:  # the reconnect's full pass
            listings.append("failed")
            zk.up = False
            raise ConnectionLoss()
        listings.append("listed")
        return [f"k{i}" for i in range(10_000)]  # paced out over about 50 s

    wake = Wake()
    loop = periodic_loop(0.01, Intake(all_keys), zk=zk, wake=wake)
    thread = threading.Thread(target=loop.periodic, daemon=True)
    thread.start()
    try:
        wait_until(lambda: listings == ["listed"], timeout=10, what="the paced pass begun")
        wake.ask_full()  # what a new session or a reconnect asks
        wait_until(lambda: len(listings) == 2, timeout=10, what="the full pass tried")
        # Past the 1 s pause after the failure, the connection still down: the thread looks
        # again and again (every period), where it used to die at its second look.
        wait_until(lambda: zk.looks_while_down >= 5 or not thread.is_alive(), timeout=10,
                   what="the thread looking at the connection")
        assert thread.is_alive()
        zk.up = True
        # The failed full pass is made again once connected, without another request.
        wait_until(lambda: len(listings) >= 3 or not thread.is_alive(), timeout=10,
                   what="the full pass made again")
        assert thread.is_alive() and listings[:3] == ["listed", "failed", "listed"]
    finally:
        loop.stop()
        thread.join(5)


def test_concurrent_status_checks_share_one_pass_over_the_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each pass looks at every key, and under writes the view has moved at every call.
    # Callers that arrive while a pass runs wait for it and then share one pass that began
    # after they asked: its answer is as of a moment during their call, so nothing they could
    # expect to see is missing.
    from support.waiting import wait_until

    s, _ = synchroniser()
    s.replicas.entries["k"] = entry([A, B])
    s.replicas.entries["k2"] = entry([A])
    passes: list[int] = []
    first_inside = threading.Event()
    release = threading.Event()
    real_count = s.replicas.tally.count

    def count(entries: list[tuple[str, Any]], known: frozenset[str],
              holding: frozenset[str] | None = None) -> tuple[int, int]:
        passes.append(len(passes))
        if len(passes) == 1:
            first_inside.set()
            assert release.wait(30)
        return real_count(entries, known, holding)

    monkeypatch.setattr(s.replicas.tally, "count", count)

    class CountingLock:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.waiting = 0

        def __enter__(self) -> None:
            self.waiting += 1
            self.lock.acquire()
            self.waiting -= 1

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    gate = CountingLock()
    s.replicas.tally.lock = gate  # type: ignore[assignment]
    results: dict[str, tuple[int, int, int]] = {}

    def ask(name: str) -> None:
        results[name] = s.figures()

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert first_inside.wait(30)
    with s.replicas.lock:  # a write lands while the first pass runs
        s.replicas.entries["k3"] = entry([A, B])
        s.replicas.generation += 1
    later = [threading.Thread(target=ask, args=(f"later-{i}",)) for i in range(3)]
    for t in later:
        t.start()
    wait_until(lambda: gate.waiting == 3, what="the later callers to wait for the pass")
    release.set()
    for t in (first, *later):
        t.join(30)
    # The first pass, then one more for all three later callers, which all see the write.
    assert len(passes) == 2
    assert results["first"] == (2, 2, 2)
    assert all(results[f"later-{i}"] == (3, 3, 3) for i in range(3))


def test_a_status_pass_hashes_only_the_keys_whose_placement_it_has_not_decided(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Where there are more masters than copies, a key this master lacks needs the placement's
    # hash to tell whether it should hold it; under writes every status check is a new pass,
    # and each hashed every such key again (0.2 s at 100,000 keys on five masters).
    from blobha.sync import tally as tally_mod

    c, d = "10.0.0.4:6627", "10.0.0.5:6627"
    known = {ME, A, B, c, d}
    s, _ = synchroniser(membership=SimpleNamespace(known=lambda: known, live=lambda: known,
                                                   holding=lambda: frozenset(known)))
    real_chosen = tally_mod.chosen
    hashed: list[str] = []

    def chosen(me: str, key: str, rf: int, masters: Any) -> bool:
        hashed.append(key)
        return real_chosen(me, key, rf, masters)

    monkeypatch.setattr(tally_mod, "chosen", chosen)

    def put(key: str, holders: list[str], rf: int = 3) -> None:
        with s.replicas.lock:
            s.replicas.entries[key] = Entry(b"", 0, 5, rf, True,
                                            holders_of([f"{h}-5" for h in holders], 5), SESSION)
            s.replicas.generation += 1

    def expected() -> tuple[int, int, int]:
        view = list(s.replicas.entries.items())
        return (len(view), sum(len(e.holders) < e.rf for _, e in view),
                sum(ME not in e.holders and ME in placement.choose(k, known, e.rf)
                    for k, e in view))

    for i in range(60):
        put(f"k{i}", [A, B])  # lacking here: about 60% of them are placed here
    put("mine", [ME, A, B])
    assert s.figures() == expected() and sorted(hashed) == sorted(f"k{i}" for i in range(60))
    assert 0 < expected()[2] < 60
    hashed.clear()
    put("new", [A, B])
    assert s.figures() == expected() and hashed == ["new"]
    hashed.clear()
    put("k1", [A], rf=1)  # its factor changed: decided again
    assert s.figures() == expected() and hashed == ["k1"]
    hashed.clear()
    known = {ME, A, B, c}  # the membership changed: every key lacking here is decided again
    s.replicas.generation += 1
    assert s.figures() == expected() and len(hashed) == 61
    hashed.clear()
    with s.replicas.lock:  # a deleted key's decision goes with it
        del s.replicas.entries["new"]
        s.replicas.generation += 1
    assert s.figures() == expected() and hashed == [] and "new" not in s.replicas.tally.placed()
