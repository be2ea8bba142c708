"""Group commit on a real cluster: concurrent small writes share commits on the leader, and each
still gets exactly its own outcome (a clash fails only itself, nothing of it is stored)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from support.harness import (
    client_for,
    followers,
    http_get,
    scrape,
    store_dir,
    value,
    version_files,
)
from support.waiting import wait_until

from blobha.client import Client
from blobha.core.errors import KeyAlreadyExists, VersionConflict
from blobha.ops.localcluster import LocalCluster, MasterProcess

WRITERS = 8
PER_WRITER = 6


def outcome(write: Callable[[], Any]) -> Any:
    """The version a write committed, or the exception it raised."""
    try:
        return write().version
    except Exception as e:
        return e


def run_together(target: Callable[[int], None], n: int, timeout: float) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a writer hung"


def test_concurrent_small_writes_share_commits_and_keep_their_own_outcomes(
    cluster: LocalCluster, unique_key: str
) -> None:
    leader = cluster.leader()
    before = scrape(leader)
    taken, moving = f"{unique_key}-taken", f"{unique_key}-moving"
    with client_for(cluster) as c:
        c.create(taken, b"the first and only")
        c.create(moving, b"v1")
    payloads = {f"{unique_key}-{w}-{i}": os.urandom(4096 + 97 * w + i)
                for w in range(WRITERS) for i in range(PER_WRITER)}
    start = threading.Barrier(WRITERS)
    outcomes: dict[str, Any] = {}
    lock = threading.Lock()

    def writer(w: int) -> None:
        mine = [k for k in payloads if k.startswith(f"{unique_key}-{w}-")]
        with client_for(cluster) as c:
            start.wait(30)
            for n, key in enumerate(mine):
                result = outcome(lambda c=c, key=key: c.create(key, payloads[key]))
                with lock:
                    outcomes[key] = result
                if w == 0 and n == 1:
                    # In the middle of the others' writes: a create that clashes, an update
                    # against a stale version, and one against the right one.
                    for name, call in (
                        ("clash", lambda c=c: c.create(taken, b"must not land")),
                        ("stale", lambda c=c: c.update(moving, b"stale", expected_version=7)),
                        ("fresh", lambda c=c: c.update(moving, b"v2", expected_version=1)),
                    ):
                        result = outcome(call)
                        with lock:
                            outcomes[name] = result

    run_together(writer, WRITERS, 120)

    failed = {k: v for k, v in outcomes.items() if k in payloads and v != 1}
    assert not failed, f"writes that did not commit as version 1: {failed}"
    assert isinstance(outcomes["clash"], KeyAlreadyExists)
    assert isinstance(outcomes["stale"], VersionConflict)
    assert outcomes["fresh"] == 2

    with client_for(cluster) as c:
        assert c.wait_for_replication(list(payloads), 3, timeout=60).reached
        for key, data in payloads.items():
            assert c.read(key) == data
        # The refused writes left nothing behind: no version on disk, the content unchanged.
        assert c.read(taken) == b"the first and only"
        assert c.get_meta(taken).version == 1
        assert c.read(moving) == b"v2"
    assert [p.stem for p in version_files(leader, taken)] == ["v1"]
    assert list((store_dir(leader) / "tmp").iterdir()) == []

    # The leader's own view of the keys it created, made from its commits (no read back),
    # has every copy the followers registered meanwhile: nothing is shown under-replicated.
    def leader_view() -> dict[str, int]:
        status, _, body = http_get(leader.status_url + "status.json?limit=10000")
        assert status == 200
        doc = json.loads(body)
        assert not doc["blobs_truncated"]
        return {b["key"]: b["replication"] for b in doc["blobs"] if b["key"] in payloads}

    wait_until(lambda: leader_view() == dict.fromkeys(payloads, 3), 30,
               "the leader's view to show every created key with its 3 copies")

    after = scrape(leader)
    writes = (value(after, "blobha_group_commit_writes_total")
              - value(before, "blobha_group_commit_writes_total"))
    commits = (value(after, "blobha_group_commits_total")
               - value(before, "blobha_group_commits_total"))
    # Every Put went through the group commit (the 48 creates, the clash and two updates;
    # plus the two set-up creates), and concurrent writers shared commits.
    assert writes == len(payloads) + 3 + 2
    assert commits < writes
    assert value(after, "blobha_group_commit_largest") >= 2


def test_a_create_racing_a_create_of_the_same_key_commits_once(
    cluster: LocalCluster, unique_key: str
) -> None:
    """Same-key writes never share a batch: of many concurrent creates of one key exactly one
    wins, the others are told it exists, and the stored bytes are the winner's."""
    racers = 6
    start = threading.Barrier(racers)
    results: list[Any] = [None] * racers

    def racer(i: int) -> None:
        with client_for(cluster) as c:
            start.wait(30)
            results[i] = outcome(lambda: c.create(unique_key, f"racer {i}".encode()))

    run_together(racer, racers, 60)
    winners = [i for i, r in enumerate(results) if r == 1]
    assert len(winners) == 1, results
    assert all(isinstance(r, KeyAlreadyExists) for i, r in enumerate(results) if i != winners[0])
    with client_for(cluster) as c:
        assert c.read(unique_key) == f"racer {winners[0]}".encode()
        wait_until(lambda: c.get_replication(unique_key).replication == 3, 30,
                   "the winner's version on every master")


#: Far longer than any test waits for a lone write's copies: were a lone key held for the
#: linger, its replication could not be seen in time.
LONG_LINGER = 20.0


#: A cluster of the test's own whose synchronisers linger that long. No periodic pass during
#: the test: its batches would count as work being replicated.
lingering = pytest.mark.parametrize(
    "fresh_cluster",
    [{"blobstore.sync.linger.secs": LONG_LINGER, "blobstore.sync.period.secs": 600.0}],
    indirect=True)


def idle_followers(cluster: LocalCluster) -> list[MasterProcess]:
    """The two followers, once their start-up reconcile has ended."""
    fs = followers(cluster)
    assert len(fs) == 2
    wait_until(lambda: all(value(scrape(f), "blobha_sync_queue_depth") == 0 for f in fs), 30,
               "the followers' start-up reconcile to end")
    return fs


STREAM = 60


@lingering
def test_followers_replicate_lone_writes_at_once_and_a_stream_or_a_burst_in_shared_batches(
    fresh_cluster: LocalCluster, unique_key: str
) -> None:
    fs = idle_followers(fresh_cluster)
    with client_for(fresh_cluster) as c:
        # Nothing is being replicated, and a client that waits for each write's copies before
        # the next gives no key company: each goes to a worker at once. Held for the linger,
        # none would be seen in time.
        for i in range(3):
            c.create(f"{unique_key}-waits-{i}", os.urandom(4096))
            assert c.wait_for_replication(f"{unique_key}-waits-{i}", 3,
                                          timeout=LONG_LINGER / 2).reached

        # One client creating key after key: the followers rarely find a batch running when a
        # key arrives, yet the stream keeps giving company, so its keys share batches. Without
        # the hold for a stream, each follower took about four batches for five keys.
        before = batch_counts(fs)
        stream = {f"{unique_key}-{i}": os.urandom(4096) for i in range(STREAM)}
        for key, data in stream.items():
            c.create(key, data)
        assert_replicated_intact(c, stream)
    assert_shared_batches(fs, before, STREAM, STREAM / 4)

    # Writers at once: keys that arrive while another batch is replicated wait for it and go
    # on together.
    before = batch_counts(fs)
    payloads = {f"{unique_key}-{w}-{i}": os.urandom(4096) for w in range(WRITERS)
                for i in range(PER_WRITER)}

    def writer(w: int) -> None:
        with client_for(fresh_cluster) as c:
            for key, data in payloads.items():
                if key.startswith(f"{unique_key}-{w}-"):
                    c.create(key, data)

    run_together(writer, WRITERS, 120)
    with client_for(fresh_cluster) as c:
        assert_replicated_intact(c, payloads)
    assert_shared_batches(fs, before, len(payloads), len(payloads) / 2)


@lingering
def test_writers_that_wait_for_a_followers_copy_are_not_held_for_the_linger(
    fresh_cluster: LocalCluster, unique_key: str
) -> None:
    idle_followers(fresh_cluster)
    took: list[float] = []

    def writer(w: int) -> None:
        with client_for(fresh_cluster) as c:
            for i in range(PER_WRITER):
                started = time.monotonic()
                # Answered only once a follower holds a copy: with its key held for the
                # linger, each write of this stream would take the 20 s of it.
                c.create(f"{unique_key}-{w}-{i}", os.urandom(4096), write_quorum=2)
                took.append(time.monotonic() - started)

    run_together(writer, WRITERS, 120)
    assert len(took) == WRITERS * PER_WRITER
    assert max(took) < LONG_LINGER / 2, sorted(took)[-5:]


def assert_shared_batches(masters: list[MasterProcess], before: dict[str, tuple[float, float]],
                          keys: int, most: float) -> None:
    """Each of ``masters`` took every one of ``keys`` keys through a batch, in fewer than ``most``
    batches."""
    for address, (batches, taken) in batches_since(masters, before).items():
        assert taken >= keys, (address, taken)
        assert batches < most, (address, batches, taken)


def assert_replicated_intact(c: Client, payloads: dict[str, bytes]) -> None:
    # Held keys wait at most the linger from their arrival: nothing is left behind.
    assert c.wait_for_replication(list(payloads), 3, timeout=LONG_LINGER + 40).reached
    for key, data in payloads.items():
        assert c.read(key) == data


def batch_counts(masters: list[MasterProcess]) -> dict[str, tuple[float, float]]:
    """Each master's synchroniser batches so far, and the keys they carried."""
    out = {}
    for m in masters:
        text = scrape(m)
        out[m.address] = (value(text, "blobha_sync_batches_total"),
                          value(text, "blobha_sync_batch_keys_total"))
    return out


def batches_since(masters: list[MasterProcess], before: dict[str, tuple[float, float]]
                  ) -> dict[str, tuple[float, float]]:
    return {a: (b - before[a][0], k - before[a][1]) for a, (b, k) in batch_counts(masters).items()}
