"""Reads from a replica that stops answering: a paused master keeps its connections open and
its place in the replica list until its ZooKeeper session expires, so only the client can
notice that it has gone quiet."""

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
