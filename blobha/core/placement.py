"""Which masters hold a blob: rendezvous (highest-random-weight) hashing.

For a key with replication factor R, every master is scored with ``xxh3_64(key + "|" +
address)`` and the R highest scores hold the key. Every master computes the same answer from
the same membership, with no coordination, and a change of membership moves only the keys whose
top R actually changed (about R/N of them), never a reshuffle of everything.

>>> choose("geo", ["a:1", "b:1", "c:1"], 2) == choose("geo", ["c:1", "a:1", "b:1"], 2)
True
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def score(key: str, address: str) -> int:
    return int(xxhash.xxh3_64_intdigest(f"{key}|{address}".encode()))


def choose(key: str, masters: Iterable[str], replication_factor: int) -> list[str]:
    """The ``replication_factor`` masters that hold ``key``, best first."""
    ranked = sorted(set(masters), key=lambda a: (score(key, a), a), reverse=True)
    return ranked[: max(replication_factor, 0)]
