"""Read guarantees against real masters, one of them cut off from ZooKeeper: a read carrying a
newer minimum is refused there with the stale trailer, and the client that wrote the newer
version reads it from another master, never the older one, and never the content of a key it
deleted; past the cut-off bound, reads with no minimum leave that master too; and a
linearizable read is served only once ZooKeeper confirms the version."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.clusters import FAST
from support.harness import client_for, wait_until
from support.steer import Steer
from support.zkproxy import ProxiedCluster, ZooKeeperProxy

from blobha.client import Client
from blobha.core.errors import STALE_METADATA_KEY, KeyNotFound
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.peers import CHANNEL_OPTIONS

pytestmark = pytest.mark.integration

KEY = "ryw-model"


class _CutOffCluster(LocalCluster):
    """A cluster whose last master reaches ZooKeeper through a proxy the test can hold."""

    proxy: ZooKeeperProxy | None = None

    def write_config(self, m: MasterProcess) -> None:
        super().write_config(m)
        if m.index != len(self.masters) - 1:
            return
        if self.proxy is None:
            self.proxy = ZooKeeperProxy(self.zk.connect_string)
        text = m.config_path.read_text()
        m.config_path.write_text(text.replace(self.zk.connect_string, self.proxy.address))


@contextlib.contextmanager
def cut_off_cluster(root: Path, cutoff_secs: float = 600.0) -> Iterator[_CutOffCluster]:
    """3 masters, the last reaching ZooKeeper through a proxy the test holds. By default the
    cut-off master serves its last view to reads with no minimum for the whole test."""
    c = _CutOffCluster(root, nodes=3, base_port=0,
                       overrides={**FAST, "blobstore.read.cutoff.secs": cutoff_secs})
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if c.proxy is not None:
            c.proxy.close()


@pytest.fixture
def cut_off(tmp_path: Path) -> Iterator[_CutOffCluster]:
    with cut_off_cluster(tmp_path / "cluster") as c:
        yield c


@pytest.fixture
def cut_off_now(tmp_path: Path) -> Iterator[_CutOffCluster]:
    """The cut-off master stops calling its view the latest as soon as it is cut off."""
    with cut_off_cluster(tmp_path / "cluster", 0.0) as c:
        yield c


def _first_at(client: Client, address: str) -> Client:
    """``client``, its next reads sent to ``address`` first (metadata and downloads)."""
    client._router.rng = Steer(address)
    client._router.after_write(address)  # the master metadata reads go to first
    return client


def _raw(cluster: LocalCluster, address: str, method: str, request: Any) -> Any:
    """``method`` called on one master, with no client logic between: its answer, or the
    grpc.RpcError it failed with."""
    creds = cluster.credentials("alice")
    with creds.channel(address, CHANNEL_OPTIONS) as ch:
        stub = pb_grpc.BlobStoreStub(ch)  # type: ignore[no-untyped-call]
        try:
            call = getattr(stub, method)
            reply = call(request, timeout=10, metadata=creds.metadata("alice"))
            return list(reply) if method == "Download" else reply
        except grpc.RpcError as e:
            return e


def test_a_master_behind_refuses_a_newer_minimum_and_the_writer_reads_its_own_write(
        cut_off: _CutOffCluster) -> None:
    behind = cut_off.masters[-1]
    assert cut_off.proxy is not None
    with client_for(cut_off) as alice, client_for(cut_off, "bob") as bob:
        first = alice.create(KEY, b"version one", acl="u:alice:rwa,o::r", replication_factor=3)
        assert alice.wait_for_replication([KEY], 3, 30).reached
        alice.cluster_summary()  # knows every master, so a read may go to any of them

        cut_off.proxy.hold()
        wait_until(lambda: alice.node_status(behind.address).zookeeper_unreachable, 20,
                   "the cut-off master to see ZooKeeper unreachable")
        second = alice.update(KEY, b"version two")  # by a leader among the other two
        assert second.version == first.version + 1
        assert second.created_at == first.created_at

        # The cut-off master still serves its view to a read with no minimum...
        old = _raw(cut_off, behind.address, "GetMeta", pb.GetMetaRequest(key=KEY))
        assert isinstance(old, pb.BlobMeta) and old.version == first.version
        # ...and refuses one whose minimum is newer, distinctly, for the metadata and the data.
        minimum = pb.MinVersion(version=second.version, created_at=second.created_at)
        for method, request in (
                ("GetMeta", pb.GetMetaRequest(key=KEY, min_version=minimum)),
                ("Download", pb.DownloadRequest(key=KEY, min_version=minimum)),
                ("GetReplication", pb.GetReplicationRequest(key=KEY, min_version=minimum))):
            refused = _raw(cut_off, behind.address, method, request)
            assert isinstance(refused, grpc.RpcError), f"{method} answered {refused!r}"
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert (STALE_METADATA_KEY, "1") in tuple(refused.trailing_metadata() or ())
            assert "behind" in (refused.details() or "")
        # A minimum it has reached is served.
        held = pb.MinVersion(version=first.version, created_at=first.created_at)
        served = _raw(cut_off, behind.address, "GetMeta",
                      pb.GetMetaRequest(key=KEY, min_version=held))
        assert isinstance(served, pb.BlobMeta) and served.version == first.version

        # The writer, sent to the cut-off master first every time, reads its own write.
        for _ in range(3):
            assert _first_at(alice, behind.address).get_meta(KEY).version == second.version
            assert _first_at(alice, behind.address).read(KEY) == b"version two"
        # Another client, which has seen nothing of the key, is promised nothing...
        assert _first_at(bob, behind.address).read(KEY) == b"version one"
        # ...unless it reads linearizably: then every read is of the latest version.
        with client_for(cut_off, "bob") as linear:
            linear.consistency = "linearizable"
            for _ in range(3):
                assert _first_at(linear, behind.address).read(KEY) == b"version two"
                assert _first_at(linear, behind.address).get_meta(KEY).version == second.version
                status = _first_at(linear, behind.address).get_replication(KEY)
                assert status.version == second.version
        # Once bob has read version two elsewhere, he never reads version one again.
        bob._router.after_write(cut_off.masters[0].address)
        assert bob.get_meta(KEY).version == second.version
        assert _first_at(bob, behind.address).read(KEY) == b"version two"

        # A key the client deleted is not read back from the master that still holds it.
        alice.delete(KEY)
        with pytest.raises(KeyNotFound):
            _first_at(alice, behind.address).read(KEY)
        with pytest.raises(KeyNotFound):
            _first_at(alice, behind.address).get_meta(KEY)


def _cut_off_and_update(cluster: _CutOffCluster, alice: Client) -> tuple[Any, Any]:
    behind = cluster.masters[-1]
    assert cluster.proxy is not None
    first = alice.create(KEY, b"version one", acl="u:alice:rwa,o::r", replication_factor=3)
    assert alice.wait_for_replication([KEY], 3, 30).reached
    alice.cluster_summary()
    cluster.proxy.hold()
    wait_until(lambda: alice.node_status(behind.address).zookeeper_unreachable, 20,
               "the cut-off master to see ZooKeeper unreachable")
    return first, alice.update(KEY, b"version two")


def test_past_the_cutoff_and_when_linearizable_no_read_gets_the_old_view(
        cut_off_now: _CutOffCluster) -> None:
    behind = cut_off_now.masters[-1].address
    with client_for(cut_off_now) as alice, client_for(cut_off_now, "bob") as bob:
        first, second = _cut_off_and_update(cut_off_now, alice)
        # The cut-off master no longer serves its view as the latest to a read with no
        # minimum, nor a linearizable one: both UNAVAILABLE, for the client to go elsewhere.
        refused = _raw(cut_off_now, behind, "GetMeta", pb.GetMetaRequest(key=KEY))
        assert isinstance(refused, grpc.RpcError), refused
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert (STALE_METADATA_KEY, "1") in tuple(refused.trailing_metadata() or ())
        assert "may not be the latest" in (refused.details() or "")
        for method, request in (
                ("GetMeta", pb.GetMetaRequest(key=KEY, view=pb.READ_VIEW_LINEARIZABLE)),
                ("Download", pb.DownloadRequest(key=KEY, view=pb.READ_VIEW_LINEARIZABLE)),
                ("GetReplication", pb.GetReplicationRequest(key=KEY,
                                                            view=pb.READ_VIEW_LINEARIZABLE))):
            refused = _raw(cut_off_now, behind, method, request)
            assert isinstance(refused, grpc.RpcError), f"{method} answered {refused!r}"
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot confirm the latest version" in (refused.details() or "")
        # Asked for as the last known view (what a client asks once every master it reached
        # was cut off), it is served.
        last = _raw(cut_off_now, behind, "GetMeta",
                    pb.GetMetaRequest(key=KEY, view=pb.READ_VIEW_LAST_KNOWN))
        assert isinstance(last, pb.BlobMeta) and last.version == first.version
        # Connected masters confirm the latest version for a linearizable read.
        other = cut_off_now.masters[0].address
        confirmed = _raw(cut_off_now, other, "GetMeta",
                         pb.GetMetaRequest(key=KEY, view=pb.READ_VIEW_LINEARIZABLE))
        assert isinstance(confirmed, pb.BlobMeta) and confirmed.version == second.version

        # A client that has seen nothing of the key, sent to the cut-off master first, reads
        # version two from another.
        for _ in range(3):
            assert _first_at(bob, behind).read(KEY) == b"version two"
            assert _first_at(bob, behind).get_replication(KEY).version == second.version


def test_with_zookeeper_out_for_every_master_a_new_client_reads_the_last_known_view(
        tmp_path: Path) -> None:
    c = ProxiedCluster(tmp_path / "cluster", nodes=3, base_port=0,
                       overrides={**FAST, "blobstore.read.cutoff.secs": 0.0})
    try:
        c.start()
        with client_for(c) as alice:
            alice.create(KEY, b"version one", acl="u:alice:rwa,o::r", replication_factor=3)
            assert alice.wait_for_replication([KEY], 3, 30).reached
            for proxy in c.proxies.values():
                proxy.hold()
            wait_until(lambda: all(alice.node_status(m.address).zookeeper_unreachable
                                   for m in c.masters), 20,
                       "every master to see ZooKeeper unreachable")
        # Every master refuses to call its view the latest...
        for m in c.masters:
            refused = _raw(c, m.address, "GetMeta", pb.GetMetaRequest(key=KEY))
            assert isinstance(refused, grpc.RpcError), refused
            assert (STALE_METADATA_KEY, "1") in tuple(refused.trailing_metadata() or ())
        # ...and a client that has seen nothing of the key finds that none is in touch with
        # ZooKeeper and reads the last known view: reads go on through the outage.
        with client_for(c, "bob", timeout=10.0) as bob:
            assert bob.read(KEY) == b"version one"
            assert bob._router.in_outage()
            assert bob.get_meta(KEY).version == 1
    finally:
        c.stop()


def test_a_change_a_master_heard_of_but_had_not_read_is_never_served_as_its_last_view(
        tmp_path: Path) -> None:
    """A master whose ZooKeeper goes out of reach just after telling it of a new version,
    before its read of that version is answered: its view is behind, and even a read with no
    minimum, or asking for the last known view, is refused there, not answered with the
    version before the acknowledged one."""
    c = ProxiedCluster(tmp_path / "cluster", nodes=3, base_port=0,
                       overrides={**FAST, "blobstore.read.cutoff.secs": 600.0})
    try:
        c.start()
        with client_for(c) as alice:
            first = alice.create(KEY, b"version one", acl="u:alice:rwa,o::r",
                                 replication_factor=3)
            assert alice.wait_for_replication([KEY], 3, 30).reached
            leader = c.leader()
            behind = next(m for m in c.masters if m is not leader)
            c.proxies[behind.index].hold_requests()
            second = alice.update(KEY, b"version two")
            assert second.version == first.version + 1
            wait_until(lambda: alice.node_status(behind.address).zookeeper_unreachable, 20,
                       "the master whose requests are held to see ZooKeeper unreachable")
        for view in (pb.READ_VIEW_SESSION, pb.READ_VIEW_LAST_KNOWN):
            refused = _raw(c, behind.address, "GetMeta", pb.GetMetaRequest(key=KEY, view=view))
            assert isinstance(refused, grpc.RpcError), f"served {refused!r} for view {view}"
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert (STALE_METADATA_KEY, "1") in tuple(refused.trailing_metadata() or ())
            assert "misses a change" in (refused.details() or "")
        refused = _raw(c, behind.address, "Download", pb.DownloadRequest(key=KEY))
        assert isinstance(refused, grpc.RpcError), refused
        # A client that has seen nothing of the key, sent there first, reads version two.
        with client_for(c, "bob") as bob:
            for _ in range(3):
                assert _first_at(bob, behind.address).read(KEY) == b"version two"
    finally:
        c.stop()
