"""Fixtures of the node-local cache's unit tests: the fake cluster and clock
(tests/support/cache_fakes.py), a cache directory and a maker of BlobCache instances over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import (
    Clock,
    FakeCluster,
)

from blobha.cache import BlobCache


@pytest.fixture
def fake() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def make(fake: FakeCluster, clock: Clock, cache_dir: Path) -> Iterator[Callable[..., BlobCache]]:
    """Builds caches on ``cache_dir`` (alice, fake clock, no retention by default)."""
    made: list[BlobCache] = []

    def build(user: str = "alice", **kw: Any) -> BlobCache:
        kw.setdefault("retention_secs", 0.0)
        kw.setdefault("clock", clock)
        if "connect" in kw:
            kw["user"] = user
        else:
            kw.setdefault("client", fake.client(user))
        c = BlobCache(kw.pop("directory", cache_dir), **kw)
        made.append(c)
        return c

    yield build
    for c in made:
        c.close()
