"""The node cache never goes back a version, against real masters, one of which reaches
ZooKeeper through a proxy the test holds (test_read_your_writes.py's cluster): cut off, it
keeps serving the version before the last update, and every cache client here asks it first.

A cache that holds version two on disk (a restarted process, whose copy a crash damaged, so
it must fetch it again) gets version two, never version one from the master behind; its
update check does not record version one for the node either.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.harness import client_for, wait_until
from test_read_your_writes import _CutOffCluster, _first_at, cut_off_cluster

from blobha.cache import BlobCache
from blobha.client import BlobMeta, Client
from blobha.core.keys import key_dirname

pytestmark = pytest.mark.integration

KEY = "cache-min-model"
ONE, TWO = b"version one\n" * 4096, b"version two\n" * 4096


@pytest.fixture
def cut_off(tmp_path: Path) -> Iterator[_CutOffCluster]:
    with cut_off_cluster(tmp_path / "cluster") as c:
        yield c


def updated_past_the_cut_off_master(
        cluster: _CutOffCluster, before_update: Callable[[], object] = lambda: None,
) -> tuple[BlobMeta, BlobMeta]:
    """Version one on every master (then ``before_update`` runs); the last master cut off
    from ZooKeeper; version two committed by the others. Both versions' metadata."""
    behind = cluster.masters[-1]
    assert cluster.proxy is not None
    with client_for(cluster) as alice:
        first = alice.create(KEY, ONE, acl="o::r", replication_factor=3)
        assert alice.wait_for_replication([KEY], 3, 30).reached
        before_update()
        cluster.proxy.hold()
        wait_until(lambda: alice.node_status(behind.address).zookeeper_unreachable, 20,
                   "the cut-off master to see ZooKeeper unreachable")
        second = alice.update(KEY, TWO)
        assert alice.wait_for_replication([KEY], 2, 30).reached
    assert (second.version, second.created_at) == (first.version + 1, first.created_at)
    return first, second


def cache_client(cluster: _CutOffCluster, first_at: str) -> Client:
    """A client for a cache, which knows every master and asks ``first_at`` first."""
    client = client_for(cluster)
    client.cluster_summary()
    return _first_at(client, first_at)


def test_a_restarted_cache_fetches_a_damaged_copy_again_at_its_version_not_the_one_before(
        cut_off: _CutOffCluster, tmp_path: Path) -> None:
    _first, second = updated_past_the_cut_off_master(cut_off)
    behind, current = cut_off.masters[-1].address, cut_off.masters[0].address
    # The master behind still answers version one to a client that has seen nothing newer.
    with cache_client(cut_off, behind) as fresh:
        assert fresh.get_meta(KEY).version == second.version - 1

    node = tmp_path / "node"
    with BlobCache(node, client=cache_client(cut_off, current)) as cache:
        held = cache.get(KEY)
    assert (held.version, held.path.read_bytes()) == (second.version, TWO)
    # A crash damages the copy (same size, other bytes); the next process must fetch it again.
    held.path.chmod(0o644)
    held.path.write_bytes(ONE)

    with BlobCache(node, client=cache_client(cut_off, behind),
                   update_interval_secs=0) as restarted:
        blob = restarted.get(KEY)
        assert (blob.version, blob.path.read_bytes()) == (second.version, TWO)
        # Its update check, which the node's other processes reuse, says version two too.
        record = node / "blobs" / key_dirname(KEY) / "checks" / key_dirname("alice")
        assert json.loads(record.read_bytes())["version"] == second.version
        # And again, with the master behind asked first: still version two.
        restarted._cluster()._router.after_write(behind)
        assert restarted.get(KEY).version == second.version
        assert [e.version for e in restarted.entries()] == [second.version]
