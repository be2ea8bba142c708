"""Fixtures of the client unit tests: a client over the in-memory fake cluster
(tests/support/client_fakes.py) and a fake clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.client_fakes import (
    M1,
    M2,
    M3,
    FakeClock,
    FakeCluster,
    KiB,
)

from blobha.client import Client, ClientLimits
from blobha.client import retry as retry_mod


@pytest.fixture
def resumable_only(client: Client) -> None:
    """Every upload takes the resumable path (begin, append, commit), however small."""
    client.limits = ClientLimits(put_max_bytes=-1)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(retry_mod, "_monotonic", fake)
    return fake


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def client(cluster: FakeCluster, clock: FakeClock) -> Iterator[Client]:
    c = Client([M1, M2, M3], user="alice", timeout=30.0, chunk_size=256 * KiB, transport=cluster)
    c._router.sleep = clock.sleep
    with c:
        yield c
    assert cluster.closed
