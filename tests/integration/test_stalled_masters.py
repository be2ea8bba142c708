"""Masters that stop answering: a paused (or cut-off) master keeps its connections open, its
place in the replica list and, until its ZooKeeper session expires, its leadership, so only the
caller can notice that it has gone quiet. Reads move to another replica, writes to the next
leader, and masters' own fetches from each other (sync) to another holder."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from support.harness import (
    SESSION_TIMEOUT_MS,
    client_for,
    followers,
    master_metadata,
    scrape,
    value,
    version_files,
    wait_until,
)
from support.steer import Steer

from blobha.client import PUT_MAX_BYTES
from blobha.core.auth import MASTER_SECRET_METADATA_KEY
from blobha.core.errors import Unavailable
from blobha.core.placement import choose
from blobha.ops.localcluster import LocalCluster
from blobha.store.local import BlobBuffer
from blobha.wire.peers import Peers

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


def test_a_read_moves_on_from_a_paused_replica(fresh_cluster: LocalCluster) -> None:
    # Before the stall watch the call waited for its whole deadline (the client's 60 s timeout)
    # and then failed the read, although two other replicas held the blob.
    data = os.urandom(3 * MiB + 5)
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("quiet", data, replication_factor=3)
        assert c.wait_for_replication(["quiet"], 3, timeout=30).reached
        paused = followers(fresh_cluster)[0]
        c.cluster_summary()  # knows every master, so it can guess at any of them
        c._router.rng = Steer(paused.address)
        paused.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert c.read("quiet") == data
            elapsed = time.monotonic() - started
        finally:
            paused.signal(signal.SIGCONT)
    # The stall limit (2 s) plus, at worst, one control call to the paused master (8 s).
    assert elapsed < 25, f"the read took {elapsed:.1f} s"


def test_a_download_paused_midway_resumes_from_another_replica(
        fresh_cluster: LocalCluster, tmp_path: Any) -> None:
    # The replica stops after sending the first bytes (over the data channel, whose receive
    # used to wait up to 30 s); the download resumes from another at the byte it reached.
    data = os.urandom(48 * MiB)
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("midway", data, replication_factor=3)
        assert c.wait_for_replication(["midway"], 3, timeout=60).reached
        paused = followers(fresh_cluster)[0]
        c.cluster_summary()
        c._router.rng = Steer(paused.address)
        stopped = threading.Event()
        first_stop_at: list[int] = []

        def progress(done: int, total: int) -> None:
            if not stopped.is_set():
                paused.signal(signal.SIGSTOP)
                stopped.set()
                first_stop_at.append(done)

        dest = tmp_path / "midway.bin"
        try:
            started = time.monotonic()
            info = c.download("midway", dest, progress=progress)
            elapsed = time.monotonic() - started
        finally:
            paused.signal(signal.SIGCONT)
    assert stopped.is_set() and first_stop_at[0] < len(data)
    assert info.size == len(data) and dest.read_bytes() == data
    assert elapsed < 25, f"the download took {elapsed:.1f} s"


def _create_while_the_leader_is_paused(cluster: LocalCluster, size: int,
                                       **client_options: Any) -> float:
    """Create a blob of ``size`` with the leader paused; how long the create took. The blob
    must then be written once, by the next leader."""
    data = os.urandom(size)
    with client_for(cluster, timeout=60.0, **client_options) as c:
        c.create("warm", b"x")  # the client knows the leader, and the others
        old = cluster.leader()
        old.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            meta = c.create("while-paused", data, replication_factor=2)
            elapsed = time.monotonic() - started
        finally:
            old.signal(signal.SIGCONT)
        assert meta.version == 1 and meta.acknowledged
        assert c.read("while-paused") == data
        assert c.get_meta("while-paused").version == 1  # written once, by the new leader
    return elapsed


@pytest.mark.parametrize("size", [4096, PUT_MAX_BYTES + 1], ids=["put", "upload"])
def test_a_write_moves_on_from_a_paused_leader(fresh_cluster: LocalCluster, size: int) -> None:
    # Before: the call to the paused leader waited for the client's whole timeout (60 s) and
    # failed, although the next leader was elected once the session expired (4 s here).
    elapsed = _create_while_the_leader_is_paused(fresh_cluster, size, stall_timeout=2.0)
    assert elapsed < 30, f"the write took {elapsed:.1f} s"


@pytest.mark.parametrize("size", [4096, PUT_MAX_BYTES + 1], ids=["put", "upload"])
def test_a_write_leaves_a_paused_leader_once_its_successor_leads(fresh_cluster: LocalCluster,
                                                                  size: int) -> None:
    # With the default stall limit (10 s), a write in the hands of a paused leader waited for
    # that limit, or for the connection's keepalive to fail (up to 8 s), although the next
    # leader was elected once the session expired. It now moves on as that leader appears.
    elapsed = _create_while_the_leader_is_paused(fresh_cluster, size)
    assert elapsed < SESSION_TIMEOUT_MS / 1000 + 3, f"the write took {elapsed:.1f} s"


def test_a_read_leaves_a_paused_leader_once_its_successor_leads(
        fresh_cluster: LocalCluster) -> None:
    # Reads stick to the leader after a write (read-your-writes), and a metadata read there
    # waited for the control timeout (8 s) while the next leader was elected in the session
    # timeout: a writer that also reads was held past its writes' own bound.
    with client_for(fresh_cluster, timeout=60.0) as c:
        c.create("sticky", b"v1")
        old = fresh_cluster.leader()
        assert c._router.preferred() == old.address
        old.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            meta = c.get_meta("sticky")
            elapsed = time.monotonic() - started
        finally:
            old.signal(signal.SIGCONT)
    assert meta.version == 1
    assert elapsed < SESSION_TIMEOUT_MS / 1000 + 3, f"the read took {elapsed:.1f} s"


def test_an_upload_paused_midway_is_made_by_the_next_leader(fresh_cluster: LocalCluster) -> None:
    # The leader stops while the bytes cross its data channel: the client's send stalls (the
    # sockets' buffers fill), gives up at the stall limit and writes it all through the next
    # leader, once, instead of waiting on the paused one.
    data = os.urandom(48 * MiB)
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("warm", b"x")  # the client knows the leader
        old = fresh_cluster.leader()
        stopped: list[int] = []

        def progress(done: int, total: int) -> None:
            if not stopped and done >= 4 * MiB:
                old.signal(signal.SIGSTOP)
                stopped.append(done)

        try:
            started = time.monotonic()
            meta = c.create("paused-upload", data, replication_factor=2, progress=progress)
            elapsed = time.monotonic() - started
        finally:
            old.signal(signal.SIGCONT)
        assert stopped and stopped[0] < len(data)
        assert meta.version == 1 and meta.acknowledged
        assert c.read("paused-upload") == data
        assert c.get_meta("paused-upload").version == 1
        new = fresh_cluster.leader()
        assert new is not old
        # The next leader took every byte over its data channel (a stall is not a reason to
        # leave the channel). What the paused one had appended is not checked: the bytes it
        # was sent may all have sat in the sockets' buffers when it stopped.
        assert value(scrape(new), "blobha_data_channel_received_bytes_total") >= len(data)
    assert elapsed < 30, f"the upload took {elapsed:.1f} s"


def test_a_replication_wait_moves_on_from_a_paused_master(fresh_cluster: LocalCluster) -> None:
    # What a Spark job does before it starts. Before: the wait sat on the paused master until
    # its timeout and failed, although every other master could have answered at once.
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("needed", b"side file", replication_factor=3)
        assert c.wait_for_replication(["needed"], 3, timeout=30).reached
        paused = followers(fresh_cluster)[0]
        c._router._preferred = paused.address  # the master this client happens to ask
        paused.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            # 2 of the 3 copies are live (the paused master's lasts until its session ends).
            result = c.wait_for_replication(["needed"], 2, timeout=60)
            elapsed = time.monotonic() - started
        finally:
            paused.signal(signal.SIGCONT)
    assert result.reached
    assert elapsed < 30, f"the wait took {elapsed:.1f} s"


def _master_peers(cluster: LocalCluster, stall_secs: float) -> Peers:
    """The channels one master uses to fetch from the others, with the cluster's secret."""
    peers = Peers("blobha-master", stall_secs=stall_secs)
    peers.set_cluster_secret(dict(master_metadata(cluster))[MASTER_SECRET_METADATA_KEY])
    return peers


@pytest.mark.parametrize("size", [64 * 1024, 3 * MiB], ids=["batch", "download"])
def test_a_sync_fetch_from_a_paused_master_gives_up_after_the_stall_limit(
        fresh_cluster: LocalCluster, size: int) -> None:
    # A follower catching up fetches from a holder chosen at random. Before, a fetch from a
    # paused holder waited for the call's whole deadline (60 s and more) or for the peer to
    # wake; the whole sync batch waited with it, and a new leader's writes for their quorum.
    data = os.urandom(size)
    with client_for(fresh_cluster, timeout=60.0) as c:
        meta = c.create("held", data, replication_factor=3)
        assert c.wait_for_replication(["held"], 3, timeout=30).reached
    paused = followers(fresh_cluster)[0]
    peers = _master_peers(fresh_cluster, stall_secs=1.0)
    try:
        buf = BlobBuffer()
        peers.fetch(paused.address, "held", meta.version, meta.digest, buf, 60.0)
        assert buf.value() == data  # it serves while awake
        paused.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(Unavailable, match="sent nothing for 1 s"):
                if size <= 64 * 1024:
                    peers.fetch_many(paused.address, [("held", meta.version)], 60.0)
                else:
                    peers.fetch(paused.address, "held", meta.version, meta.digest,
                                BlobBuffer(), 60.0)
            elapsed = time.monotonic() - started
        finally:
            paused.signal(signal.SIGCONT)
        # The master that stalled is tried after the others for a while.
        others = [m.address for m in fresh_cluster.masters if m is not paused]
        assert peers.rank([paused.address, *others])[-1] == paused.address
    finally:
        peers.close()
    # The limit, plus the data channel's connect limit (3 s) when the offer came first.
    assert elapsed < 8, f"the fetch took {elapsed:.1f} s"


def test_fetches_from_a_master_that_left_end_at_once(fresh_cluster: LocalCluster) -> None:
    # When a paused master's session ends, the masters drop their fetches from it at once
    # (Master._master_left), rather than after the stall limit: its copies no longer count.
    data = os.urandom(3 * MiB)
    with client_for(fresh_cluster, timeout=60.0) as c:
        meta = c.create("left", data, replication_factor=3)
        assert c.wait_for_replication(["left"], 3, timeout=30).reached
    paused = followers(fresh_cluster)[0]
    peers = _master_peers(fresh_cluster, stall_secs=120.0)
    outcome: list[BaseException | None] = []

    def fetch() -> None:
        try:
            peers.fetch(paused.address, "left", meta.version, meta.digest, BlobBuffer(), 120.0,
                        stream_only=True)
            outcome.append(None)
        except BaseException as e:  # reported to the test's thread
            outcome.append(e)

    paused.signal(signal.SIGSTOP)
    fetcher = threading.Thread(target=fetch, daemon=True)
    try:
        fetcher.start()
        wait_until(lambda: len(peers._stalls._watched) == 1, 10, "the fetch under way")
        started = time.monotonic()
        peers.abandon(paused.address, "it left the cluster")
        fetcher.join(10)
        elapsed = time.monotonic() - started
    finally:
        paused.signal(signal.SIGCONT)
        peers.close()
    assert not fetcher.is_alive()
    assert isinstance(outcome[0], Unavailable) and "it left the cluster" in str(outcome[0])
    assert elapsed < 5, f"the fetch ended {elapsed:.1f} s after it was abandoned"


@pytest.mark.parametrize("gone", ["paused", "stopped"])
def test_a_blob_whose_only_holder_is_out_of_reach_is_unavailable_not_missing(
        fresh_cluster: LocalCluster, gone: str) -> None:
    # Before: once the holder's session had ended, the replica list named no live holder and
    # every master said "not held here"; the read gave up with the last of them: KeyNotFound
    # (exit 3, "key not found") for a key that exists, which a script could take for gone and
    # create again.
    data = os.urandom(1000)
    masters = {m.address: m for m in fresh_cluster.masters}
    [placed] = choose("solo", masters, 1)
    holder = masters[placed]
    with client_for(fresh_cluster, timeout=20.0, stall_timeout=2.0) as c:
        c.create("solo", data, replication_factor=1)

        def settled() -> bool:
            # The one copy where the placement puts it, in ZooKeeper and on disk alone: the
            # leader's first copy has moved there, and nothing moves any more.
            on_disk = [m.address for m in fresh_cluster.masters if version_files(m, "solo")]
            return c.get_replication("solo").holders == (placed,) and on_disk == [placed]

        wait_until(settled, 60, "the key's one copy where the placement puts it")
        if gone == "paused":
            holder.signal(signal.SIGSTOP)  # still listed: its session lives on
        else:
            holder.terminate()
            wait_until(lambda: not c.get_replication("solo").holders, 60,
                       "the stopped holder's replica node gone")
        try:
            with pytest.raises(Unavailable) as e:
                c.read("solo")
        finally:
            if gone == "paused":
                holder.signal(signal.SIGCONT)
            else:
                fresh_cluster.start_master(holder)
        assert "could not download 'solo'" in str(e.value)
        assert c.wait_for_replication(["solo"], 1, timeout=60).reached
        assert c.read("solo") == data
