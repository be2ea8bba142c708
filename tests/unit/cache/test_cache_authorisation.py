"""The node-local cache's authorisation (scenario 21): no cached file for a user without
read, revocations noticed within the update interval, one question to the cluster at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import (
    Clock,
    FakeClient,
    FakeCluster,
)
from support.waiting import wait_until

from blobha.cache import BlobCache, CachedBlob
from blobha.cache import checks as checks_mod
from blobha.core.errors import (
    BlobError,
    KeyNotFound,
    NotAuthorized,
    TlsMismatch,
    Unavailable,
)
from blobha.core.keys import key_dirname


@pytest.fixture
def lock_waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The threads that went to wait for a check lock (``blobs/<key dir>/asking/<user>``)."""
    waits: list[str] = []
    real_lock_file = checks_mod.lock_file

    def recording(path: Path, blocking: bool) -> int | None:
        if blocking and path.parent.name == "asking":
            waits.append(threading.current_thread().name)
        return real_lock_file(path, blocking)

    monkeypatch.setattr(checks_mod, "lock_file", recording)
    return waits


def test_a_user_without_read_never_gets_a_cached_file(fake: FakeCluster, make: Any) -> None:
    fake.put("secret", b"s3cr3t", readers={"alice"})
    assert make("alice").get("secret").path.read_bytes() == b"s3cr3t"
    bob = make("bob", update_interval_secs=3600)
    for _ in range(2):
        with pytest.raises(NotAuthorized):
            bob.get("secret")
    assert fake.downloads == 1
    assert bob.stats().hits == 0


def test_revoked_read_is_noticed_within_the_update_interval(fake: FakeCluster, make: Any,
                                                           clock: Clock) -> None:
    fake.put("k", b"data", readers={"alice", "carol"})
    carol = make("carol", update_interval_secs=30)
    carol.get("k")
    fake.blobs["k"].readers = {"alice"}
    clock.advance(29)
    carol.get("k")  # checked at most every 30 s: still within the interval
    clock.advance(1)
    with pytest.raises(NotAuthorized):
        carol.get("k")


def test_the_cluster_is_asked_at_most_once_per_interval(fake: FakeCluster, make: Any,
                                                       clock: Clock) -> None:
    fake.put("k", b"data")
    cache = make(update_interval_secs=30)
    for _ in range(5):
        cache.get("k")
    assert fake.meta_calls == 1
    clock.advance(30)
    cache.get("k")
    assert fake.meta_calls == 2


def lazy(fake: FakeCluster, make: Any, user: str, **kw: Any) -> tuple[BlobCache, list[str]]:
    """A cache that connects only when it must (as the Spark executors' do), and the users it
    connected as."""
    connected: list[str] = []

    def connect() -> FakeClient:
        connected.append(user)
        return fake.client(user)

    return make(user, connect=connect, **kw), connected


def test_a_new_process_within_the_interval_needs_no_round_trip(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"data")
    make(update_interval_secs=30).get("k")
    assert fake.meta_calls == 1
    clock.advance(20)
    later, connected = lazy(fake, make, "alice", update_interval_secs=30)
    assert later.get("k").path.read_bytes() == b"data"
    assert connected == [] and fake.meta_calls == 1, "the node's record answered"
    stats = later.stats()
    assert (stats.hits, stats.checks) == (1, 1)


def test_processes_finding_the_record_aged_together_ask_the_cluster_once(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The executors of a new application, once the last answer has aged: one asks (and loads
    # the client), the others wait for its answer on the node, and for the version it was told
    # of to be installed. Two instances hold separate flock descriptions, exactly like two
    # processes.
    fake.put("k", b"v1")
    make(update_interval_secs=30).get("k")
    fake.put("k", b"v2")
    clock.advance(31)
    downloads_when_b_went_on: list[int] = []
    waiting_lock_file = checks_mod.lock_file

    def watching(path: Path, blocking: bool) -> int | None:
        fd = waiting_lock_file(path, blocking)
        if blocking and path.parent.name == "asking":
            downloads_when_b_went_on.append(fake.downloads)
        return fd

    monkeypatch.setattr(checks_mod, "lock_file", watching)
    a, a_connected = lazy(fake, make, "alice", update_interval_secs=30)
    b, b_connected = lazy(fake, make, "alice", update_interval_secs=30)
    fake.meta_gates = {"a": threading.Event()}
    got: dict[str, CachedBlob] = {}
    ta = threading.Thread(target=lambda: got.setdefault("a", a.get("k")), name="a")
    ta.start()
    wait_until(lambda: fake.meta_calls == 2, what="a to ask the cluster")
    tb = threading.Thread(target=lambda: got.setdefault("b", b.get("k")), name="b")
    tb.start()
    wait_until(lambda: lock_waits == ["b"], what="b to wait for the check lock")
    fake.meta_gates["a"].set()
    ta.join(30)
    tb.join(30)
    assert (got["a"].version, got["b"].version) == (2, 2)
    assert got["b"].path.read_bytes() == b"v2"
    assert fake.meta_calls == 2, "b took a's answer"
    assert downloads_when_b_went_on == [2], "b went on once a had installed version 2"
    assert (a_connected, b_connected) == (["alice"], []), "b needed no client, not even to download"
    assert fake.downloads == 2 and b.stats().checks == 2


def _get_in_threads(make_cache: Callable[[str], BlobCache], names: str
                    ) -> tuple[dict[str, threading.Thread], dict[str, CachedBlob],
                               dict[str, BaseException]]:
    """A thread per name, each getting "k" from a cache of its own; not started."""
    got: dict[str, CachedBlob] = {}
    errors: dict[str, BaseException] = {}

    def get(name: str) -> None:
        try:
            got[name] = make_cache(name).get("k")
        except BaseException as exc:
            errors[name] = exc

    threads = {n: threading.Thread(target=get, args=(n,), name=n) for n in names}
    return threads, got, errors


def test_after_an_asker_that_got_no_answer_the_others_ask_in_parallel(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str]
) -> None:
    # With the cluster unreachable each question takes the client's whole timeout: the
    # processes that waited for the one that got no answer must not then take turns. (Each
    # then serves the cached copy on the node's record of the cluster's last answer to alice.)
    fake.put("k", b"v1")
    make(update_interval_secs=30).get("k")
    clock.advance(31)
    fake.meta_error = Unavailable("no master answers")
    fake.meta_gates = {name: threading.Event() for name in "abc"}
    threads, _, errors = _get_in_threads(
        lambda _: lazy(fake, make, "alice", update_interval_secs=30)[0], "abc")
    threads["a"].start()
    wait_until(lambda: fake.meta_inside == 1, what="a to ask the cluster")
    threads["b"].start()
    threads["c"].start()
    wait_until(lambda: sorted(lock_waits) == ["b", "c"], what="b and c to wait for a")
    fake.meta_gates["a"].set()
    wait_until(lambda: fake.meta_inside == 2, what="b and c to ask at the same time")
    fake.meta_gates["b"].set()
    fake.meta_gates["c"].set()
    for t in threads.values():
        t.join(30)
    assert errors == {}
    assert fake.meta_calls == 4


@pytest.mark.parametrize("refusal", [NotAuthorized, KeyNotFound])
def test_a_refusal_is_not_shared_through_the_check_lock(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str], cache_dir: Path,
    refusal: type[Exception]
) -> None:
    fake.put("k", b"data", readers={"alice"})
    make("alice", update_interval_secs=30).get("k")
    if refusal is NotAuthorized:
        fake.blobs["k"].readers = set()
    else:
        fake.delete("k")
    clock.advance(31)
    fake.meta_gates = {"a": threading.Event()}
    threads, _, errors = _get_in_threads(
        lambda _: lazy(fake, make, "alice", update_interval_secs=30)[0], "ab")
    threads["a"].start()
    wait_until(lambda: fake.meta_inside == 1, what="a to ask the cluster")
    threads["b"].start()
    wait_until(lambda: lock_waits == ["b"], what="b to wait for a")
    fake.meta_gates["a"].set()
    for t in threads.values():
        t.join(30)
    assert sorted(errors) == ["a", "b"]
    assert all(isinstance(e, refusal) for e in errors.values())
    assert fake.meta_calls == 3, "b asked for itself: a had no answer to share"
    kdir = cache_dir / "blobs" / key_dirname("k")
    assert not (kdir / "checks" / "alice").exists()


def test_users_do_not_wait_for_each_others_questions(
    fake: FakeCluster, make: Any, clock: Clock, lock_waits: list[str]
) -> None:
    fake.put("k", b"data")
    make("alice", update_interval_secs=30).get("k")
    make("bob", update_interval_secs=30).get("k")
    clock.advance(31)
    fake.meta_gates = {"alice": threading.Event()}
    alice, bob = (lazy(fake, make, u, update_interval_secs=30)[0] for u in ("alice", "bob"))
    got: dict[str, CachedBlob] = {}
    ta = threading.Thread(target=lambda: got.setdefault("alice", alice.get("k")), name="alice")
    ta.start()
    wait_until(lambda: fake.meta_inside == 1, what="alice's process to ask the cluster")
    # Asked from this thread while alice's question hangs: it would wait, and the gate time out,
    # if the users shared a lock.
    assert bob.get("k").path.read_bytes() == b"data"
    assert lock_waits == []
    fake.meta_gates["alice"].set()
    ta.join(30)
    assert got["alice"].path.read_bytes() == b"data"
    assert fake.meta_calls == 4


def test_a_recorded_check_counts_from_when_the_cluster_answered(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"v1")
    make(update_interval_secs=30).get("k", owner="app-1")
    fake.put("k", b"v2")
    clock.advance(20)
    second, connected = lazy(fake, make, "alice", update_interval_secs=30)
    assert second.get("k", owner="app-2").version == 1, "within the interval of the answer"
    clock.advance(10)  # 30 s after the cluster's answer, 10 s after this instance started
    blob = second.get("k", owner="app-2")
    assert (blob.version, blob.path.read_bytes()) == (2, b"v2")
    assert connected == ["alice"] and fake.meta_calls == 2


def test_a_user_without_read_is_refused_from_a_warm_cache(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("secret", b"s3cr3t", readers={"alice"})
    make("alice", update_interval_secs=3600).get("secret")
    bob, connected = lazy(fake, make, "bob", update_interval_secs=3600)
    for _ in range(2):
        with pytest.raises(NotAuthorized):
            bob.get("secret")
    assert connected == ["bob"], "alice's record does not answer for bob"
    assert fake.meta_calls == 3 and fake.downloads == 1
    assert bob.stats().hits == 0


def test_a_revoked_read_reaches_new_processes_within_the_interval(
    fake: FakeCluster, make: Any, clock: Clock
) -> None:
    fake.put("k", b"data", readers={"alice", "carol"})
    make("carol", update_interval_secs=30).get("k")
    fake.blobs["k"].readers = {"alice"}
    clock.advance(29)
    lazy(fake, make, "carol", update_interval_secs=30)[0].get("k")  # the answer is 29 s old
    clock.advance(1)
    with pytest.raises(NotAuthorized):
        lazy(fake, make, "carol", update_interval_secs=30)[0].get("k")
    # The refusal removed carol's record: no process of hers is served from it any more, even
    # one that counts a longer interval.
    late, connected = lazy(fake, make, "carol", update_interval_secs=3600)
    with pytest.raises(NotAuthorized):
        late.get("k")
    assert connected == ["carol"]


@pytest.mark.parametrize("outage", [
    Unavailable("no master answered"),
    # No master accepts this client's TLS settings (its CA was replaced, say): that says
    # nothing of what alice may read, so it must not make the cache forget it.
    TlsMismatch("no TLS connection to master m1:1: its certificate did not verify"),
])
def test_an_unreachable_cluster_serves_what_this_user_was_allowed_to_read(
    fake: FakeCluster, make: Any, clock: Clock, outage: BlobError
) -> None:
    fake.put("k", b"data")
    fake.put("never-checked", b"other")
    cache = make(update_interval_secs=1)
    cache.get("k")
    make("bob").get("never-checked")
    fake.meta_error = outage
    clock.advance(5)
    assert cache.get("k").path.read_bytes() == b"data"
    with pytest.raises(type(outage)):
        cache.get("never-checked")  # cached, but the cluster never said alice may read it
    # A process started during the outage (a new Spark worker) has no answer of its own: the
    # node's record of the cluster's last answer to alice serves. Before, it failed.
    assert make(update_interval_secs=1).get("k").path.read_bytes() == b"data"


def test_probing_a_key_this_user_may_no_longer_read_drops_the_nodes_record(
    fake: FakeCluster, make: Any, clock: Clock, cache_dir: Path
) -> None:
    fake.put("k", b"data", readers={"alice"})
    cache = make(retention_secs=0, soft_limit_bytes=0, update_interval_secs=1)
    cache.get("k")
    fake.blobs["k"].readers = set()
    clock.advance(5)
    cache._janitor._probe_deleted([cache._layout.scan_key(key_dirname("k"), "k")])
    # An outage now must not let a new process of alice's read it on the old record.
    fake.meta_error = Unavailable("no master answered")
    with pytest.raises(Unavailable):
        make(update_interval_secs=1).get("k")
