"""The masters' in-memory record of which node caches hold which version."""

from __future__ import annotations

import random

from blobha.master.holders import Holders


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_holders_expire_and_the_caller_is_never_named() -> None:
    clock = Clock()
    h = Holders(lifetime=60, clock=clock, rng=random.Random(1))
    h.announce("k", 1, "a:1", complete=True)
    h.announce("k", 1, "b:1", complete=False)
    assert sorted(h.pick("k", 1, exclude="b:1", n=8)) == ["a:1"]
    assert h.pick("k", 2, exclude="", n=8) == []
    clock.now = 30
    h.announce("k", 1, "b:1", complete=False)  # renewed
    clock.now = 61
    assert h.pick("k", 1, exclude="", n=8) == ["b:1"]
    clock.now = 200
    assert h.pick("k", 1, exclude="", n=8) == [] and h.count() == 0


def test_complete_holders_first_then_a_random_subset() -> None:
    h = Holders(rng=random.Random(2))
    for i in range(20):
        h.announce("k", 1, f"p{i}:1", complete=False)
    h.announce("k", 1, "whole:1", complete=True)
    seen: set[str] = set()
    for _ in range(50):
        picked = h.pick("k", 1, exclude="", n=4)
        assert len(picked) == 4 and picked[0] == "whole:1"
        seen.update(picked)
    assert len(seen) > 15  # every holder gets named, not the same few


def test_each_cache_keeps_the_ordinal_of_its_first_announcement() -> None:
    h = Holders()
    assert [h.announce("k", 1, a, False) for a in ("a:1", "b:1", "a:1", "c:1")] == [0, 1, 0, 2]
    assert h.announce("k", 2, "c:1", False) == 0
