"""Disk reservation and unauthorised users, on real masters."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.harness import client_for, make_cluster, md, store_dir, stub, wait_until

from blobha import InvalidArgument, KeyNotFound, NotAuthorized, ResourceExhausted
from blobha.client import Client
from blobha.core.digest import digest_bytes
from blobha.core.errors import REFUSED_METADATA_KEY
from blobha.master.edge.gatekeeper import client_call_threads, wait_call_threads
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))


def test_disk_reservation_refuses_before_writing(tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path / "c", **{"blobstore.disk.reserved.bytes": 10**18})
    cluster.start()
    try:
        with client_for(cluster, timeout=10) as c:
            with pytest.raises(ResourceExhausted, match=r"blobstore\.disk\.reserved\.bytes"):
                c.create("big", b"x" * 100_000)
            # A stream of unknown size is refused at its first chunk.
            with pytest.raises(ResourceExhausted):
                c.create("stream", io.BytesIO(b"y" * 100_000))
            with pytest.raises(KeyNotFound):
                c.get_meta("big")
            for m in cluster.masters:
                assert not any((store_dir(m) / "tmp").iterdir())
                assert not any((store_dir(m) / "keys").iterdir())
            s = c.cluster_summary()
            assert all(m.disk_free > 0 for m in s.masters)
    finally:
        cluster.stop()


def test_unauthorised_operations_are_refused(cluster: LocalCluster, alice: Client,
                                             unique_key: str) -> None:
    alice.create(unique_key, b"alice's", acl="u:alice:rwa,u:reader:r")
    with client_for(cluster, "reader") as reader:
        assert reader.read(unique_key) == b"alice's"
        with pytest.raises(NotAuthorized):
            reader.update(unique_key, b"no")
        with pytest.raises(NotAuthorized):
            reader.delete(unique_key)
        with pytest.raises(NotAuthorized):
            reader.set_replication_factor(unique_key, 1)
    with client_for(cluster, "stranger") as stranger:
        with pytest.raises(NotAuthorized):
            stranger.get_meta(unique_key)
        with pytest.raises(NotAuthorized):
            stranger.wait_for_replication([unique_key], 1, timeout=1)
    assert alice.read(unique_key) == b"alice's"
    assert alice.get_meta(unique_key).version == 1


def test_metadata_shown_without_read_leaves_out_what_read_alone_may_see(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"guess me", acl="u:alice:rwa,u:wendy:-w-")
    with client_for(cluster, "wendy") as wendy:
        meta = wendy.get_meta(unique_key)
        # A writer may test guesses of a small secret against the digest; the live copies
        # are GetReplication's, which needs READ.
        assert (meta.version, meta.size, meta.digest, meta.replication) == (1, 8, "", 0)
        assert not meta.readable and meta.access == 2
        with pytest.raises(NotAuthorized):
            wendy.get_replication(unique_key)
    shown = alice.get_meta(unique_key)
    assert shown.digest == digest_bytes(b"guess me") and shown.replication >= 1
    # A client that does not ask for it (older ones took any answer as leave to read the
    # blob) is answered as before: READ or nothing.
    s = stub(cluster.leader().address)
    with pytest.raises(grpc.RpcError) as err:
        s.GetMeta(pb.GetMetaRequest(key=unique_key), metadata=md("wendy"), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert s.GetMeta(pb.GetMetaRequest(key=unique_key, any_access=True),
                     metadata=md("wendy"), timeout=10).access == 2


def test_an_acl_too_large_for_zookeeper_is_refused_before_it_reaches_it(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    # 4,500 entries of long names: about 1.2 MB in the key's node, past ZooKeeper's limit.
    # ZooKeeper refused it by dropping the leader's connection, at every retry of the client,
    # which gave up after its timeout with "may have been made".
    acl = [pb.AccessControl(type="u", name=f"user-{i:05d}-" + "n" * 240, access=1)
           for i in range(4500)]
    data = b"x"
    begin = pb.BeginUploadRequest(key=unique_key, create=True, acl=acl, write_id=b"w" * 16)
    with pytest.raises(grpc.RpcError) as e:
        stub(cluster.leader().address).Put(
            pb.PutRequest(begin=begin, data=data, digest=digest_bytes(data)), timeout=30,
            metadata=md("alice"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the 1,000 a key may hold" in (e.value.details() or "")
    with pytest.raises(KeyNotFound):
        alice.get_meta(unique_key)
    # The same ACL through the client is refused before it is sent, as is a change to it.
    from blobha.core.acl import AccessControl
    entries = [AccessControl("u", f"user-{i}", 1) for i in range(1001)]
    with pytest.raises(InvalidArgument, match="1,001 entries"):
        alice.create(unique_key, data, acl=entries)
    alice.create(unique_key, data)
    with pytest.raises(InvalidArgument, match="1,001 entries"):
        alice.set_acl(unique_key, entries)
    assert alice.read(unique_key) == data


def test_an_acl_is_bounded_by_the_bytes_zookeeper_holds(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    # Before: 1,000 names of 256 CJK characters, within the entry and name limits, were
    # stored escaped (1.5 MB). ZooKeeper refused the request by dropping the leader's
    # connection, at every retry, until the client gave up: "ZooKeeper is unreachable".
    from blobha.core.acl import ALL, READ, AccessControl

    def names(char: str) -> list[AccessControl]:
        # With alice's own entry, 1,000: a setter keeps only ADMIN otherwise (as in Storm).
        return [AccessControl("u", "alice", ALL)] + [
            AccessControl("u", f"{i:04d}" + char * 252, READ) for i in range(999)]

    alice.create(unique_key, b"x")
    wide = names("日")
    alice.set_acl(unique_key, wide)
    assert set(wide) <= set(alice.get_meta(unique_key).acl)
    # Four-byte characters take 1 MB: refused by the client before it sends them, and by the
    # master (the raw call) before ZooKeeper sees them.
    with pytest.raises(InvalidArgument, match="bytes as stored"):
        alice.set_acl(unique_key, names("😀"))
    request = pb.SetMetaRequest(
        key=unique_key, set_acl=True,
        acl=[pb.AccessControl(type=e.type, name=e.name, access=e.access) for e in names("😀")])
    with pytest.raises(grpc.RpcError) as e:
        stub(cluster.leader().address).SetMeta(request, timeout=30, metadata=md("alice"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes as stored" in (e.value.details() or "")
    assert set(wide) <= set(alice.get_meta(unique_key).acl)  # unchanged
    assert alice.read(unique_key) == b"x"


def test_a_user_holding_too_many_unfinished_uploads_is_refused_and_others_are_not(
        cluster: LocalCluster, unique_key: str) -> None:
    # Each session keeps a file open on the leader: a client looping on BeginUpload ran it
    # out of descriptors, for everyone, until the sessions expired.
    leader = stub(cluster.leader().address)

    def begin(user: str, n: int) -> str:
        reply = leader.BeginUpload(pb.BeginUploadRequest(
            key=f"{unique_key}-{user}-{n}", create=True, size_hint=-1), metadata=md(user),
            timeout=10)
        return str(reply.upload_id)

    held = [begin("carol", n) for n in range(64)]  # blobstore.upload.max.per.user
    try:
        with pytest.raises(grpc.RpcError) as e:
            begin("carol", 64)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "64 unfinished uploads" in (e.value.details() or "")
        leader.AbortUpload(pb.AbortUploadRequest(upload_id=begin("dave", 0)),
                           metadata=md("dave"), timeout=10)
        leader.AbortUpload(pb.AbortUploadRequest(upload_id=held.pop()), metadata=md("carol"),
                           timeout=10)
        held.append(begin("carol", 64))  # room again
    finally:
        for upload_id in held:
            leader.AbortUpload(pb.AbortUploadRequest(upload_id=upload_id),
                               metadata=md("carol"), timeout=10)


def test_users_calls_cannot_take_every_thread_of_a_master(tmp_path: Path) -> None:
    # Long calls (replication waits, here, each from another user) could take every call thread
    # of a master. They may take only some of the threads open to users: beyond that they are
    # refused at once as busy, and the client retries; the rest stay for users' other calls,
    # the other masters' replication and status checks, so the master still answers one (a
    # client that gets none gives up on the master as paused). A waiting caller that goes away
    # gives its thread back.
    threads = 8
    waits_share = wait_call_threads(threads)
    assert waits_share < client_call_threads(threads)
    cluster = make_cluster(tmp_path / "c", nodes=2, **{"master.rpc.threads": threads})
    cluster.start()
    try:
        leader = cluster.leader()
        master = stub(leader.address)
        with client_for(cluster, timeout=60) as c:
            c.create("held", b"x", acl="o::r", replication_factor=1)
            # Replication 3 on a cluster of two: each waits its whole 600 s.
            request = pb.WaitForReplicationRequest(keys=["held"], min_replication=3,
                                                   timeout_secs=600)
            probe = pb.WaitForReplicationRequest(keys=["held"], min_replication=3,
                                                 timeout_secs=0)
            waits: list[Any] = []
            try:

                def waits_share_taken() -> bool:
                    # Until the share is full, a wait refused because another call briefly
                    # held a slot is sent again.
                    waits[:] = [w for w in waits if not w.done()]
                    while len(waits) < waits_share:
                        waits.append(master.WaitForReplication.future(
                            request, timeout=900, metadata=md(f"waiter-{len(waits)}")))
                    try:
                        master.WaitForReplication(probe, timeout=5, metadata=md("alice"))
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                        assert "waits and upload streams hold all" in (e.details() or ""), e
                        return True
                    return False

                wait_until(waits_share_taken, timeout=30,
                           what="a user's wait refused at once as busy")
                # Users' other calls, and status checks, are still answered.
                master.GetMeta(pb.GetMetaRequest(key="held"), timeout=5, metadata=md("alice"))
                assert master.NodeStatus(pb.NodeStatusRequest(), timeout=5,
                                         metadata=md("alice")).address == leader.address
                pauses: list[float] = []
                sleep = c._router.sleep

                def pause_then_let_go(secs: float) -> None:
                    # The client was refused and backs off: the waiters go away meanwhile.
                    pauses.append(secs)
                    for w in waits:
                        w.cancel()
                    sleep(secs)

                c._router.sleep = pause_then_let_go
                # Their slots come back within about a second (no reply to wait for), and the
                # retried call is served.
                assert c.wait_for_replication(["held"], 1, timeout=30).reached
                assert pauses, "the call was never refused: users had a free thread"
            finally:
                for w in waits:
                    w.cancel()
    finally:
        cluster.stop()


def test_a_master_told_to_stop_while_zookeeper_is_down_exits_by_itself(tmp_path: Path) -> None:
    """SIGTERM with ZooKeeper unreachable: the master resigns as far as it can and exits on
    its own, cleanly (it used to wait forever for ZooKeeper to delete its candidacy)."""
    cluster = make_cluster(tmp_path / "c")
    cluster.start()
    try:
        leader = cluster.leader()
        cluster.zk.stop()
        leader.signal(signal.SIGTERM)
        # Waited for here, before LocalCluster's own SIGKILL fallback could hide a hang. The
        # hang was forever; the bound only keeps a loaded CI machine from failing it.
        assert leader.wait(30), "the master did not exit within 30 s of SIGTERM"
        assert leader.proc is not None and leader.proc.returncode == 0
        assert "could not resign through ZooKeeper" in leader.log_path.read_text()
    finally:
        cluster.stop()


def test_zookeeper_unreachable_gives_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    from blobha import Unavailable

    cluster = make_cluster(tmp_path / "c")
    cluster.start()
    try:
        with client_for(cluster, timeout=3) as c:
            c.create("kept", b"before the outage", replication_factor=3)
            assert c.wait_for_replication(["kept"], 3, timeout=10).reached
            addresses = [m.address for m in cluster.masters]
            assert not any(c.node_status(a).zookeeper_unreachable for a in addresses)
            cluster.zk.stop()
            # Each master's status says it is cut off (before, 'blobha health' said plain ok).
            wait_until(lambda: all(c.node_status(a).zookeeper_unreachable for a in addresses),
                       30, "every master to report ZooKeeper unreachable")
            health = subprocess.run([BLOBHA, "health", addresses[0]], capture_output=True,
                                    text=True, timeout=60)
            assert health.returncode == 0, health.stderr  # it answers, and serves reads
            assert health.stdout.startswith(f"ok {addresses[0]} ")
            assert "ZooKeeper unreachable, serving reads of what it holds" in health.stdout
            # The cluster view answers from the masters last seen (before, it retried for the
            # whole timeout and then failed), and says it is that view.
            view = subprocess.run([BLOBHA, "--cluster", ",".join(addresses), "cluster",
                                   "--json"], capture_output=True, text=True, timeout=60)
            assert view.returncode == 0, view.stderr
            doc = json.loads(view.stdout)
            assert doc["zookeeper_unreachable"] is True and doc["blob_count"] is None
            assert doc["leader"] == ""  # no master leads without its session
            assert sorted(m["address"] for m in doc["masters"]) == sorted(addresses)
            assert all(m["reachable"] and m["zookeeper_unreachable"] for m in doc["masters"])
            with pytest.raises(Unavailable, match="ZooKeeper"):
                c.create("during", b"x")
            # Refused before it ran, and marked so on the wire: a client that carried a write
            # need not ask (of a cluster in trouble) whether it was made.
            data = b"x"
            with pytest.raises(grpc.RpcError) as err:
                stub(addresses[0]).Put(pb.PutRequest(
                    begin=pb.BeginUploadRequest(key="during", create=True), data=data,
                    digest=digest_bytes(data)), metadata=md("alice"), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lost its ZooKeeper connection" in (err.value.details() or "")
            assert (REFUSED_METADATA_KEY, "1") in tuple(err.value.trailing_metadata() or ())
            # A caller hears of a long retry once, with the reason, before it gives up (the
            # command line says it on a terminal).
            told: list[str] = []
            with client_for(cluster, timeout=8) as patient:
                patient.on_retry = lambda what, why, left: told.append(f"{what}: {why}")
                with pytest.raises(Unavailable, match="within 8 s"):
                    patient.create("during", b"x")
            assert len(told) == 1 and told[0].startswith("create 'during': "), told
            assert "ZooKeeper" in told[0], told
            # Reads of committed blobs keep working from the masters' last committed view...
            assert c.read("kept") == b"before the outage"
            assert c.get_meta("kept").version == 1
            # ...but nothing unknown is made up.
            with pytest.raises(Unavailable, match="no record"):
                c.get_meta("never-created")
            cluster.zk.start()
        # Sessions survive a short outage; the cluster serves again without a restart.
        cluster.wait_ready(60, expect=3)
        with client_for(cluster, timeout=30) as c:
            assert c.read("kept") == b"before the outage"
            c.create("after", b"y")
            assert c.wait_for_replication(["after"], 3, timeout=20).reached
            with pytest.raises(KeyNotFound):
                c.get_meta("during")
    finally:
        cluster.stop()
