"""Replication factor, placement and the server-side replication wait."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
from kazoo.client import KazooClient
from support.harness import (
    client_for,
    followers,
    make_cluster,
    master_metadata,
    md,
    scrape,
    store_dir,
    stub,
    value,
    version_files,
    wait_until,
)

from blobha.client import Client
from blobha.core import placement
from blobha.core.digest import PUT_MAX_BYTES
from blobha.core.errors import InvalidArgument, KeyNotFound
from blobha.master.reads import FETCH_MAX_VERSIONS, FETCH_WHOLE_MAX_BYTES
from blobha.ops.bench import node_status
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.store.local import FLUSH_BYTES
from blobha.v1 import blobha_pb2 as pb
from blobha.zk.layout import ELECTION, HOLDERS, JOURNAL, JournalRecord, key_path, replica_path

pytestmark = pytest.mark.integration


def _holders(c: Client, key: str) -> list[str]:
    return sorted(c.get_replication(key).holders)


@pytest.mark.smoke
def test_create_and_update_replicate_to_three(alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"one", replication_factor=3)
    assert alice.wait_for_replication([unique_key], 3, timeout=10).reached
    alice.update(unique_key, b"two")
    result = alice.wait_for_replication([unique_key], 3, timeout=10)
    assert result.reached
    assert result.statuses[0].version == 2


@pytest.mark.smoke
def test_a_blob_larger_than_a_background_flush_lands_whole_on_every_master(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    """The leader's upload and each follower's copy go through temp files flushed in the
    background while the bytes arrive (store.FLUSH_BYTES): every master ends up with exactly
    the bytes, and every read of them verifies."""
    data = os.urandom(FLUSH_BYTES + 5 * 1024 * 1024 + 17)
    alice.create(unique_key, data, replication_factor=3)
    assert alice.wait_for_replication([unique_key], 3, timeout=60).reached
    for m in cluster.masters:
        assert [f.read_bytes() == data for f in version_files(m, unique_key)] == [True], m.address
    assert alice.read(unique_key) == data


def test_replication_factor_one_lands_on_the_placement_choice(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    masters = [m.address for m in cluster.masters]
    for i in range(4):
        key = f"{unique_key}-{i}"
        alice.create(key, b"x", replication_factor=1)
        expected = placement.choose(key, masters, 1)
        wait_until(lambda k=key, e=expected: _holders(alice, k) == e, 15,
                   f"{key} held exactly by {expected}")


def test_raising_and_lowering_the_replication_factor(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    masters = [m.address for m in cluster.masters]
    alice.create(unique_key, b"data", replication_factor=1)
    expected_one = placement.choose(unique_key, masters, 1)
    wait_until(lambda: _holders(alice, unique_key) == expected_one, 15, "one holder")
    meta = alice.set_replication_factor(unique_key, 3)
    assert meta.replication_factor == 3
    assert alice.wait_for_replication([unique_key], 3, timeout=15).reached
    alice.set_replication_factor(unique_key, 2)
    expected_two = sorted(placement.choose(unique_key, masters, 2))
    wait_until(lambda: _holders(alice, unique_key) == expected_two, 15,
               f"extras removed down to {expected_two}")
    assert alice.read(unique_key) == b"data"


def test_an_updates_write_quorum_is_checked_against_the_keys_own_factor(
        tmp_path: Path) -> None:
    # It was checked against the cluster's default factor (2 here): a key of 3 refused
    # updates with W=3, and a key of 1 took W=2 and acknowledged its one copy as two.
    with make_cluster(tmp_path, **{"blobstore.replication.factor": 2}) as lc, \
            client_for(lc, "alice") as alice:
        lc.wait_ready(30, expect=3)
        key = "three"
        alice.create(key, b"one", replication_factor=3)
        small, large = b"two", os.urandom(PUT_MAX_BYTES + 1)
        for n, data in enumerate((small, large), start=2):  # both write paths
            meta = alice.update(key, data, write_quorum=3)
            assert meta.version == n
            status = alice.get_replication(key)
            assert status.version == n and len(status.holders) == 3, status
        alice.create("single", b"one", replication_factor=1)
        for data in (small, large):
            with pytest.raises(InvalidArgument, match="replication factor 1 of 'single'"):
                alice.update("single", data, write_quorum=2)
        assert alice.read("single") == b"one"
        assert alice.get_replication("single").version == 1
        # A create's quorum is checked against the factor it asks for.
        for data in (small, large):
            with pytest.raises(InvalidArgument, match=r"replication factor 1; lower it$"):
                alice.create("refused", data, replication_factor=1, write_quorum=2)
        with pytest.raises(KeyNotFound):
            alice.get_meta("refused")


def test_wait_for_replication_honours_its_deadline(alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"x", replication_factor=3)
    t0 = time.monotonic()
    result = alice.wait_for_replication([unique_key], 4, timeout=1.0)
    waited = time.monotonic() - t0
    assert not result.reached
    assert result.statuses[0].replication == 3
    assert waited >= 1.0


def test_wait_for_replication_of_a_missing_key_fails(alice: Client) -> None:
    from blobha import KeyNotFound

    with pytest.raises(KeyNotFound):
        alice.wait_for_replication(["no-such-key"], 1, timeout=1.0)


def test_wait_for_many_keys_checks_each_before_answering(cluster: LocalCluster, alice: Client,
                                                        unique_key: str) -> None:
    from blobha import KeyNotFound, NotAuthorized

    mine, shared, private = (f"{unique_key}-{n}" for n in ("mine", "shared", "private"))
    alice.create(mine, b"1", acl="o::r")
    alice.create(shared, b"2", acl="o::r")
    alice.create(private, b"3", acl="u:alice:rwa")
    result = alice.wait_for_replication([shared, mine, private], 3, timeout=30)
    assert result.reached
    assert [s.key for s in result.statuses] == [shared, mine, private]  # in the asked order
    assert all(s.replication == 3 for s in result.statuses)
    with client_for(cluster, "bob") as bob:
        # Refused as a whole when any one key is not readable, though the others are
        # replicated: the answer tells nothing of the key bob may not read.
        with pytest.raises(NotAuthorized, match=private):
            bob.wait_for_replication([mine, private, shared], 1, timeout=0)
        assert bob.wait_for_replication([mine, shared], 1, timeout=0).reached
    with pytest.raises(KeyNotFound, match=f"{unique_key}-absent"):
        alice.wait_for_replication([mine, f"{unique_key}-absent"], 1, timeout=0)


def test_repeated_waits_leave_no_watch_callbacks_behind(cluster: LocalCluster, alice: Client,
                                                         unique_key: str) -> None:
    """Every job launch waits on the same stable keys: a wait must not leave callbacks on the
    master's ZooKeeper client until its keys next change, which may be never."""
    keys = [f"{unique_key}-{n}" for n in range(3)]
    for key in keys:
        alice.create(key, b"stable")
    assert alice.wait_for_replication(keys, 3, timeout=30).reached

    def callbacks() -> float:
        samples = [scrape(m) for m in cluster.masters]
        assert all(("blobha_zookeeper_watch_callbacks", frozenset()) in s for s in samples)
        return sum(value(s, "blobha_zookeeper_watch_callbacks") for s in samples)

    before = callbacks()
    for _ in range(20):
        assert alice.wait_for_replication(keys, 3, timeout=0).reached
        # More copies than there are masters: never reached, answered at the deadline.
        assert not alice.wait_for_replication(keys, 4, timeout=0).reached
    # A callback per wait, as before, left two per key per wait: 240 here. Shared, at most
    # the data and the list callback of each key, armed by the first wait if not before.
    assert callbacks() - before <= 2 * len(keys)
    assert all(value(scrape(m), "blobha_replication_waits") == 0 for m in cluster.masters)


def test_a_lost_holder_is_replaced_after_the_grace_period(fresh_cluster: LocalCluster) -> None:
    from support.harness import SESSION_TIMEOUT_MS, client_for

    with client_for(fresh_cluster) as c:
        masters = [m.address for m in fresh_cluster.masters]
        key = "rf2"
        c.create(key, b"two copies", replication_factor=2)
        chosen = sorted(placement.choose(key, masters, 2))
        wait_until(lambda: _holders(c, key) == chosen, 15, f"{key} held by {chosen}")
        # Lose a holder that is not the leader, so the write path is not what we measure.
        leader = fresh_cluster.leader().address
        victim = next(m for m in fresh_cluster.masters
                      if m.address in chosen and m.address != leader)
        spare = next(a for a in masters if a not in chosen)
        victim.kill()
        # Session expiry, then the replica grace (2 s here), then one fetch.
        expected = sorted({*chosen, spare} - {victim.address})
        wait_until(lambda: _holders(c, key) == expected,
                   SESSION_TIMEOUT_MS / 1000 + 2.0 + 15, f"{spare} to take the lost copy's place")
        assert c.read(key) == b"two copies"


def test_a_dead_masters_replica_nodes_stay_stop_counting_and_count_again_after_its_restart(
        fresh_cluster: LocalCluster) -> None:
    # Its death costs ZooKeeper one /holders node, not one node per key: the replica nodes
    # stay, uncounted, and its restart on the same disk counts them again without writing
    # them again (their creation zxids are unchanged).
    from support.harness import SESSION_TIMEOUT_MS

    keys = [f"stay-{i:02d}" for i in range(20)]
    with client_for(fresh_cluster) as c:
        for key in keys:
            c.create(key, key.encode(), replication_factor=3)
        assert c.wait_for_replication(keys, 3, timeout=30).reached
        m = followers(fresh_cluster)[0]
        zk = KazooClient(hosts=fresh_cluster.zk.connect_string + "/blobha")
        zk.start()
        try:
            made = {k: zk.exists(replica_path(k, m.address, 1)) for k in keys}
            assert all(stat is not None and stat.ephemeralOwner == 0 for stat in made.values())
            m.kill()
            wait_until(lambda: zk.exists(f"{HOLDERS}/{m.address}") is None,
                       SESSION_TIMEOUT_MS / 1000 + 10, "the killed master's session to end")
            assert all(c.get_replication(k).replication == 2 for k in keys)
            assert m.address not in c.get_replication(keys[0]).holders
            assert all(zk.exists(replica_path(k, m.address, 1)) is not None for k in keys)
            fresh_cluster.start_master(m)
            wait_until(lambda: all(c.get_replication(k).replication == 3 for k in keys), 60,
                       "the restarted master's copies counted again")
            for k in keys:
                stat = zk.exists(replica_path(k, m.address, 1))
                assert stat is not None and stat.czxid == made[k].czxid  # type: ignore[union-attr]
        finally:
            zk.stop()
            zk.close()


def test_a_wiped_follower_catches_up_in_batches_and_registers_in_its_own_session(
        fresh_cluster: LocalCluster) -> None:
    # More keys than one registration transaction holds, so batching and its fall-back (the
    # killed master's replica nodes outlive it until its session expires) both run.
    keys = [f"batch-{i:03d}" for i in range(250)]
    with client_for(fresh_cluster) as c:
        for key in keys:
            c.create(key, key.encode() * 10)
    m = followers(fresh_cluster)[0]
    wait_until(lambda: node_status(m.address).blob_count == len(keys), 60, "all keys everywhere")
    sources = [x for x in fresh_cluster.masters if x is not m]
    before = [scrape(x) for x in sources]
    m.kill()
    shutil.rmtree(store_dir(m))
    fresh_cluster.start_master(m)

    def caught_up() -> bool:
        s = node_status(m.address, timeout=2)
        return s.blob_count == len(keys) and s.lag_blobs == 0

    wait_until(caught_up, 120, f"{m.address} holds every key again")
    # Its nodes of the copies it lost were removed before they could count again.
    assert f"removing {len(keys)} replica node(s) of this master" in m.log_since_start()

    def served(method: str) -> float:
        return sum(value(scrape(x), "grpc_server_handled_total", grpc_method=method,
                         grpc_code="OK") - value(b, "grpc_server_handled_total",
                                                 grpc_method=method, grpc_code="OK")
                   for x, b in zip(sources, before, strict=True))

    # The small blobs came in a few FetchVersions calls (at most 200 each, per source), not in
    # a Download each.
    assert 2 <= served("FetchVersions") <= 20
    assert served("Download") < len(keys) / 10
    zk = KazooClient(hosts=fresh_cluster.zk.connect_string + "/blobha")
    zk.start()
    try:
        def counted_again() -> bool:
            # Its persistent nodes were checked against the empty disk and removed, then made
            # again as the copies came: it counts once its /holders node is back.
            if zk.exists(f"{HOLDERS}/{m.address}") is None:
                return False
            for key in keys:
                stat = zk.exists(replica_path(key, m.address, 1))
                if stat is None or stat.ephemeralOwner != 0:
                    return False
            return True

        wait_until(counted_again, 30, "every replica node back, persistent, and counted")
        # Exactly one node per holder and key: nothing registered twice, nothing stale.
        for key in keys:
            assert sorted(zk.get_children(key_path(key))) == sorted(
                f"{x.address}-1" for x in fresh_cluster.masters)
    finally:
        zk.stop()
        zk.close()
    with client_for(fresh_cluster) as c:
        assert c.read(keys[-1]) == keys[-1].encode() * 10


#: The masters follow the change journal only without the recursive watch (the setting for a
#: ZooKeeper older than 3.6, and the fallback when a server refuses that watch).
JOURNAL_MODE = {"blobstore.sync.recursive.watch": False}


def test_the_change_journal_names_each_write_and_a_gap_brings_a_listing(
        tmp_path: Path) -> None:
    with make_cluster(tmp_path, **JOURNAL_MODE) as fresh_cluster:
        fresh_cluster.wait_ready(30, expect=3)
        _journal_names_each_write_and_a_gap_brings_a_listing(fresh_cluster)


def _journal_names_each_write_and_a_gap_brings_a_listing(fresh_cluster: LocalCluster) -> None:
    zk = KazooClient(hosts=fresh_cluster.zk.connect_string + "/blobha")
    zk.start()
    try:
        with client_for(fresh_cluster) as c:
            c.create("journal-a", b"a", replication_factor=3)
            record = JournalRecord.decode(zk.get(JOURNAL)[0])
            assert record.keys[-1] == "journal-a"
            # Only creates are journalled: other changes reach the masters through the watch
            # each keeps on the key's metadata.
            c.set_replication_factor("journal-a", 2)
            c.update("journal-a", b"a2")
            assert JournalRecord.decode(zk.get(JOURNAL)[0]) == record
            c.set_replication_factor("journal-a", 3)
            assert c.wait_for_replication(["journal-a"], 3, timeout=20).reached
            # No master lists /blobstore on its own: a new key reaches the followers through
            # the journal.
            for m in followers(fresh_cluster):
                assert "listing every key" not in m.log_path.read_text()
            # Entries the followers never saw (numbers jump far ahead): each lists the keys
            # once, and the next write (numbered lower again) still reaches them.
            zk.set(JOURNAL, JournalRecord(record.last + 10_000, ()).encode())
            # Each follower must see the gap record itself before the next create rewrites it:
            # one that reads only the later record has missed nothing and rightly lists nothing.
            for m in followers(fresh_cluster):
                wait_until(lambda m=m: "listing every key" in m.log_path.read_text(), 15,
                           f"{m.address} to list the keys after the gap")
            c.create("journal-b", b"b", replication_factor=3)
            assert c.wait_for_replication(["journal-b"], 3, timeout=30).reached
    finally:
        zk.stop()
        zk.close()


def candidacy_of(zk: KazooClient, master: MasterProcess) -> tuple[str, int]:
    """``master``'s election node and the ZooKeeper session that owns it."""
    [candidacy] = [n for n in zk.get_children(ELECTION)
                   if zk.get(f"{ELECTION}/{n}")[0].decode() == master.address]
    return f"{ELECTION}/{candidacy}", zk.get(f"{ELECTION}/{candidacy}")[1].ephemeralOwner


def still_a_candidate(zk: KazooClient, session: int) -> bool:
    """Whether ``session`` (a master's) still holds an election node: it was not replaced."""
    return any(zk.get(f"{ELECTION}/{n}")[1].ephemeralOwner == session
               for n in zk.get_children(ELECTION))


def test_a_leader_deposed_within_its_session_follows_the_change_journal_again(
        tmp_path: Path) -> None:
    """A leader leaves the journal's watch unarmed (it writes every record itself). Deposed
    without losing its ZooKeeper session (here: its candidacy deleted), so with no full
    reconcile to re-arm it, it must still learn of keys the next leader creates from the
    journal: the periodic pass, which would find them too, is set out of this test's reach."""
    with make_cluster(tmp_path, **{"blobstore.sync.period.secs": 3600}, **JOURNAL_MODE) as cl:
        cl.wait_ready(30, expect=3)
        zk = KazooClient(hosts=cl.zk.connect_string + "/blobha")
        zk.start()
        try:
            with client_for(cl) as c:
                for i in range(2):  # the first create fires the leader's journal watch
                    c.create(f"before-{i}", b"x", replication_factor=3)
                old = cl.leader()
                candidacy, session = candidacy_of(zk, old)
                zk.delete(candidacy)
                wait_until(lambda: (cl.summary(timeout=1.0).leader or old.address)
                           != old.address, 30, "another master to lead")
                c.create("after", b"y", replication_factor=3)
                assert c.wait_for_replication(["after"], 3, timeout=20).reached
                assert [f.stem for f in version_files(old, "after")] == ["v1"]
                # The same session throughout: no reconnect's full reconcile did this.
                assert still_a_candidate(zk, session)
        finally:
            zk.stop()
            zk.close()


def test_a_leader_deposed_while_frozen_still_learns_the_next_leaders_keys(
        tmp_path: Path) -> None:
    """With the recursive watch, a leader passes over the events of new keys (its commits
    queue their own). Frozen while its candidacy is deleted and the next leader creates a key,
    it wakes with that key's event queued behind the one that deposes it, and takes the
    event while it still believes it leads. The listing it makes on stepping down must find
    the key: the periodic pass, which would find it too, is set out of this test's reach, and
    the session (longer than the freeze) survives, so no reconnect reconciles everything."""
    with make_cluster(tmp_path, **{"blobstore.sync.period.secs": 3600,
                                   "zookeeper.session.timeout.ms": 30_000}) as cl:
        cl.wait_ready(30, expect=3)
        zk = KazooClient(hosts=cl.zk.connect_string + "/blobha")
        zk.start()
        try:
            with client_for(cl) as c:
                c.create("before", b"x", replication_factor=3)
            old = cl.leader()
            candidacy, session = candidacy_of(zk, old)
            old.signal(signal.SIGSTOP)
            try:
                zk.delete(candidacy)
                others = [m for m in cl.masters if m is not old]
                # A summary asks every master, the frozen one too (1.5 s each).
                wait_until(lambda: any(cl.summary(via=m, timeout=5.0).leader
                                       not in ("", old.address) for m in others),
                           30, "another master to lead")
                with client_for(cl) as c:
                    c.create("after", b"y", replication_factor=3)
            finally:
                old.signal(signal.SIGCONT)
            with client_for(cl) as c:
                assert c.wait_for_replication(["after"], 3, timeout=20).reached
            assert [f.stem for f in version_files(old, "after")] == ["v1"]
            # The step-down's listing ran (a reconnect within the session, which the freeze
            # may also bring, reconciles everything and would find the key without it).
            assert "no longer leading: listing the keys once" in old.log_path.read_text()
            # The same session throughout: no new session's full reconcile did this.
            assert still_a_candidate(zk, session)
        finally:
            zk.stop()
            zk.close()


def test_fetch_versions_serves_small_versions_whole_to_masters_only(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    small = [f"{unique_key}-{i}" for i in range(3)]
    big = f"{unique_key}-big"
    for key in small:
        alice.create(key, key.encode() * 100, replication_factor=3)
    alice.create(big, os.urandom(FETCH_WHOLE_MAX_BYTES + 1), replication_factor=3)
    assert alice.wait_for_replication([*small, big], 3, timeout=30).reached
    as_master = master_metadata(cluster)
    refs = [(k, 1) for k in small] + [(big, 1), (small[0], 7), ("no-such-key", 1)]
    request = pb.FetchVersionsRequest(versions=[pb.VersionRef(key=k, version=v) for k, v in refs])
    for m in cluster.masters:
        s = stub(m.address)
        got = [v for reply in s.FetchVersions(request, timeout=10, metadata=as_master)
               for v in reply.versions]
        assert [(v.key, v.version, v.missing) for v in got] == [
            (k, v, not (v == 1 and k in small)) for k, v in refs]
        for v in got[:3]:
            assert v.data == v.key.encode() * 100
            assert v.digest == alice.get_meta(v.key).digest
        assert all(not v.data and not v.digest for v in got[3:])

        # Users download; they may not take the masters' bulk path, even for their own keys.
        with pytest.raises(grpc.RpcError) as refused:
            list(s.FetchVersions(request, timeout=10, metadata=md("alice")))
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "Download" in (refused.value.details() or "")

        too_many = pb.FetchVersionsRequest(
            versions=[pb.VersionRef(key=small[0], version=1)] * (FETCH_MAX_VERSIONS + 1))
        with pytest.raises(grpc.RpcError) as refused:
            list(s.FetchVersions(too_many, timeout=10, metadata=as_master))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    # Every master served those versions from memory (each installed them lately, together);
    # a deleted version is served by none, from memory or from disk.
    alice.delete(small[1])
    gone = pb.FetchVersionsRequest(versions=[pb.VersionRef(key=small[1], version=1)])
    for m in cluster.masters:
        wait_until(lambda m=m: [v.missing for reply in stub(m.address).FetchVersions(
                       gone, timeout=10, metadata=as_master) for v in reply.versions] == [True],
                   30, f"{m.address} no longer serving the deleted {small[1]!r}")
