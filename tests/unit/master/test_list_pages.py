"""Listing pages: a bisection into the sorted keys, linear over a whole listing."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from blobha.master.metadata import Metadata
from blobha.master.reads import keys_after


def _pages(keys: list[str], prefix: str, size: int) -> list[list[str]]:
    pages, after = [], ""
    while True:
        page = list(keys_after(keys, prefix, after))[:size]
        if not page:
            return pages
        pages.append(page)
        after = page[-1]


def test_pages_cover_every_key_once_in_order() -> None:
    keys = sorted(f"k{i:05d}" for i in range(2500))
    pages = _pages(keys, "", 1000)
    assert [len(p) for p in pages] == [1000, 1000, 500]
    assert [k for p in pages for k in p] == keys


def test_prefix_and_token_bound_the_page() -> None:
    keys = sorted(["a", "b/1", "b/2", "b/3", "bz", "c"])
    assert list(keys_after(keys, "b/", "")) == ["b/1", "b/2", "b/3"]
    assert list(keys_after(keys, "b/", "b/1")) == ["b/2", "b/3"]
    # A token before the prefix starts at the prefix; one past it yields nothing.
    assert list(keys_after(keys, "b/", "a")) == ["b/1", "b/2", "b/3"]
    assert list(keys_after(keys, "b/", "b/3")) == []
    # A token that is no longer a key (deleted meanwhile) still resumes after it.
    assert list(keys_after(keys, "", "b/25")) == ["b/3", "bz", "c"]


class _FakeZk:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.cversion = 1
        self.children_reads = 0

    def exists_async(self, path: str) -> Any:
        return _answered(SimpleNamespace(cversion=self.cversion))

    def get_children_async(self, path: str, include_data: bool = False) -> Any:
        self.children_reads += 1
        return _answered((list(self.names), SimpleNamespace(cversion=self.cversion)))


def _answered(value: Any) -> Any:
    return SimpleNamespace(get=lambda timeout=None: value)


def test_sorted_keys_are_read_again_only_when_the_key_list_changed() -> None:
    zk = _FakeZk(["b", "a"])
    meta = Metadata(zk, SimpleNamespace(), "m1:6627", 1.0, threading.Event())  # type: ignore[arg-type]
    assert meta.sorted_keys() == ["a", "b"]
    assert meta.sorted_keys() == ["a", "b"]
    assert zk.children_reads == 1
    zk.names.append("c")
    zk.cversion += 1  # ZooKeeper bumps it on every create or delete of a child
    assert meta.sorted_keys() == ["a", "b", "c"]
    assert zk.children_reads == 2
