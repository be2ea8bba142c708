"""Forwarded writes on a real cluster: with W >= 2 the leader sends a small write's bytes to the
key's other holders while it commits, and the commit itself is the acknowledgement once their
staged copies make the quorum (blobha.master.forward, blobha.master.staging)."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from kazoo.client import KazooClient
from support.harness import (
    client_for,
    followers,
    master_metadata,
    md,
    scrape,
    store_dir,
    stub,
    value,
    version_files,
)
from support.waiting import wait_until

from blobha.core.blobstate import BlobState
from blobha.core.digest import Digester
from blobha.core.errors import KeyNotFound
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.v1 import blobha_pb2 as pb
from blobha.zk.layout import EPOCH, EpochRecord, holders, key_path

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
#: Below the sync's own stall limit of ten seconds, so a stalled holder shows in seconds.
STALL = {"blobstore.sync.stall.secs": 1.5}


@contextmanager
def zookeeper(cluster: LocalCluster) -> Iterator[KazooClient]:
    zk = KazooClient(hosts=cluster.zk.connect_string + "/blobha")
    zk.start()
    try:
        yield zk
    finally:
        zk.stop()
        zk.close()


def committed(zk: KazooClient, key: str) -> BlobState:
    data, stat = zk.get(key_path(key))
    return BlobState.decode(data, stat.version)


def replica_holders(zk: KazooClient, key: str, seq: int) -> list[str]:
    return holders(zk.get_children(key_path(key)), seq)


def staged_files(m: MasterProcess) -> list[Path]:
    d = store_dir(m) / "staged"
    return sorted(d.iterdir()) if d.exists() else []


def digest_of(data: bytes) -> str:
    d = Digester()
    d.update(data)
    return d.hexdigest()


def test_a_w2_create_is_acknowledged_by_its_commit_with_a_staged_copy_confirmed(
        cluster: LocalCluster, unique_key: str) -> None:
    data = os.urandom(4096)
    leader = cluster.leader()
    with client_for(cluster) as c:
        meta = c.create(unique_key, data, replication_factor=3, write_quorum=2)
    assert meta.acknowledged
    with zookeeper(cluster) as zk:
        state = committed(zk, unique_key)
        # Acknowledged in the commit's own transaction: the record was never written again.
        assert state.acked and state.meta_version == 0, state
        others = {m.address for m in cluster.masters} - {leader.address}
        assert state.confirmed and set(state.confirmed) <= others, state
        # Each confirmed holder installs its staged copy on seeing the commit and then
        # registers its replica node, as a fetched copy would be.
        wait_until(lambda: set(state.confirmed) <= set(replica_holders(zk, unique_key, 1)),
                   timeout=20, what="the confirmed holders' replica nodes")
    for m in cluster.masters:
        if m.address in state.confirmed:
            copies = version_files(m, unique_key)
            assert [v.seq for v in copies] == [1] and copies[0].read_bytes() == data


def test_with_w3_the_create_returns_with_three_holders(
        cluster: LocalCluster, unique_key: str) -> None:
    data = os.urandom(10_000)
    with client_for(cluster) as c:
        meta = c.create(unique_key, data, replication_factor=3, write_quorum=3)
        status = c.get_replication(unique_key)
    assert meta.acknowledged
    assert status.replication == 3, status
    assert set(status.holders) == {m.address for m in cluster.masters}


def test_a_holder_killed_mid_forward_does_not_fail_w2_writes(fresh_cluster: LocalCluster,
                                                             unique_key: str) -> None:
    victim = followers(fresh_cluster)[0]
    payloads = {f"{unique_key}-{i}": os.urandom(4096 + i) for i in range(40)}
    results: dict[str, Any] = {}
    took: list[float] = []
    started = threading.Event()

    def write() -> None:
        with client_for(fresh_cluster, timeout=60.0) as c:
            for n, (key, data) in enumerate(payloads.items()):
                if n == 5:
                    started.set()
                began = time.monotonic()
                try:
                    results[key] = c.create(key, data, replication_factor=3, write_quorum=2)
                except Exception as e:
                    results[key] = e
                took.append(time.monotonic() - began)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert started.wait(60)
        victim.kill()  # SIGKILL, while forwards to it are in flight
    finally:
        writer.join(120)
    assert not writer.is_alive()
    failed = {k: r for k, r in results.items() if isinstance(r, Exception)}
    assert not failed, failed
    assert all(r.acknowledged for r in results.values())
    # Not one waited for the victim's session to expire (4 s) or for a retry: the failed
    # forward only dropped it.
    assert max(took) < 2.5, sorted(took)[-3:]
    # Back up, the victim keeps nothing half-written: a forward cut short was never confirmed
    # and goes at start-up; what it had staged is installed or expires.
    fresh_cluster.start_master(victim)
    with zookeeper(fresh_cluster) as zk:
        for key in payloads:
            wait_until(lambda key=key: victim.address in replica_holders(zk, key, 1),
                       timeout=60, what=f"{key} on the restarted holder")
    wait_until(lambda: not staged_files(victim), timeout=30, what="the staged copies gone")
    with client_for(fresh_cluster) as c:
        for key, data in payloads.items():
            assert c.read(key) == data


@pytest.mark.parametrize("fresh_cluster", [STALL], indirect=True)
def test_a_stalled_holder_is_dropped_and_the_write_completes(fresh_cluster: LocalCluster,
                                                             unique_key: str) -> None:
    paused, other = followers(fresh_cluster)[:2]
    with client_for(fresh_cluster, timeout=60.0) as c:
        c.create(f"{unique_key}-warm", b"x")  # the client knows the leader
        paused.signal(signal.SIGSTOP)
        try:
            began = time.monotonic()
            meta = c.create(unique_key, os.urandom(4096), replication_factor=3, write_quorum=2)
            elapsed = time.monotonic() - began
        finally:
            paused.signal(signal.SIGCONT)
    assert meta.acknowledged
    with zookeeper(fresh_cluster) as zk:
        state = committed(zk, unique_key)
    assert state.acked and state.confirmed == (other.address,), state
    # Not held up to the stall limit (the forward's bound): once the other holder made the
    # quorum, the paused one was waited for only about as long again.
    assert elapsed < 1.0, f"the write took {elapsed:.1f} s"


def test_a_deposed_leaders_forward_is_refused_and_a_staged_copy_is_never_served(
        cluster: LocalCluster, unique_key: str) -> None:
    holder = followers(cluster)[0]
    with zookeeper(cluster) as zk:
        epoch = EpochRecord.decode(zk.get(EPOCH)[0]).epoch
    data = b"never committed"
    version = pb.StagedVersion(key=unique_key, size=len(data), digest=digest_of(data),
                               data=data)
    metadata = master_metadata(cluster)
    holder_stub = stub(holder.address)
    # From an epoch older than the newest: its leader was deposed.
    with pytest.raises(grpc.RpcError) as refused:
        holder_stub.StageVersions(pb.StageVersionsRequest(epoch=epoch - 1, versions=[version]),
                                  metadata=metadata, timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A user is no master.
    with pytest.raises(grpc.RpcError) as denied:
        holder_stub.StageVersions(pb.StageVersionsRequest(epoch=epoch, versions=[version]),
                                  metadata=md("alice"), timeout=10)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Staged by the current epoch but never committed: no master serves it as a version.
    reply = holder_stub.StageVersions(pb.StageVersionsRequest(epoch=epoch, versions=[version]),
                                      metadata=metadata, timeout=10)
    assert list(reply.staged) == [True]
    assert staged_files(holder)
    with client_for(cluster) as c:
        with pytest.raises(KeyNotFound):
            c.get_meta(unique_key)
        with pytest.raises(KeyNotFound):
            c.read(unique_key)
    assert not version_files(holder, unique_key)
    # It expires as an abandoned upload does (blobstore.upload.expiration.secs).
    wait_until(lambda: not staged_files(holder), timeout=30, what="the staged copy expired")
    with client_for(cluster) as c, pytest.raises(KeyNotFound):
        c.get_meta(unique_key)


def test_a_w2_streamed_upload_is_forwarded_as_it_arrives(cluster: LocalCluster,
                                                         unique_key: str) -> None:
    data = os.urandom(24 * 1024 * 1024 + 11)  # many chunks, not one Put
    leader = cluster.leader()
    with client_for(cluster, timeout=60.0) as c:
        meta = c.create(unique_key, data, replication_factor=3, write_quorum=2)
    assert meta.acknowledged
    with zookeeper(cluster) as zk:
        state = committed(zk, unique_key)
        assert state.acked and state.meta_version == 0, state
        assert len(state.confirmed) == 1 and state.confirmed[0] != leader.address, state
        wait_until(lambda: state.confirmed[0] in replica_holders(zk, unique_key, 1),
                   timeout=30, what="the confirmed holder's replica node")
    holder = next(m for m in cluster.masters if m.address == state.confirmed[0])
    copies = version_files(holder, unique_key)
    assert [v.seq for v in copies] == [1] and copies[0].read_bytes() == data
    # Moved in whole, not copied: nothing of it is left staged.
    assert not [p for p in staged_files(holder) if p.suffix in (".blob", ".json", ".part")]


class _Gated(io.RawIOBase):
    """An upload's source (a stream, as from a pipe) that holds its bytes past ``first`` until
    ``go`` is set, so a test can act while an upload is part way."""

    def __init__(self, data: bytes, first: int, go: threading.Event) -> None:
        self._data = memoryview(data)
        self._first = first
        self._go = go
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._at >= self._first:
            assert self._go.wait(60), "the test never let the upload go on"
        end = len(self._data) if self._at >= self._first else self._first
        n = min(len(b), end - self._at)
        b[:n] = self._data[self._at:self._at + n]
        self._at += n
        return n


def upload_parts(m: MasterProcess) -> list[Path]:
    """The files of the upload sessions under way at ``m`` (a streamed forward is one)."""
    return sorted((store_dir(m) / "tmp").glob("upload-*.part"))


def received(m: MasterProcess) -> int:
    return sum(p.stat().st_size for p in upload_parts(m))


@pytest.mark.parametrize("fresh_cluster", [STALL], indirect=True)
@pytest.mark.parametrize("fault", ["paused", "killed"])
def test_a_holder_lost_mid_forwarded_upload_is_dropped_and_the_upload_completes(
        fresh_cluster: LocalCluster, unique_key: str, fault: str) -> None:
    data = os.urandom(96 * MiB + 7)  # past the 32 MiB a holder may trail by
    go = threading.Event()
    outcome: dict[str, Any] = {}

    def upload() -> None:
        with client_for(fresh_cluster, timeout=60.0) as c:
            try:
                outcome["meta"] = c.create(unique_key, _Gated(data, 24 * MiB, go),
                                           replication_factor=3, write_quorum=2)
            except Exception as e:
                outcome["error"] = e

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        # W=2: the stream goes to one of the other masters.
        holder, = wait_until(
            lambda: [m for m in followers(fresh_cluster) if received(m) > 0], timeout=30,
            what="the forward's first bytes at a holder")
        if fault == "paused":
            holder.signal(signal.SIGSTOP)  # past the stall limit: it never answers again
        else:
            holder.kill()
        go.set()
        uploader.join(120)
    finally:
        go.set()
        holder.signal(signal.SIGCONT)
    assert not uploader.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["meta"].acknowledged  # by the other holder's ordinary sync
    with zookeeper(fresh_cluster) as zk:
        assert holder.address not in committed(zk, unique_key).confirmed
    with client_for(fresh_cluster) as c:
        assert c.read(unique_key) == data
    if fault == "killed":
        fresh_cluster.start_master(holder)
    # The lost holder keeps nothing half-written: its unfinished staging goes (expired, or at
    # start-up), and it syncs the version as any follower does.
    wait_until(lambda: not upload_parts(holder), timeout=30, what="the unfinished staging gone")
    assert not [p for p in staged_files(holder) if p.suffix == ".part"]
    with zookeeper(fresh_cluster) as zk:
        wait_until(lambda: holder.address in replica_holders(zk, unique_key, 1), timeout=60,
                   what="the holder's own replica of the version")
    assert [v.read_bytes() == data for v in version_files(holder, unique_key)] == [True]


@contextmanager
def full_disk(cluster: LocalCluster, m: MasterProcess, headroom: int) -> Iterator[Path]:
    """``m`` restarted on a small file system of its own (a tmpfs over its data directory,
    its contents copied in), filled until ``headroom`` bytes are left; undone on the way out."""
    import shutil
    import subprocess

    data = store_dir(m)
    m.terminate()
    saved = data.with_name(data.name + "-saved")
    shutil.copytree(data, saved, symlinks=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(data)], check=True)
    try:
        shutil.copytree(saved, data, symlinks=True, dirs_exist_ok=True)
        filler = data / "filler"
        free = shutil.disk_usage(data).free
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\0" * max(free - headroom, 0))
        cluster.start_master(m)
        cluster.wait_ready(60, expect=len(cluster.masters))
        yield data
    finally:
        m.terminate()
        subprocess.run(["umount", "-l", str(data)], check=False)
        shutil.rmtree(saved, ignore_errors=True)


def test_a_holder_with_a_full_disk_is_passed_over(fresh_cluster: LocalCluster,
                                                  unique_key: str) -> None:
    # A stream goes to the first of the other holders by address: this one.
    full = min(followers(fresh_cluster), key=lambda m: m.address)
    # A quarter of a megabyte left (the test clusters reserve none): room for the small
    # copies, none for a big one, forwarded or fetched.
    with full_disk(fresh_cluster, full, headroom=2**18) as data:
        small = {f"{unique_key}-{i}": os.urandom(4096) for i in range(10)}
        big = {f"{unique_key}-big-{i}": os.urandom(3 * 2**20 + i) for i in range(3)}
        with client_for(fresh_cluster, timeout=60.0) as c:
            for key, body in {**small, **big}.items():
                began = time.monotonic()
                meta = c.create(key, body, replication_factor=3, write_quorum=2)
                assert meta.acknowledged, key
                assert time.monotonic() - began < 10, key
            for key, body in {**small, **big}.items():
                assert c.read(key) == body
        with zookeeper(fresh_cluster) as zk:
            for key in big:
                state = committed(zk, key)
                assert full.address not in state.confirmed, state
        # Nothing half-written stays on the full holder: no staged copy it could not finish,
        # and none of the big versions.
        assert not [p for p in (data / "staged").glob("*") if p.suffix in (".part", ".blob")] \
            if (data / "staged").exists() else True
        for key in big:
            assert version_files(full, key) == []


def test_forwards_ride_a_few_stage_links_not_a_call_each(cluster: LocalCluster,
                                                          unique_key: str) -> None:
    leader = cluster.leader()
    holders = [m for m in cluster.masters if m is not leader]
    before = {m.address: scrape(m) for m in cluster.masters}
    with client_for(cluster) as c:
        for i in range(20):
            assert c.create(f"{unique_key}-{i}", os.urandom(4096), replication_factor=3,
                            write_quorum=2).acknowledged
    after = {m.address: scrape(m) for m in cluster.masters}

    def grew(m: MasterProcess, name: str, **labels: str) -> float:
        return (value(after[m.address], name, **labels)
                - value(before[m.address], name, **labels))

    # One forward per write (W-1 = 1 holder; a hedge to the spare when the machine is slow
    # adds one), every batch over a link, none over gRPC.
    forwarded = grew(leader, "blobha_forwarded_versions_total")
    assert 20 <= forwarded < 40, forwarded
    assert grew(leader, "blobha_forward_calls_total", path="link") == forwarded
    assert grew(leader, "blobha_forward_calls_total", path="grpc") == 0
    for m in holders:
        assert grew(m, "grpc_server_started_total", grpc_method="StageVersions") == 0
    # Links are kept and reused: a handful at most were opened for the twenty batches (none
    # when an earlier test's are still open).
    opened = sum(grew(m, "blobha_data_channel_stage_links_total") for m in holders)
    assert opened <= 8, opened
