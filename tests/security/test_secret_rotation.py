"""Whoever read the cluster secret (from an open ZooKeeper tree, a backup, a departed
operator's notes) can call any master as the masters themselves. A rotation by an admin, and
the lock-down of an open tree, replace it: the old one is refused once every master could
have seen the change, and the cluster goes on replicating with the new one. A master cut
from ZooKeeper, which does not see the change, stops accepting it all the same; and a
lock-down cut short by a crash before its rotation is finished by the next start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from kazoo.client import KazooClient
from support.harness import FAST, SESSION_TIMEOUT_MS, client_for, make_cluster, md, stub, wait_until
from support.zkproxy import ProxiedCluster

from blobha.client import Client
from blobha.core.auth import MASTER_SECRET_METADATA_KEY
from blobha.core.errors import NotAuthorized
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.v1 import blobha_pb2 as pb
from blobha.zk.layout import MASTER_SECRET, SECRET_EXPOSED
from blobha.zk.lockdown import ZkCredentials, lock_down_tree

SESSION = SESSION_TIMEOUT_MS / 1000
#: How long a master accepts a replaced secret, and one it could not confirm
#: (ClusterIdentity.old_secret_secs).
WINDOW = 2 * SESSION
#: A cut noticed (kazoo's read timeout, 2/3 of the session), plus scheduling on two cores.
NOTICED = SESSION * 2 / 3 + 3.0

BLOBHA = str(Path(sys.executable).with_name("blobha"))


def _read_secret(cluster: LocalCluster) -> str:
    """The secret as anyone reaching an open ZooKeeper tree reads it."""
    intruder = KazooClient(hosts=cluster.zk.connect_string + "/blobha")
    intruder.start(timeout=15)
    try:
        return str(intruder.get("/master-secret")[0].decode())
    finally:
        intruder.stop()
        intruder.close()


def _as_master(cluster: LocalCluster, secret: str) -> grpc.StatusCode:
    """What a master answers a call made as the masters' principal with ``secret``."""
    return _as_master_at(cluster.masters[1], secret)


def _as_master_at(m: MasterProcess, secret: str) -> grpc.StatusCode:
    metadata = (*md("blobha-master"), (MASTER_SECRET_METADATA_KEY, secret))
    try:
        stub(m.address).NodeStatus(pb.NodeStatusRequest(), metadata=metadata, timeout=10)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _replicates(cluster: LocalCluster, key: str) -> None:
    with client_for(cluster, "alice") as alice:
        alice.create(key, os.urandom(64 * 1024), acl="u:alice:rwa", replication_factor=3,
                     write_quorum=2)
        assert alice.wait_for_replication([key], min_replication=3, timeout=30).reached


def test_a_leaked_cluster_secret_is_refused_after_rotation_and_after_lock_down(
        tmp_path: Path) -> None:
    cluster = make_cluster(tmp_path / "cluster", admins=["admin"])
    try:
        cluster.start()
        leaked = _read_secret(cluster)
        assert _as_master(cluster, leaked) is grpc.StatusCode.OK

        with client_for(cluster, "alice") as alice, pytest.raises(NotAuthorized,
                                                                 match="only the cluster's"):
            alice.rotate_cluster_secret()
        proc = subprocess.run([BLOBHA, "--cluster", cluster.cluster, "--user", "admin", "--json",
                               "admin", "rotate-secret"], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        answer = json.loads(proc.stdout)
        assert answer["generation"] == 1
        assert _read_secret(cluster) != leaked
        # Refused once every master could have seen the rotation (twice the session).
        wait_until(lambda: _as_master(cluster, leaked) is grpc.StatusCode.UNAUTHENTICATED,
                   answer["old_accepted_secs"] + 15)
        assert _as_master(cluster, _read_secret(cluster)) is grpc.StatusCode.OK
        _replicates(cluster, "after-rotation")

        # The lock-down of this open tree: the secret it exposed is replaced there too.
        leaked = _read_secret(cluster)
        for m in cluster.masters:
            m.terminate()
        cluster.zk_lockdown = True
        cluster.prepare_security()
        for m in cluster.masters:
            cluster.start_master(m)
        cluster.wait_ready(60)
        assert _as_master(cluster, leaked) is grpc.StatusCode.UNAUTHENTICATED
        _replicates(cluster, "after-lock-down")
        with Client(cluster.cluster, user="alice", timeout=30) as alice:
            assert alice.read("after-rotation")
    finally:
        cluster.stop()


def test_a_lock_down_cut_short_before_its_rotation_is_finished_by_the_next_start(
        tmp_path: Path) -> None:
    # The master locking an open tree down dies between the lock-down and the rotation that
    # follows it: the secret anyone could read while the tree was open must not stay.
    cluster = make_cluster(tmp_path / "cluster", nodes=2)
    try:
        cluster.start()
        leaked = _read_secret(cluster)
        for m in cluster.masters:
            m.terminate()
        cluster.zk_lockdown = True
        cluster.prepare_security()
        creds = ZkCredentials.from_file(cluster.secure_dir / "zookeeper.auth")
        zk = KazooClient(hosts=cluster.zk.connect_string, **creds.kazoo_args())
        zk.start(timeout=15)
        try:
            lock_down_tree(zk, "/blobha", creds)  # its first step, then the crash
            assert zk.get("/blobha" + MASTER_SECRET)[0].decode() == leaked
        finally:
            zk.stop()
            zk.close()

        for m in cluster.masters:
            cluster.start_master(m)
        cluster.wait_ready(60)
        assert _as_master(cluster, leaked) is grpc.StatusCode.UNAUTHENTICATED
        zk = KazooClient(hosts=cluster.zk.connect_string + "/blobha", **creds.kazoo_args())
        zk.start(timeout=15)
        try:
            assert zk.get(MASTER_SECRET)[0].decode() != leaked
            assert zk.exists(SECRET_EXPOSED) is None  # done once, not at every start
        finally:
            zk.stop()
            zk.close()
        _replicates_on_two(cluster, "after-crashed-lock-down")
    finally:
        cluster.stop()


def test_a_master_cut_from_zookeeper_stops_accepting_a_secret_it_cannot_confirm(
        tmp_path: Path) -> None:
    cluster = ProxiedCluster(tmp_path / "cluster", nodes=2, base_port=0, overrides=FAST)
    try:
        cluster.start()
        leader = cluster.leader()
        cut = next(m for m in cluster.masters if m is not leader)
        proxy = cluster.proxies[cut.index]
        leaked = _read_secret(cluster)
        assert _as_master_at(cut, leaked) is grpc.StatusCode.OK

        # Cut off, it does not see the rotation: the replaced secret is refused there too,
        # within the window of the loss of its connection, though it is still all it knows.
        proxy.hold()
        with Client(leader.address, user="admin", timeout=30) as admin:
            admin.rotate_cluster_secret()
        rotated = _read_secret(cluster)
        wait_until(lambda: _as_master_at(cut, leaked) is grpc.StatusCode.UNAUTHENTICATED,
                   NOTICED + WINDOW + 3, "the cut master to refuse the replaced secret")
        assert _as_master_at(cut, rotated) is grpc.StatusCode.UNAUTHENTICATED
        # Back, on a new session (the old one expired): it reads the secret before trusting.
        proxy.release()
        wait_until(lambda: _as_master_at(cut, rotated) is grpc.StatusCode.OK, 30,
                   "the new secret read on the new session")
        assert _as_master_at(cut, leaked) is grpc.StatusCode.UNAUTHENTICATED

        # Cut again with no rotation: what it holds cannot be confirmed either, and is
        # trusted again once read again, though it did not change (kazoo's DataWatch does
        # not call back then).
        proxy.hold()
        wait_until(lambda: _as_master_at(cut, rotated) is grpc.StatusCode.UNAUTHENTICATED,
                   NOTICED + WINDOW + 3, "the cut master to refuse the secret it holds")
        proxy.release()
        wait_until(lambda: _as_master_at(cut, rotated) is grpc.StatusCode.OK, 30,
                   "the unchanged secret confirmed again")
        _replicates_on_two(cluster, "after-the-cuts")
    finally:
        cluster.stop()


def _replicates_on_two(cluster: LocalCluster, key: str) -> None:
    with client_for(cluster, "alice") as alice:
        alice.create(key, os.urandom(1024), acl="u:alice:rwa", replication_factor=2)
        assert alice.wait_for_replication([key], min_replication=2, timeout=30).reached
