"""Masters that stop answering: a paused (or cut-off) master keeps its connections open, its
place in the replica list and, until its ZooKeeper session expires, its leadership, so only the
client can notice that it has gone quiet. Reads move to another replica, writes to the next
leader."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import MutableSequence, Sequence
from typing import Any

import pytest
from conftest import client_for, followers

from blobha.client import PUT_MAX_BYTES
from blobha.localcluster import LocalCluster

pytestmark = pytest.mark.integration

MiB = 1024 * 1024


class _Steer(random.Random):
    """The client's random picks, steered so that ``first`` is always tried first."""

    def __init__(self, first: str) -> None:
        super().__init__(0)
        self.first = first

    def choice(self, seq: Sequence[Any]) -> Any:
        return self.first if self.first in seq else seq[0]

    def shuffle(self, x: MutableSequence[Any]) -> None:  # type: ignore[override]
        ordered = sorted(x, key=lambda a: a != self.first)
        x[:] = ordered


def test_a_read_moves_on_from_a_paused_replica(fresh_cluster: LocalCluster) -> None:
    # Before the stall watch the call waited for its whole deadline (the client's 60 s timeout)
    # and then failed the read, although two other replicas held the blob.
    data = os.urandom(3 * MiB + 5)
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("quiet", data, replication_factor=3)
        assert c.wait_for_replication(["quiet"], 3, timeout=30).reached
        paused = followers(fresh_cluster)[0]
        c.cluster_summary()  # knows every master, so it can guess at any of them
        c._rng = _Steer(paused.address)
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
        c._rng = _Steer(paused.address)
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


@pytest.mark.parametrize("size", [4096, PUT_MAX_BYTES + 1], ids=["put", "upload"])
def test_a_write_moves_on_from_a_paused_leader(fresh_cluster: LocalCluster, size: int) -> None:
    # Before: the call to the paused leader waited for the client's whole timeout (60 s) and
    # failed, although the next leader was elected once the session expired (4 s here).
    data = os.urandom(size)
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("warm", b"x")  # the client knows the leader
        old = fresh_cluster.leader()
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
    assert elapsed < 30, f"the write took {elapsed:.1f} s"


def test_a_replication_wait_moves_on_from_a_paused_master(fresh_cluster: LocalCluster) -> None:
    # What a Spark job does before it starts. Before: the wait sat on the paused master until
    # its timeout and failed, although every other master could have answered at once.
    with client_for(fresh_cluster, timeout=60.0, stall_timeout=2.0) as c:
        c.create("needed", b"side file", replication_factor=3)
        assert c.wait_for_replication(["needed"], 3, timeout=30).reached
        paused = followers(fresh_cluster)[0]
        c._preferred = paused.address  # the master this client happens to ask
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
