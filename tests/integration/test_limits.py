"""Disk reservation and unauthorised users, on real masters."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest
from conftest import client_for, make_cluster, store_dir

from blobha import KeyNotFound, NotAuthorized, ResourceExhausted
from blobha.client import Client
from blobha.localcluster import LocalCluster

pytestmark = pytest.mark.integration


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
            cluster.zk.stop()
            with pytest.raises(Unavailable, match=r"ZooKeeper|leader|unreachable|no master"):
                c.create("during", b"x")
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
