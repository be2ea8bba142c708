"""The fetcher's choice of sources: only masters with a ZooKeeper session now."""

from __future__ import annotations

from typing import Any

import pytest
from support.sync_fakes import ME, A, B, Guard, settings

from blobha.core.blobstate import BlobState
from blobha.core.errors import Unavailable
from blobha.sync.fetcher import Fetcher
from blobha.sync.registry import SyncDeferred


class Peers:
    """Records each fetch; every source fails, so the fetcher tries all it chose."""

    def __init__(self) -> None:
        self.tried: list[str] = []
        self.batches: list[str] = []

    def rank(self, addresses: Any) -> list[str]:
        return sorted(addresses)

    def fetch(self, address: str, *args: Any) -> None:
        self.tried.append(address)
        raise Unavailable(f"{address} failed")

    def fetch_many(self, address: str, refs: Any, timeout: float) -> list[Any]:
        self.batches.append(address)
        return []


class Staged:
    def read(self, key: str, digest: str, size: int) -> None:
        return None

    def is_whole(self, key: str, digest: str) -> bool:
        return False


class Store:
    staged = Staged()

    def find_by_digest(self, key: str, digest: str, size: int) -> None:
        return None

    def reserve(self, size: int) -> None:
        pass

    def versions(self, key: str) -> list[int]:
        return []


def state(seq: int = 3, size: int = 10) -> BlobState:
    return BlobState(seq=seq, size=size, digest="d", acl=(), replication_factor=3,
                     creator="u", created_at=0.0, updated_at=0.0, epoch=1, acked=False,
                     write_quorum=2)


def fetcher(holding: set[str]) -> tuple[Fetcher, Peers]:
    peers = Peers()
    f = Fetcher(Store(), peers, ME, None, Guard([False]), settings(),  # type: ignore[arg-type]
                lambda: set(holding))
    return f, peers


def test_a_holder_whose_session_ended_is_not_fetched_from() -> None:
    f, peers = fetcher(holding={ME, A})
    with pytest.raises(Unavailable):
        f.fetch("k", state(), [ME, A, B])
    assert peers.tried == [A]


def test_a_version_held_only_by_departed_masters_is_deferred_at_once() -> None:
    # A paused master's fetch would wait for the stall limit, and hold up the registration of
    # every other version of the batch with it.
    f, peers = fetcher(holding={ME, A})
    with pytest.raises(SyncDeferred, match="no live replica holds v3"):
        f.fetch("k", state(), [ME, B])
    assert peers.tried == []


def test_small_blobs_are_batched_only_from_a_live_holder() -> None:
    f, peers = fetcher(holding={ME, A})
    failures: dict[str, Exception] = {}
    f.fetch_all([("k", state(), [B]), ("j", state(), [A, B])], failures)
    f.shutdown()
    assert peers.batches == [A]
    assert isinstance(failures["k"], SyncDeferred)
