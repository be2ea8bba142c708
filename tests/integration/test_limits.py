"""Disk reservation and unauthorised users, on real masters."""

from __future__ import annotations

import io
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
