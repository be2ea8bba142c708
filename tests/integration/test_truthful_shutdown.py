"""A leader stopped (SIGTERM) while a write waits for its write quorum (issue 44): it answers
the retryable "stepping down" UNAVAILABLE, never a timeout that did not happen, and the client
settles the write with the next leader."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash
from kazoo.client import KazooClient
from support.harness import (
    SESSION_TIMEOUT_MS,
    client_for,
    make_cluster,
    md,
    stub,
    version_files,
    wait_until,
)

from blobha.client import PUT_MAX_BYTES
from blobha.core.blobstate import BlobState
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.v1 import blobha_pb2 as pb
from blobha.zk.layout import HOLDERS, key_path

pytestmark = pytest.mark.integration

SESSION = SESSION_TIMEOUT_MS / 1000
#: Far beyond the test: an answer of "not acknowledged after the timeout" cannot be true.
WRITE_TIMEOUT = 120.0
KEY = "k"
SIZES = pytest.mark.parametrize("size", [4096, PUT_MAX_BYTES + 1], ids=["put", "upload"])


@pytest.fixture
def quorum_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = make_cluster(tmp_path / "c", **{"blobstore.write.timeout.secs": WRITE_TIMEOUT})
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _committed(leader: MasterProcess, version: int) -> bool:
    meta = stub(leader.address).GetMeta(pb.GetMetaRequest(key=KEY, any_access=True),
                                        metadata=md("alice"), timeout=2)
    return bool(meta.version == version)


def _stop_mid_write(cluster: LocalCluster, write: Callable[[], Any], version: int = 2
                    ) -> tuple[Future[Any], float]:
    """Freeze the followers, start ``write`` (of KEY's ``version`` with W=2), SIGTERM the
    leader once it is committed, then let the followers run again: the write's future, and
    the seconds from SIGTERM to the leader's exit."""
    leader = cluster.leader()
    others = [m for m in cluster.masters if m is not leader]
    pool = ThreadPoolExecutor(1)
    for m in others:
        m.signal(signal.SIGSTOP)
    try:
        future = pool.submit(write)
        wait_until(lambda: _committed(leader, version), 20, "the leader to commit the write")
        assert not future.done(), "answered before its quorum: the followers are frozen"
        started = time.monotonic()
        leader.signal(signal.SIGTERM)
        assert leader.wait(15)
        stopped = time.monotonic() - started
    finally:
        for m in others:
            m.signal(signal.SIGCONT)
        pool.shutdown(wait=False)
    return future, stopped


@SIZES
def test_the_stopping_leader_answers_stepping_down(quorum_cluster: LocalCluster,
                                                   size: int) -> None:
    with client_for(quorum_cluster) as c:
        c.create(KEY, b"v1", replication_factor=3)
        assert c.wait_for_replication([KEY], 3, timeout=20).reached
    leader = quorum_cluster.leader()
    s = stub(leader.address)
    data = os.urandom(size)
    digest = xxhash.xxh3_128_hexdigest(data)
    begin = pb.BeginUploadRequest(key=KEY, create=False, write_quorum=2, write_id=b"w-1")

    def write() -> Any:
        if size <= PUT_MAX_BYTES:
            return s.Put(pb.PutRequest(begin=begin, data=data, digest=digest),
                         metadata=md("alice"), timeout=60)
        up = s.BeginUpload(begin, metadata=md("alice"), timeout=10).upload_id
        s.AppendUpload(iter([pb.UploadChunk(upload_id=up, offset=0, data=data)]),
                       metadata=md("alice"), timeout=10)
        return s.CommitUpload(pb.CommitUploadRequest(upload_id=up, size=size, digest=digest),
                              metadata=md("alice"), timeout=60)

    future, _ = _stop_mid_write(quorum_cluster, write)
    err = future.exception(timeout=30)
    assert isinstance(err, grpc.RpcError), f"answered {future.result()!r}"
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert "stepping down" in (err.details() or "")


@pytest.mark.parametrize("size,create", [(4096, False), (PUT_MAX_BYTES + 1, False),
                                         (4096, True)], ids=["put", "upload", "create"])
def test_the_client_settles_a_write_its_stopping_leader_left(quorum_cluster: LocalCluster,
                                                             size: int, create: bool) -> None:
    data = os.urandom(size)
    with client_for(quorum_cluster, timeout=90.0) as c:
        c.create("warm", b"v1", replication_factor=3)  # the client reads from the leader now
        if not create:
            c.create(KEY, b"v1", replication_factor=3)
            assert c.wait_for_replication([KEY], 3, timeout=20).reached
        old = quorum_cluster.leader()
        future, stopped = _stop_mid_write(
            quorum_cluster,
            (lambda: c.create(KEY, data, replication_factor=3, write_quorum=2)) if create else
            (lambda: c.update(KEY, data, write_quorum=2)), version=1 if create else 2)
        # The stop answered the write at once (within its 2 s drain), not at a timeout.
        assert stopped < 10
        meta = future.result(timeout=90)
        assert meta.acknowledged and meta.digest == xxhash.xxh3_128_hexdigest(data)
        assert c.read(KEY) == data
        quorum_cluster.start_master(old)

        def everywhere() -> bool:
            return all(any(v.seq == meta.version and v.read_bytes() == data
                           for v in version_files(m, KEY)) for m in quorum_cluster.masters)
        wait_until(everywhere, 60, "every master to hold the write")
    zk = KazooClient(hosts=quorum_cluster.zk.connect_string + "/blobha")
    zk.start()
    try:
        state = BlobState.decode(zk.get(key_path(KEY))[0])
    finally:
        zk.stop()
        zk.close()
    # Exactly one version is this write's: a version of the stopped leader that the next one
    # rolled back (no live master held it) lost its write tag with it.
    ours = [v for v in (state, *state.history)
            if v.digest == meta.digest and v.write_tag]
    assert len(ours) == 1, (state.seq, [(h.seq, h.write_tag) for h in state.history])


def test_a_stopping_leader_ends_its_session_after_its_successor_took_a_write(
        tmp_path: Path) -> None:
    """The end of a master's session deletes every replica node it registered, and the other
    masters' ZooKeeper answers wait behind that burst of events. A leader's SIGTERM keeps the
    session (``master.stop.linger.secs``) while its successor takes office and the first
    writes; a follower's stop does not linger."""
    cluster = make_cluster(tmp_path / "c", **{"master.stop.linger.secs": 5})
    cluster.start()
    zk = KazooClient(hosts=cluster.zk.connect_string + "/blobha")
    zk.start()
    try:
        with client_for(cluster) as c:
            c.create(KEY, b"v1", replication_factor=3)
            assert c.wait_for_replication([KEY], 3, timeout=20).reached
            leader = cluster.leader()
            stat = zk.exists(f"{HOLDERS}/{leader.address}")
            assert stat is not None
            session = stat.ephemeralOwner

            def alive() -> bool:
                # Asked of ZooKeeper itself.
                return f"sid=0x{session:x}" in cluster.zk.command("cons")

            assert alive()
            leader.signal(signal.SIGTERM)
            assert c.update(KEY, b"v2").version == 2  # taken by the successor
            assert cluster.leader().address != leader.address
            assert alive(), "the session ended before the write"
            wait_until(lambda: not alive(), 30, "the former leader's session to end")
            # Its replica nodes are persistent and stay; they stopped counting with its session.
            assert zk.exists(f"{HOLDERS}/{leader.address}") is None
            assert leader.wait(30) and leader.proc is not None and leader.proc.returncode == 0
            assert "keeping the ZooKeeper session 5.0 s" in leader.log_path.read_text()

            cluster.start_master(leader)
            cluster.wait_ready(60, expect=3)
            follower = next(m for m in cluster.masters if m.address != cluster.leader().address)
            follower.signal(signal.SIGTERM)
            assert follower.wait(30) and follower.proc is not None
            assert "keeping the ZooKeeper session" not in follower.log_path.read_text(
                errors="replace")[follower.log_offset:]
    finally:
        zk.stop()
        zk.close()
        cluster.stop()
